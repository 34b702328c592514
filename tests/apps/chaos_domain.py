"""The domain the chaos run protects, and what its worker processes report.

Accounts with balances, and a journal with one row per applied intent (by message id,
deliberately without a unique key: an intent applied twice must show up, not fail). A
credit to an account that does not exist is refused with `PermanentError`: that is how
the chaos stream's permanent failures are made.

Each worker process writes its statistics (RSS, connection pool, outcomes) to a JSON file
every half second, so the controller can watch processes it does not share memory with.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session

from inbox_middleware import PermanentError, current_delivery

ACCOUNTS = 100
DDL = [
    "CREATE TABLE IF NOT EXISTS chaos_accounts (id integer PRIMARY KEY, balance bigint NOT NULL)",
    """CREATE TABLE IF NOT EXISTS chaos_journal (
        message_id text NOT NULL,
        account_id integer NOT NULL,
        delta bigint NOT NULL,
        pid integer NOT NULL
    )""",
]

_CREDIT = text("UPDATE chaos_accounts SET balance = balance + :d WHERE id = :a")
_JOURNAL = text(
    "INSERT INTO chaos_journal (message_id, account_id, delta, pid) VALUES (:m, :a, :d, :p)"
)


def reset(conn: Connection) -> None:
    """Create the tables (or empty them), with every account at zero."""
    for statement in DDL:
        conn.exec_driver_sql(statement)
    conn.exec_driver_sql("TRUNCATE chaos_accounts, chaos_journal")
    conn.execute(
        text("INSERT INTO chaos_accounts (id, balance) VALUES (:a, 0)"),
        [{"a": account} for account in range(1, ACCOUNTS + 1)],
    )


def credit(session: Session, account_id: int, delta: int) -> None:
    """The effect of one intent, in the inbox's transaction."""
    delivery = current_delivery(session)
    assert delivery is not None, "credit runs only inside the inbox's transaction"
    if session.execute(_CREDIT, {"a": account_id, "d": delta}).rowcount == 0:
        raise PermanentError("unknown_account", f"account {account_id} does not exist")
    session.execute(
        _JOURNAL,
        {"m": delivery.identity.message_id, "a": account_id, "d": delta, "p": os.getpid()},
    )


async def credit_async(session: Any, account_id: int, delta: int) -> None:
    await session.run_sync(credit, account_id, delta)


class Stats:
    """Outcome counts of one worker process, written with its RSS and pool figures."""

    def __init__(self, folder: str, worker: str) -> None:
        self.path = Path(folder) / f"{worker}.{os.getpid()}.json"
        self.worker = worker
        self.outcomes: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.engines: list[Engine] = []

    def count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            outcomes = dict(self.outcomes)
        pools = [_pool(engine) for engine in self.engines]
        return {
            "worker": self.worker,
            "pid": os.getpid(),
            "time": time.time(),
            "rss_kb": rss_kb(),
            "pool": {key: sum(p[key] for p in pools) for key in ("size", "checkedout", "idle")},
            "outcomes": outcomes,
        }

    def write(self) -> None:
        scratch = self.path.with_suffix(".tmp")
        scratch.write_text(json.dumps(self.snapshot()))
        scratch.replace(self.path)

    def run_in_thread(self, every: float = 0.5) -> None:
        def loop() -> None:
            while True:
                with contextlib.suppress(OSError):
                    self.write()
                time.sleep(every)

        threading.Thread(target=loop, name="chaos-stats", daemon=True).start()


def _pool(engine: Engine) -> dict[str, int]:
    pool: Any = engine.pool
    return {"size": pool.size(), "checkedout": pool.checkedout(), "idle": pool.checkedin()}


def rss_kb() -> int:
    """Resident set size of this process, in KiB."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024
