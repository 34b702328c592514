"""The database's limit: the claim-and-update transaction driven directly with asyncpg.

No framework, no SQLAlchemy: `connections` tasks each run BEGIN; INSERT claim; UPDATE
account; COMMIT in a loop. One commit per message is what bounds every adapter above.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg

from bench.common import DATABASE, PG, reset_database

CLAIM = (
    "INSERT INTO consumer_inbox (consumer_name, producer_name, tenant, message_id, "
    "payload_sha256, hash_scheme, handler_version, received_at) "
    "VALUES ('ceiling', 'bench', '', $1, $2, 'bench', '', now()) "
    "ON CONFLICT DO NOTHING RETURNING 1"
)
UPDATE = "UPDATE bench_accounts SET balance = balance + 1 WHERE id = $1"


async def _run(connections: int, seconds: float) -> float:
    pool = await asyncpg.create_pool(f"{PG}/{DATABASE}", min_size=connections, max_size=connections)
    run = uuid.uuid4().hex
    done = 0
    stop = time.monotonic() + seconds

    async def loop(worker: int) -> None:
        nonlocal done
        n = 0
        async with pool.acquire() as conn:
            while time.monotonic() < stop:
                async with conn.transaction():
                    await conn.fetchval(CLAIM, f"{run}-{worker}-{n}", "0" * 64)
                    await conn.execute(UPDATE, n % 100 + 1)
                n += 1
                done += 1

    started = time.monotonic()
    await asyncio.gather(*(loop(i) for i in range(connections)))
    elapsed = time.monotonic() - started
    await pool.close()
    return done / elapsed


def throughput(connections: int, seconds: float = 4.0) -> float:
    reset_database()
    return asyncio.run(_run(connections, seconds))
