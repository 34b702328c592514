"""Test support: real services, per-run databases, fault injection, worker processes."""
