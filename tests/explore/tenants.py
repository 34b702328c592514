"""The tenants of a run over a map (``databases`` "map"): which an intent is sent for.
Apart from `brokers`, so that `mover` imports it without the explorer's array."""

from __future__ import annotations

__all__ = ["TENANTS", "tenant_of"]

TENANTS = ("t0", "t1")
"""Over a map of two databases, each intent's tenant, one a database."""


def tenant_of(key: str) -> str:
    """The tenant an intent is sent for over a map: a function of its key alone, so that
    every copy of it goes to the same database."""
    return TENANTS[sum(key.encode()) % len(TENANTS)]
