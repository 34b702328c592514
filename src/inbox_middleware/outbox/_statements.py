"""Every statement of the outbox, built once per table naming and dialect.

Recording (`insert`, `notify`) runs on PostgreSQL and SQLite, inside the caller's
transaction. Dispatching (`lease`, `settle`) is PostgreSQL only: it relies on
``FOR UPDATE SKIP LOCKED``. The operator's statements (`listing`, `show`, `counts`,
`retry_ids`, `retry_all`) run on both. Table names come from the validated
`InboxSchema`, never from text.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    Boolean,
    Executable,
    Float,
    Integer,
    Interval,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    column,
    func,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from .._storage.tables import InboxSchema

__all__ = ["OutboxStatements", "notify_channel", "statements_for"]

PENDING, DISPATCHED, FAILED = "pending", "dispatched", "failed"
STATUSES = (PENDING, DISPATCHED, FAILED)


def notify_channel(naming: InboxSchema) -> str:
    """The LISTEN/NOTIFY channel of one outbox table, so two outboxes never wake each other."""
    return f"{naming.schema or ''}.{naming.name('message_outbox')}"


@cache
def statements_for(naming: InboxSchema, dialect: str) -> OutboxStatements:
    return OutboxStatements(naming, dialect)


class OutboxStatements:
    """The outbox's SQL for one naming and dialect (``postgresql`` or ``sqlite``)."""

    def __init__(self, naming: InboxSchema, dialect: str) -> None:
        self.dialect = dialect
        self.channel = notify_channel(naming)
        outbox = self.table = naming.tables.outbox
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert

        # -- insert: record one effect in the caller's transaction ------------------------
        # A second add of the same effect id (the handler ran again after a rollback that
        # did not reach the inbox, or an explicit id reused) keeps the first row.
        self.insert: Executable = (
            insert(outbox)
            .values(
                effect_id=bindparam("effect_id", type_=Text),
                destination=bindparam("destination", type_=Text),
                payload=bindparam("payload", type_=outbox.c.payload.type),
                headers=bindparam("headers", type_=outbox.c.headers.type),
                status=PENDING,
                attempts=0,
                next_attempt_at=func.now(),
                created_at=func.now(),
            )
            .on_conflict_do_nothing(index_elements=[outbox.c.effect_id])
        )

        # -- notify: wake listening dispatchers when the transaction commits --------------
        self.notify: Executable = select(func.pg_notify(bindparam("channel", type_=Text), ""))
        # -- probe: a dispatcher checks that a NOTIFY reaches its LISTEN connection -------
        self.probe: Executable = select(
            func.pg_notify(bindparam("channel", type_=Text), bindparam("payload", type_=Text))
        )

        # -- counts: effects per status ---------------------------------------------------
        self.counts: Executable = select(outbox.c.status, func.count()).group_by(outbox.c.status)

        # -- show: one effect -------------------------------------------------------------
        self.show: Executable = select(outbox).where(
            outbox.c.effect_id == bindparam("effect_id", type_=Text)
        )

        # -- retry: failed effects are pending again, with a fresh attempt budget ---------
        retry = (
            update(outbox)
            .where(outbox.c.status == FAILED)
            .values(
                status=PENDING,
                attempts=0,
                next_attempt_at=func.now(),
                leased_until=null(),
                lease_token=null(),
            )
            .returning(outbox.c.effect_id)
        )
        self.retry_ids: Executable = retry.where(
            outbox.c.effect_id.in_(bindparam("effect_ids", expanding=True))
        )
        self.retry_all: Executable = retry.where(
            or_(
                bindparam("only_destination", type_=Text).is_(None),
                outbox.c.destination == bindparam("only_destination", type_=Text),
            )
        )

        if dialect == "postgresql":
            # -- bounds: each dispatcher transaction ends on the server within a lease ----
            # Its statements are cancelled after ``ms``, and the server ends the session
            # when the transaction waits that long for its client (a COMMIT lost with the
            # connection): the rows it leased would stay locked otherwise, and every
            # other dispatcher's SKIP LOCKED would pass over them without a word.
            # Transaction-local, so safe behind a transaction pooler.
            self.bounds: Executable = select(
                func.set_config("statement_timeout", bindparam("ms", type_=Text), true()),
                func.set_config(
                    "idle_in_transaction_session_timeout", bindparam("ms", type_=Text), true()
                ),
            )
            self.lease = self._lease()
            self.settle = self._settle()
            self.next_due = self._next_due()

    def _lease(self) -> Executable:
        """Lease due effects for one dispatcher, in one short transaction.

        SKIP LOCKED lets concurrent dispatchers take disjoint sets without waiting. The
        lease moves next_attempt_at to the lease's end, so the partial index of due
        effects also finds leases whose dispatcher died. The attempt is counted here, so
        an effect that keeps killing its dispatcher still runs out of attempts.
        """
        outbox = self.table
        due = (
            select(outbox.c.effect_id)
            .where(
                outbox.c.status == PENDING,
                outbox.c.next_attempt_at <= func.now(),
                outbox.c.destination == any_(bindparam("destinations", type_=ARRAY(Text))),
            )
            .order_by(outbox.c.next_attempt_at)
            .limit(bindparam("limit", type_=Integer))
            .with_for_update(skip_locked=True)
            .cte("due")
        )
        until = func.now() + bindparam("lease", type_=Interval)
        return (
            update(outbox)
            .where(outbox.c.effect_id == due.c.effect_id)
            .values(
                lease_token=bindparam("token", type_=Text),
                leased_until=until,
                next_attempt_at=until,
                attempts=outbox.c.attempts + 1,
            )
            .returning(
                outbox.c.effect_id,
                outbox.c.destination,
                outbox.c.payload,
                outbox.c.headers,
                outbox.c.attempts,
                outbox.c.created_at,
            )
        )

    def _next_due(self) -> Executable:
        """Seconds until the next pending effect of these destinations is due (negative:
        due already; NULL: none pending). A leased effect counts at its lease's end."""
        outbox = self.table
        return select(func.extract("epoch", func.min(outbox.c.next_attempt_at) - func.now())).where(
            outbox.c.status == PENDING,
            outbox.c.destination == any_(bindparam("destinations", type_=ARRAY(Text))),
        )

    def _settle(self) -> Executable:
        """Record a batch's outcomes, each only while the batch's lease token holds.

        One row per effect: its new status (pending again, dispatched or failed), the
        remote result or the error, the retry delay, whether the retry must also wait for
        the lease to end (after an ambiguous timeout), and whether the attempt is given
        back (a lease released unattempted). RETURNING names the effects recorded; any
        other lost its lease to another dispatcher.
        """
        outbox = self.table
        rows = (
            func.unnest(
                *(
                    cast(bindparam(_ARRAYS[name], type_=ARRAY(kind)), ARRAY(kind))
                    for name, kind in _COLUMNS.items()
                )
            )
            .table_valued(*(column(name, kind) for name, kind in _COLUMNS.items()))
            .render_derived(name="outcome")
        )
        now = func.now()
        retry_at = func.greatest(
            now + func.make_interval(0, 0, 0, 0, 0, 0, rows.c.delay),
            case((rows.c.after_lease, outbox.c.leased_until), else_=now),
        )
        return (
            update(outbox)
            .where(
                and_(
                    outbox.c.effect_id == rows.c.effect_id,
                    outbox.c.lease_token == bindparam("token", type_=Text),
                    outbox.c.status == PENDING,
                )
            )
            .values(
                status=rows.c.status,
                attempts=outbox.c.attempts - rows.c.uncount,
                next_attempt_at=case(
                    (rows.c.status == PENDING, retry_at), else_=outbox.c.next_attempt_at
                ),
                leased_until=null(),
                lease_token=null(),
                last_error=func.coalesce(rows.c.error, outbox.c.last_error),
                dispatched_at=case((rows.c.status == DISPATCHED, now), else_=null()),
                remote_result=func.coalesce(cast(rows.c.result, JSONB), outbox.c.remote_result),
            )
            .returning(outbox.c.effect_id)
        )

    def listing(self, status: str | None, destination: str | None, limit: int) -> Executable:
        """Effects for the operator, newest first, optionally of one status and destination."""
        outbox = self.table
        query = select(outbox).order_by(outbox.c.created_at.desc(), outbox.c.effect_id)
        if status is not None:
            query = query.where(outbox.c.status == status)
        if destination is not None:
            query = query.where(outbox.c.destination == destination)
        return query.limit(limit)

    @staticmethod
    def settle_params(token: str, outcomes: list[dict[str, Any]]) -> dict[str, Any]:
        """Column arrays for `settle` from one dict per outcome."""
        params: dict[str, Any] = {
            array: [outcome[name] for outcome in outcomes] for name, array in _ARRAYS.items()
        }
        params["token"] = token
        return params


# One outcome's fields, and the array parameter each travels in.
_COLUMNS = {
    "effect_id": Text,
    "status": Text,
    "result": Text,
    "error": Text,
    "delay": Float,
    "after_lease": Boolean,
    "uncount": Integer,
}
_ARRAYS = {
    "effect_id": "effect_ids",
    "status": "statuses",
    "result": "results",
    "error": "errors",
    "delay": "delays",
    "after_lease": "after_leases",
    "uncount": "uncounts",
}
