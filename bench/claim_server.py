"""The server's CPU a transaction, the claim's parts added one by one.

    python -m bench.claim_server                    # 6,000 transactions a variant, 3 reps
    python -m bench.claim_server --transactions 2000 --reps 1

Eight threads of raw psycopg (simple protocol, no client library in between) run the
benchmark's one-row update in a transaction, then the same with the parts of the inbox's
claim added: a plain prepared INSERT of the claim's row, the library's own prepared claim
(`ClaimStatements`, as the inbox sends it with BEGIN), then its checked COMMIT
(`CHECKED_COMMIT`), and that check as a prepared statement. Each variant's figure is the
CPU the eight server processes (backends) serving its connections spent over its
transactions (read from ``/proc``: the server on this host), divided by their number;
the server's background writers are not in it. The variants alternate within each
repetition, and the median is told. What the client spends is not in it either: this is
the share of the claim a shared database pays.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from collections.abc import Callable

import psycopg
from sqlalchemy.dialects.postgresql import asyncpg

from bench.common import DATABASE, PG, prepare_database, reset_database, server_cpu
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Claim, Delivery
from inbox_middleware._storage import InboxSchema
from inbox_middleware._storage.driver import _quoted
from inbox_middleware._storage.executors import DEFAULT_LOCK_TIMEOUT
from inbox_middleware._storage.statements import CHECKED_COMMIT, ClaimStatements

THREADS = 8
_DIGEST = "5f0c3a3f1e0b6b3c9b0e2f6e7f2d7a0c5f0c3a3f1e0b6b3c9b0e2f6e7f2d7a0c"
_UPDATE = "UPDATE bench_accounts SET balance = balance + 1 WHERE id = {account}"
_INSERT = (
    "PREPARE bench_insert(text) AS INSERT INTO consumer_inbox (consumer_name, producer_name, "
    "tenant, message_id, payload_sha256, hash_scheme, handler_version, received_at) VALUES "
    f"('bench', 'bench', '', $1, '{_DIGEST}', 'json', '', now()) ON CONFLICT DO NOTHING"
)
_CHECK = "PREPARE bench_check AS " + CHECKED_COMMIT.rsplit(";", 1)[0]

Variant = Callable[[str, int], list[str]]


def _claim() -> tuple[str, Callable[[str], str]]:
    """The library's claim: its PREPARE, and its EXECUTE for one message id, the values
    written as the inbox writes them on asyncpg."""
    statements = ClaimStatements(InboxSchema(), "postgresql", DEFAULT_LOCK_TIMEOUT)
    compiled = statements.driver_sql(asyncpg.dialect())[Claim]
    digest = hash_json({"account": 1}, "json.v1")

    def execute(message_id: str) -> str:
        claim = Claim(Delivery("bench", MessageIdentity("bench", message_id), digest))
        _, params = statements.statement(claim)
        quoted = _quoted(compiled.parameters(params))
        assert quoted is not None
        return f"EXECUTE {compiled.prepared.name}({', '.join(quoted)})"

    return compiled.prepared.prepare, execute


def variants() -> tuple[list[str], dict[str, Variant]]:
    """What each connection prepares, and each variant's statements for one message."""
    prepare, claim = _claim()
    return [prepare, _INSERT, _CHECK], {
        "bare": lambda m, a: ["BEGIN; " + _UPDATE.format(account=a), "COMMIT"],
        "+ a prepared INSERT": lambda m, a: [
            f"BEGIN; EXECUTE bench_insert('{m}')",
            _UPDATE.format(account=a),
            "COMMIT",
        ],
        "+ the library's claim": lambda m, a: [
            "BEGIN; " + claim(m),
            _UPDATE.format(account=a),
            "COMMIT",
        ],
        "+ the claim, checked COMMIT": lambda m, a: [
            "BEGIN; " + claim(m),
            _UPDATE.format(account=a),
            CHECKED_COMMIT,
        ],
        "+ the claim, check prepared": lambda m, a: [
            "BEGIN; " + claim(m),
            _UPDATE.format(account=a),
            "EXECUTE bench_check; COMMIT",
        ],
    }


def _server_cpu(pids: list[int]) -> float:
    seconds = server_cpu(pids)
    if seconds is None:
        raise SystemExit("the server's processes are not on this host: /proc does not show them")
    return seconds


def run(variant: Variant, prepares: list[str], transactions: int) -> tuple[float, float]:
    """Transactions a second, and the server's CPU µs a transaction."""
    reset_database()
    conns = [psycopg.connect(f"{PG}/{DATABASE}", autocommit=True) for _ in range(THREADS)]
    for conn in conns:
        for statement in prepares:
            conn.execute(statement)
    tag = uuid.uuid4().hex[:8]
    pids = [conn.info.backend_pid for conn in conns]

    def work(i: int) -> None:
        pgconn = conns[i].pgconn
        for n in range(i, transactions, THREADS):
            for sql in variant(f"{tag}-{n}", n % 100 + 1):
                result = pgconn.exec_(sql.encode())
                if result.status not in (1, 2):  # COMMAND_OK, TUPLES_OK
                    raise RuntimeError((result.error_message or b"").decode())

    try:
        before, start = _server_cpu(pids), time.monotonic()
        threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed, cpu = time.monotonic() - start, _server_cpu(pids) - before
    finally:
        for conn in conns:
            conn.close()
    return transactions / elapsed, cpu / transactions * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.claim_server")
    parser.add_argument("--transactions", type=int, default=6000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    prepare_database()
    prepares, table = variants()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in table}
    for _ in range(args.reps):
        for name, variant in table.items():
            results[name].append(run(variant, prepares, args.transactions))
    print(f"{'variant':32s} {'tx/s':>7s} {'server µs/tx':>13s}  runs")
    for name, runs in results.items():
        rate = statistics.median(r for r, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"{name:32s} {rate:7.0f} {cpu:13.0f}  {' '.join(f'{c:.0f}' for _, c in runs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
