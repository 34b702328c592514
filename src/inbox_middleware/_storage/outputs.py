"""Stored outputs (`outputs.Output`): their statements.

The insert runs on the claim's own connection, inside its transaction, after the handler
returned: the output commits with the claim and the domain change, or not at all. A row
is written once a claim (a first-seen claim's replaces what a purged claim of the same
key left), and only for consumers whose outputs something uses.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, bindparam, func, select
from sqlalchemy.dialects import postgresql, sqlite

from .._core.outputs import Output
from .._core.protocol import Delivery
from .tables import IDENTITY_KEY, InboxSchema

__all__ = ["OutputStatements"]


class OutputStatements:
    """Store and load the output of a claim, for one naming and dialect."""

    def __init__(self, naming: InboxSchema, dialect: str) -> None:
        outputs = naming.tables.outputs
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        store = insert(outputs).values(
            **{name: bindparam(name) for name in IDENTITY_KEY},
            body=bindparam("body"),
            content_type=bindparam("content_type"),
            headers=bindparam("headers", type_=outputs.c.headers.type),
            created_at=func.now(),
        )
        # A first-seen claim's output replaces any row of its key: one a purged claim of
        # the same identity left (the outputs go after their claims), which a duplicate of
        # this claim must not send for it.
        self._replace = store.on_conflict_do_update(
            index_elements=list(IDENTITY_KEY),
            set_={
                name: getattr(store.excluded, name)
                for name in ("body", "content_type", "headers", "created_at")
            },
        )
        # A shadow-mode rerun of a duplicate keeps the first delivery's output.
        self._keep = store.on_conflict_do_nothing()
        self._load = select(outputs.c.body, outputs.c.content_type, outputs.c.headers).where(
            *(outputs.c[name] == bindparam(name) for name in IDENTITY_KEY)
        )

    def store(
        self, conn: Connection, delivery: Delivery, output: Output, *, first_seen: bool
    ) -> None:
        """Write ``output`` in the transaction ``conn`` has open (the claim's): the
        claim's own when it is ``first_seen``, else (a shadow-mode rerun) unless one is
        stored."""
        conn.execute(
            self._replace if first_seen else self._keep,
            _key(delivery)
            | {
                "body": output.body,
                "content_type": output.content_type,
                "headers": dict(output.headers),
            },
        )

    def load(self, conn: Connection, delivery: Delivery) -> Output | None:
        """The stored output of ``delivery``'s claim; None when nothing was stored."""
        row = conn.execute(self._load, _key(delivery)).one_or_none()
        if row is None:
            return None
        body = bytes(row.body) if row.body is not None else None
        return Output(body, row.content_type, dict(row.headers or {}))


def _key(delivery: Delivery) -> dict[str, Any]:
    return dict(zip(IDENTITY_KEY, delivery.key, strict=True))
