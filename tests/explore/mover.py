"""The explorer's tenant move (``operator move``), as a command of its own, so that it
uses the library under test (``python -m tests.explore --library``), as the workers and
the CLI do::

    python -m tests.explore.mover WORKERS_MAP COMMANDS_MAP TENANT

The many-databases guide's move of ``TENANT`` from ``d1`` to ``d0``, as a script would run
it, at the time (epoch seconds) it then reads on its standard input, its imports and
first connections made before (the explorer starts it before the workers): paused in
both map files (the workers' and the commands', whose URLs it uses), its inbox rows
copied with the library's ``copy_tenant`` and its business rows with them
(`TENANT_ROWS`), in one transaction on each database (the target's committed first),
deleted from ``d1`` with ``delete_tenant``, then pointed at ``d0`` and unpaused. While a
database does not answer, the move again (up to `PATIENCE`); a copy the target already
holds (its commit went through, the source's did not) is deleted from the source alone.
Prints the rows moved by table, as JSON; exit 0 once moved, 1 (the map as it was) if it
could not be.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .tenants import TENANTS, tenant_of

__all__ = ["TENANT_ROWS", "main", "write_map"]

PATIENCE = 90.0
TENANT_ROWS = ("explore_effects", "explore_downstream")
"""The explorer's business rows a moved tenant takes along (by the tenant of their key);
the attempts its handlers count stay in the run's database, whatever the tenant's."""


def write_map(
    path: Path,
    urls: Sequence[str],
    tenants: dict[str, str] | None = None,
    paused: Sequence[str] = (),
) -> str:
    """A map file over ``urls``: databases ``d0``, ``d1``, ...; tenant ``t<i>`` served by
    ``d<i>`` (`brokers.TENANTS`), unless ``tenants`` says otherwise; ``paused``. Written
    aside, then renamed over it, as the many-databases guide asks. Its path."""
    names = [f"d{index}" for index in range(len(urls))]
    data = {
        "databases": dict(zip(names, urls, strict=True)),
        "tenants": tenants or dict(zip(TENANTS, names, strict=True)),
        "paused": list(paused),
    }
    aside = path.with_suffix(".new")
    aside.write_text(json.dumps(data))
    os.replace(aside, path)
    return str(path)


def move_rows(source: Any, target: Any | None, tenant: str) -> dict[str, int]:
    """``tenant``'s rows of `TENANT_ROWS`: copied into ``target`` (unless None) and
    deleted from ``source``, in their transactions; the rows moved by table."""
    from sqlalchemy import text

    moved = {}
    for table in TENANT_ROWS:
        rows = [
            dict(row)
            for row in source.execute(text(f"SELECT * FROM {table}")).mappings()
            if tenant_of(row["key"]) == tenant
        ]
        if rows and target is not None:
            columns = ", ".join(rows[0])
            values = ", ".join(f":{name}" for name in rows[0])
            target.execute(text(f"INSERT INTO {table} ({columns}) VALUES ({values})"), rows)
        keys = sorted({row["key"] for row in rows})
        source.execute(text(f"DELETE FROM {table} WHERE key = ANY(:keys)"), {"keys": keys})
        moved[table] = len(rows)
    return moved


def _move(source: Any, target: Any, tenant: str) -> dict[str, int]:
    from sqlalchemy.exc import DBAPIError, IntegrityError

    from inbox_middleware import copy_tenant, delete_tenant

    began = time.monotonic()
    while True:
        try:
            try:
                with source.begin() as old, target.begin() as new:
                    moved = copy_tenant(old, new, tenant)
                    moved |= move_rows(old, new, tenant)
                    delete_tenant(old, tenant)
                return moved
            except IntegrityError:
                with source.begin() as old:
                    delete_tenant(old, tenant)
                    move_rows(old, None, tenant)
                return {"copied before": 1}
        except DBAPIError as exc:
            if time.monotonic() - began > PATIENCE:
                raise
            print(f"{type(exc.orig).__name__}, again", file=sys.stderr)
            time.sleep(0.5)


def main(argv: list[str]) -> int:
    from sqlalchemy import create_engine
    from sqlalchemy.exc import DBAPIError

    import inbox_middleware  # noqa: F401  (imported before the pause: the copy follows it at once)

    files = [Path(argv[0]), Path(argv[1])]
    tenant = argv[2]
    urls = [list(json.loads(path.read_text())["databases"].values()) for path in files]
    source, target = (
        create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
        for url in (urls[1][1], urls[1][0])
    )

    def remap(**entries: Any) -> None:
        for path, written in zip(files, urls, strict=True):
            write_map(path, written, **entries)

    with contextlib.suppress(DBAPIError), source.connect(), target.connect():
        pass  # the pools' first connections, made before the pause too (if they answer)
    late = time.time() - float(sys.stdin.readline())
    time.sleep(max(0.0, -late))
    remap(paused=[tenant])
    paused = time.monotonic()
    try:
        moved: dict[str, Any] = dict(_move(source, target, tenant))
    except BaseException:
        remap()  # as it was: the tenant in d1
        raise
    finally:
        source.dispose()
        target.dispose()
    remap(tenants=dict.fromkeys(TENANTS, "d0"))
    moved["seconds"] = {
        "late": round(max(0.0, late), 2),
        "moved": round(time.monotonic() - paused, 2),
    }
    print(json.dumps(moved))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
