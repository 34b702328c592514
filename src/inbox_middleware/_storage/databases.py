"""The statements that create and drop whole databases (the test suite's throwaway
databases, `inbox_middleware._operate.throwaway`). They run outside a transaction, on a connection
to another database of the server; the names are the library's own, generated, never a
user's."""

from __future__ import annotations

__all__ = ["create_database", "drop_database"]


def create_database(name: str, template: str | None = None) -> str:
    """``CREATE DATABASE``, a copy of ``template`` when given."""
    copy = f' TEMPLATE "{template}"' if template is not None else ""
    return f'CREATE DATABASE "{name}"{copy}'


def drop_database(name: str) -> str:
    """``DROP DATABASE``, its sessions ended (``WITH (FORCE)``), nothing if it is gone."""
    return f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
