"""The fault-injection suite at the adapter boundary: for each broker set-up, a fault at
each named point of a delivery (`inbox_middleware._core.faults`), in real worker processes on
the real servers. Run it alone, under the lock that guards server restarts::

    flock /tmp/inbox-faults.lock .venv/bin/python -m pytest -m faults

The matrix (set-up x point x fault) is printed at the end of the run and written to
``faults-matrix.txt`` in pytest's base temporary directory.

Its rows for what handlers, deployments and outages do (`test_paths`), each with two or
three worker processes: handler misuse (the claim's transaction ended, the message
settled behind the inbox), dynamic subscribers, several workers through a database stop,
workers started during a restart, and the backlog at start-up of issue 27 (item 1); they
stop and start the outage PostgreSQL of their own (``scripts/services postgres-outage``).
"""
