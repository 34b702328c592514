"""Deliver one message by one way of deduplicating (bench.peers) and die by SIGKILL where
its effect and its "done" mark are apart.

    python -m tests.support.peer_crash WAY MESSAGE_ID DATABASE_URL REDIS_URL EXPIRES

DATABASE_URL is a SQLAlchemy psycopg URL; EXPIRES is the way's expiry or lease in seconds
(Powertools' ``expires_after_seconds``, justonce's ``ttl_seconds``).
"""

from __future__ import annotations

import os
import signal
import sys

from bench import peers
from sqlalchemy import create_engine


def main(way_name: str, message_id: str, url: str, redis_url: str, expires: str) -> None:
    engine = create_engine(url)
    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    settings = {"powertools": {"expires": int(expires)}, "justonce": {"ttl": float(expires)}}
    way = peers.make(way_name, engine, redis_url=redis_url, dsn=dsn, **settings.get(way_name, {}))
    way.deliver(message_id, 1, between=lambda: os.kill(os.getpid(), signal.SIGKILL))
    raise SystemExit("the process was meant to die before this line")


if __name__ == "__main__":
    main(*sys.argv[1:])
