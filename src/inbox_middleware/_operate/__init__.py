"""Operators' modules and reports above storage: the settlement report and
counts, status, explain, metrics serving, repairs, the purge, the test harness."""
