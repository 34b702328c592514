"""The demo: a Dramatiq worker receives orders with duplicates and conflicts, and each
order credits its account exactly once. Then the same messages go through the same
actor without the inbox, for contrast.

    python demo.py               # run from this folder; scripts/demo does it for you

With PostgreSQL (127.0.0.1:5432) and Redis (127.0.0.1:6379) reachable it runs real
worker processes with the ``dramatiq`` command; otherwise it falls back to SQLite and
Dramatiq's stub broker with an in-process worker, and says so.
"""

from __future__ import annotations

import importlib
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


def configure() -> str:
    """Point the example at real services when they answer, else at embedded ones."""
    if reachable(5432) and reachable(6379):
        import psycopg

        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
            if not c.execute("SELECT 1 FROM pg_database WHERE datname = 'inbox_demo'").fetchone():
                c.execute("CREATE DATABASE inbox_demo")
        os.environ["DATABASE_URL"] = "postgresql+psycopg://postgres@127.0.0.1:5432/inbox_demo"
        os.environ["BROKER_URL"] = "redis://127.0.0.1:6379/0"
        os.environ["REDIS_NAMESPACE"] = f"inbox-demo-{uuid.uuid4().hex[:8]}"
        return "PostgreSQL and Redis on 127.0.0.1, two `dramatiq` worker processes"
    database = Path(tempfile.mkdtemp()) / "demo.db"
    os.environ["DATABASE_URL"] = f"sqlite:///{database}"
    os.environ["BROKER_URL"] = "stub"
    return (
        "PostgreSQL or Redis not reachable: embedded SQLite and Dramatiq's stub broker "
        "with an in-process worker"
    )


def run(module_name: str, real: bool) -> tuple[Any, dict[str, int]]:
    """Send the orders through one worker module; return what was sent and what landed."""
    from accounts import engine_from_env, reset_database
    from producer import send_conflicts, send_orders
    from sqlalchemy import text

    engine = engine_from_env()
    reset_database(engine, ACCOUNTS)
    module = importlib.import_module(module_name)
    worker = _start_worker(module, module_name, real)
    try:
        sent = send_orders(module.add_credit, orders=ORDERS, accounts=ACCOUNTS)
        protected = module_name == "service"
        _wait_for(engine, sent.intents if protected else sent.messages)
        send_conflicts(module.add_credit, sent, orders=ORDERS, accounts=ACCOUNTS)
        _wait_for(engine, sent.intents if protected else sent.messages, quarantined=protected)
    finally:
        _stop(worker)
    with engine.connect() as conn:
        landed = {
            "credits": conn.scalar(text("SELECT count(*) FROM credits")),
            "claims": conn.scalar(text("SELECT count(*) FROM consumer_inbox")),
            "quarantined": conn.scalar(text("SELECT count(*) FROM inbox_quarantine")),
            "wrong_balances": sum(
                balance != sent.expected[account]
                for account, balance in conn.execute(text("SELECT id, balance FROM accounts"))
            ),
        }
    engine.dispose()
    if namespace := os.environ.get("REDIS_NAMESPACE"):
        for key in module.broker.client.scan_iter(f"{namespace}*"):
            module.broker.client.delete(key)
    module.broker.close()
    return sent, landed


def _start_worker(module: Any, module_name: str, real: bool) -> Any:
    if real:
        return subprocess.Popen(
            [sys.executable, "-m", "dramatiq", module_name, "--processes", "2", "--threads", "4"],
            cwd=HERE,
            env=os.environ | {"PYTHONPATH": str(HERE)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    import dramatiq

    module.broker.emit_after("process_boot")
    worker = dramatiq.Worker(module.broker, worker_threads=4)
    worker.start()
    return worker


def _stop(worker: Any) -> None:
    if isinstance(worker, subprocess.Popen):
        worker.terminate()
        worker.wait(timeout=30)
    else:
        worker.stop()


def _wait_for(engine: Any, rows: int, *, quarantined: bool = False, timeout: float = 60) -> None:
    """Until the credits journal (plus the quarantine) holds `rows` rows, for a second."""
    from sqlalchemy import text

    deadline, stable_since, last = time.monotonic() + timeout, 0.0, -1
    query = "SELECT count(*) FROM credits"
    if quarantined:
        query = f"SELECT ({query}) + (SELECT count(*) FROM inbox_quarantine)"
        rows += ORDERS // 10
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            count = conn.scalar(text(query))
        if count != last:
            last, stable_since = count, time.monotonic()
        elif count >= rows and time.monotonic() - stable_since > 1:
            return
        time.sleep(0.2)
    raise SystemExit(f"the worker did not finish in {timeout}s ({last} of {rows} credits)")


def main() -> int:
    # The inbox logs each skipped duplicate and each conflict; the report says it all here.
    logging.basicConfig(level=logging.ERROR)
    sys.path.insert(0, str(HERE))
    mode = configure()
    real = os.environ["BROKER_URL"] != "stub"
    print(f"inbox-middleware demo: {mode}\n")

    sent, landed = run("service", real)
    print(
        f"sent {sent.messages} messages: {sent.intents} orders, {sent.duplicates} of them "
        f"delivered twice, then {sent.conflicts} reusing an order id for another amount\n"
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
        f"  every account balance equals the sum of its orders: "
        f"{'yes' if landed['wrong_balances'] == 0 else 'NO'}"
    )

    _, unprotected = run("unprotected", real)
    print("\nthe same actor and transaction without the inbox:")
    print(
        f"  {unprotected['credits']} credits applied for {sent.intents} orders; "
        f"{unprotected['wrong_balances']} of {ACCOUNTS} balances are wrong"
    )

    print("\nresult: " + ("each effect happened exactly once with the inbox" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
