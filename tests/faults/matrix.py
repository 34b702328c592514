"""The fault-injection matrix: brokers x named points x faults, and which cells apply.

A row is a named point met by one kind of message (a first delivery, a duplicate, a
conflicting copy, a refused intent, a message without identity); a column group is a
fault; a column is a broker set-up. One worker run walks every row of a (set-up, fault)
pair at once: a message per row, each with its own fault.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FAULTS",
    "ROWS",
    "SETUPS",
    "Cell",
    "Row",
    "Setup",
    "in_subset",
    "not_applicable",
    "render",
]

FAULTS = ("raise", "cut", "restart", "kill")
FAULT_NAMES = {
    "raise": "an exception raised at the point",
    "cut": "the worker's database sessions terminated at the point",
    "restart": "PostgreSQL restarted at the point (the worker blocked meanwhile)",
    "kill": "the worker SIGKILLed at the point (a replacement started)",
}


@dataclass(frozen=True, slots=True)
class Setup:
    adapter: str  # dramatiq, faststream
    broker: str  # redis, rabbitmq, nats
    guard: bool = False  # FastStream: inbox.guard(broker)
    asyncio: bool = False  # Dramatiq: an async def actor

    @property
    def name(self) -> str:
        short = {"dramatiq": "dq", "faststream": "fs"}[self.adapter]
        extra = ("+guard" if self.guard else "") + ("+async" if self.asyncio else "")
        return f"{short}-{self.broker}{extra}"


SETUPS = (
    Setup("dramatiq", "redis"),
    Setup("dramatiq", "redis", asyncio=True),
    Setup("dramatiq", "rabbitmq"),
    Setup("faststream", "rabbitmq"),
    Setup("faststream", "rabbitmq", guard=True),
    Setup("faststream", "redis"),
    Setup("faststream", "redis", guard=True),
    Setup("faststream", "nats"),
    Setup("faststream", "nats", guard=True),
)


def in_subset(setup: Setup, fault: str, offset: int) -> bool:
    """Whether the cell (``setup``, ``fault``) is in ``scripts/test``'s representative
    subset: each set-up with two of the faults (two apart), each fault with four or five
    set-ups; an odd ``offset`` takes the other half (``scripts/test`` sets the day's
    number, so two days' runs walk the whole matrix; ``INBOX_TEST_FULL=1`` runs every
    cell)."""
    index = SETUPS.index(setup) + offset
    return FAULTS.index(fault) in (index % len(FAULTS), (index + 2) % len(FAULTS))


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    point: str
    message: str
    """check (the run's first message), first, duplicate (sent again once the first
    committed), retry (its handler fails once first), refused (its handler raises
    PermanentError: poison), conflict (its id again with another payload), noid."""
    occurrence: int = 1
    """The fault fires the n-th time the point is reached for the message's id."""


ROWS = (
    Row("check", "check", "check"),
    Row("before_claim", "before_claim", "first"),
    Row("claim", "claim", "first"),
    Row("handler", "handler", "first"),
    Row("commit", "commit", "first"),
    Row("after_commit", "after_commit", "first"),
    Row("settle", "settle", "first"),
    Row("claim (duplicate)", "claim", "duplicate", occurrence=2),
    Row("settle (duplicate)", "settle", "duplicate", occurrence=2),
    Row("record (failed attempt)", "record", "retry"),
    Row("record (poison)", "record", "refused"),
    Row("quarantine_publish", "quarantine_publish", "conflict"),
    Row("dead_letter_publish (poison)", "dead_letter_publish", "refused"),
    Row("dead_letter_publish (no id)", "dead_letter_publish", "noid"),
)

RESTART_SUBSET = {
    "check",
    "claim",
    "commit",
    "after_commit",
    "record (failed attempt)",
    "quarantine_publish",
}
"""The database-restart column is run for these rows only: each restart costs seconds.
In the transaction (claim, commit), just after it, at the first-message check, and at the
two writes outside it (a failure's record, a conflict's quarantine row then its publish)."""
RESTART_VARIANT_SUBSET = {"claim", "commit"}
"""For the variants (FastStream with guard, the async Dramatiq actor), whose delivery path
is their base set-up's, the restart column is run at these rows only."""


def not_applicable(setup: Setup, row: Row, fault: str) -> str | None:
    """Why the cell does not apply (or is not run), None when it does."""
    if row.point == "check":
        if setup.adapter == "dramatiq":
            return "n.a.: Dramatiq checks the database at worker boot, before any message"
        if setup.guard:
            return "n.a.: inbox.guard runs the check at start-up, before any message"
    if fault == "restart":
        if row.name not in RESTART_SUBSET:
            return "not run: the restart column is a subset (matrix.RESTART_SUBSET)"
        if (setup.guard or setup.asyncio) and row.name not in RESTART_VARIANT_SUBSET:
            return "not run: a variant's restart column is smaller (RESTART_VARIANT_SUBSET)"
    return None


@dataclass
class Cell:
    setup: Setup
    row: Row
    fault: str
    status: str  # pass, FAIL, n.a., skip
    detail: str = ""


def render(cells: list[Cell]) -> str:
    """The matrix as text: a table per fault, then every failure and its reason."""
    setups = [s for s in SETUPS if any(c.setup == s for c in cells)]
    by_key = {(c.setup, c.row.name, c.fault): c for c in cells}
    width = max(len(r.name) for r in ROWS) + 2
    col = max(len(s.name) for s in setups) + 2
    lines: list[str] = []
    notes: list[str] = []
    for fault in FAULTS:
        if not any(c.fault == fault for c in cells):
            continue
        lines.append(f"\n{fault}: {FAULT_NAMES[fault]}")
        lines.append("".ljust(width) + "".join(s.name.ljust(col) for s in setups))
        for row in ROWS:
            line = row.name.ljust(width)
            for setup in setups:
                cell = by_key.get((setup, row.name, fault))
                if cell is None:
                    mark = "-"
                elif cell.status in ("n.a.", "skip"):
                    mark = cell.status
                else:
                    mark = cell.status
                    if cell.status == "FAIL" or cell.detail:
                        notes.append(f"  {setup.name} / {row.name} / {fault}: {cell.detail}")
                line += mark.ljust(col)
            lines.append(line.rstrip())
    reasons = sorted({c.detail for c in cells if c.status in ("n.a.", "skip")})
    if reasons:
        lines.append("\nnot applicable / not run:")
        lines += [f"  {reason}" for reason in reasons]
    if notes:
        lines.append("\ncells with failures or notes:")
        lines += notes
    passed = sum(1 for c in cells if c.status == "pass")
    failed = sum(1 for c in cells if c.status == "FAIL")
    lines.append(f"\n{passed} pass, {failed} FAIL, {len(cells) - passed - failed} n.a./not run")
    return "\n".join(lines)
