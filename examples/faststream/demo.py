"""The demo: a FastStream worker on RabbitMQ receives orders with duplicates and
conflicts, and each order credits its account exactly once. Then the same messages go
through the same handler without the inbox, for contrast.

    python demo.py               # run from this folder; scripts/demo faststream does it

It needs PostgreSQL (127.0.0.1:5432) and RabbitMQ (127.0.0.1:5672), and runs the worker as
a real process with the ``faststream run`` command.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ORDERS, ACCOUNTS = 60, 5


def reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


async def create_database() -> None:
    import asyncpg

    admin = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        name = "inbox_demo_faststream"
        if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()


async def run(module: str) -> tuple[Any, dict[str, int]]:
    """Send the orders through one app module; return what was sent and what landed."""
    from accounts import BROKER_URL, QUEUE, engine_from_env, reset_database
    from faststream.rabbit import RabbitBroker
    from producer import send_conflicts, send_orders

    engine = engine_from_env()
    await reset_database(engine, ACCOUNTS)
    worker, log = start_worker(module)
    try:
        await wait_until(lambda: "started successfully" in log.read_text(), "the worker")
        broker = RabbitBroker(BROKER_URL)
        async with broker:
            sent = await send_orders(broker, QUEUE, orders=ORDERS, accounts=ACCOUNTS)
            protected = module == "service"
            await settle(engine, sent.intents if protected else sent.messages)
            await send_conflicts(broker, QUEUE, sent, orders=ORDERS, accounts=ACCOUNTS)
            await settle(engine, sent.intents if protected else sent.messages, protected)
            for name in (QUEUE, f"{QUEUE}.quarantine", f"{QUEUE}.dead-letter"):
                channel = await broker._connection.channel()
                await channel.queue_delete(name)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    landed = await count(engine, sent)
    await engine.dispose()
    return sent, landed


def start_worker(module: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = Path(tempfile.mkdtemp()) / f"{module}.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "faststream", "run", f"{module}:app"],
            cwd=HERE,
            env=os.environ | {"PYTHONPATH": str(HERE)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return worker, log


async def wait_until(check: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def settle(engine: Any, rows: int, quarantined: bool = False, timeout: float = 60) -> None:
    """Until the credits journal (plus the quarantine) holds `rows` rows, for a second."""
    from sqlalchemy import text

    query = "SELECT count(*) FROM credits"
    if quarantined:
        query = f"SELECT ({query}) + (SELECT count(*) FROM inbox_quarantine)"
        rows += ORDERS // 10
    deadline, stable_since, last = time.monotonic() + timeout, 0.0, -1
    while time.monotonic() < deadline:
        async with engine.connect() as conn:
            found = await conn.scalar(text(query))
        if found != last:
            last, stable_since = found, time.monotonic()
        elif found >= rows and time.monotonic() - stable_since > 1:
            return
        await asyncio.sleep(0.2)
    raise SystemExit(f"the worker did not finish in {timeout}s ({last} of {rows} rows)")


async def count(engine: Any, sent: Any) -> dict[str, int]:
    from sqlalchemy import text

    async with engine.connect() as conn:
        balances = (await conn.execute(text("SELECT id, balance FROM accounts"))).all()
        return {
            "credits": await conn.scalar(text("SELECT count(*) FROM credits")),
            "claims": await conn.scalar(text("SELECT count(*) FROM consumer_inbox")),
            "quarantined": await conn.scalar(text("SELECT count(*) FROM inbox_quarantine")),
            "wrong_balances": sum(b != sent.expected[a] for a, b in balances),
        }


def main() -> int:
    # The inbox logs each skipped duplicate and each conflict; the report says it all here.
    logging.basicConfig(level=logging.ERROR)
    sys.path.insert(0, str(HERE))
    if not (reachable(5432) and reachable(5672)):
        print(
            "the FastStream demo needs PostgreSQL on 127.0.0.1:5432 and RabbitMQ on "
            "127.0.0.1:5672; start them with scripts/services"
        )
        return 1
    os.environ["ACCOUNTS_QUEUE"] = f"accounts-demo-{uuid.uuid4().hex[:8]}"
    os.environ.setdefault(
        "DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/inbox_demo_faststream"
    )
    asyncio.run(create_database())
    print(
        "inbox-middleware demo: PostgreSQL and RabbitMQ on 127.0.0.1, a `faststream run` worker\n"
    )

    sent, landed = asyncio.run(run("service"))
    print(
        f"sent {sent.messages} messages: {sent.intents} orders, {sent.duplicates} of them "
        f"published twice, then {sent.conflicts} reusing an order id for another amount\n"
    )
    ok = (
        landed["credits"] == sent.intents
        and landed["claims"] == sent.intents
        and landed["quarantined"] == sent.conflicts
        and landed["wrong_balances"] == 0
    )
    print("with the inbox:")
    print(
        f"  {landed['credits']} credits applied, one per order "
        f"({sent.duplicates} duplicates skipped)"
    )
    print(f"  {landed['quarantined']} conflicting messages quarantined, not applied")
    print(
        "  every account balance equals the sum of its orders: "
        + ("yes" if landed["wrong_balances"] == 0 else "NO")
    )

    _, unprotected = asyncio.run(run("unprotected"))
    print("\nthe same handler and transaction without the inbox:")
    print(
        f"  {unprotected['credits']} credits applied for {sent.intents} orders; "
        f"{unprotected['wrong_balances']} of {ACCOUNTS} balances are wrong"
    )
    print("\nresult: " + ("each effect happened exactly once with the inbox" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
