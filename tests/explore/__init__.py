"""The explorer: seeded configurations, workloads and fault schedules, run on real
processes and servers, their histories checked for loss, doubles and wrong records.

``python -m tests.explore --help``; docs/explanation/exploration.md says what it covers.
"""
