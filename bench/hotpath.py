"""The inbox's own CPU per message, in one thread, with no broker in the way.

    python -m bench.hotpath                 # 3,000 messages a mode, 5 alternating reps
    python -m bench.hotpath --profile       # and the functions that cost most (cProfile)
    python -m bench.hotpath --breakdown     # the CPU the inbox adds, part by part
    python -m bench.hotpath --driver asyncpg   # AsyncInbox on asyncpg (FastStream's path)
    python -m bench.hotpath --claims compact   # the compact claim (the switch recorded)
    python -m bench.hotpath --floor         # and the least a claim can add (below)
    python -m bench.hotpath --latency       # and each message's wall time and server CPU
    python -m bench.hotpath --unmetered     # and the inbox with its metrics off (below)

A Dramatiq `StubBroker` with the default middleware, the inbox's middleware and the
benchmark's actor (one account update on the benchmark database): each message goes
through what a worker thread does with it (``before_process_message``, the actor call,
``after_process_message``), in a loop, and the process's CPU time is divided by the
message count. Bare (the update in a transaction of its own) and inbox alternate within
each repetition. With no broker, no other threads and no GIL hand-offs, the figure moves
by a few µs between runs: the measure to judge a change of the hot path by. The worker
benchmark (``python -m bench``) says what the change is worth end to end.

With ``--driver asyncpg``, the same loop for the asynchronous path FastStream's adapter
takes: `AsyncInbox.process` with a handler running the update on its `AsyncSession`, one
message after another on one event loop, against the update in an `AsyncSession`
transaction of its own (FastStream's own part is not in it: ``python -m bench.profile
faststream`` shows that one).

With ``--floor``, a third mode runs beside the two, on either driver: the least the
guarantee itself costs on this path, its statements alone (`bench.floor`): the identity
and the payload's hash as the inbox reads them, the claim sent with the transaction's
BEGIN in one round trip (as the statement prepared on the server, as the inbox sends it),
the update in the same session when the claim is first seen, the checked COMMIT; no
core, no settlement, no metrics, no logs, no traces, no guard on the handler's
transaction. Its CPU above bare is what a leaner inbox could come down to with the same
statements, the same round trips and the same session; the inbox's above it is what its
layers cost.

With ``--unmetered`` (psycopg), one more mode runs beside the others: the inbox with its
metrics off (what ``INBOX_PROMETHEUS_METRICS=0`` does to a worker), so that what the
metrics cost a message is measured in the same repetitions as the rest, not told by the
profile, which inflates parts made of many small calls.

With ``--latency``, each mode's wall time a message is told too (what a consumer that
handles one message after another waits, round trips included), and the CPU the
PostgreSQL server spent on it: the backends serving the mode's engine (found by their
``application_name``), read from ``/proc`` when the server runs on this host.

With ``--breakdown``, one more inbox repetition runs under cProfile (on CPU time) and the
message's CPU is told part by part (`PARTS`): each part's time as cProfile measured it
(inclusive of what it calls), scaled so that the whole matches the repetitions run without
the profiler. cProfile's own cost lands on each part in proportion to its function calls,
so a part of many small calls looks somewhat larger than it is.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import dramatiq
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import CurrentMessage
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from bench.common import (
    admin,
    backends,
    prepare_database,
    reset_database,
    server_cpu,
    sqlalchemy_url,
)
from bench.floor import Floor
from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._observe.instruments import metrics
from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
from inbox_middleware.dramatiq._payload import ActorPayload

UPDATE = text("UPDATE bench_accounts SET balance = balance + 1 WHERE id = :account")
CLAIMS = "library"
"""The inbox's claims table (``--claims``); with "compact", the switch is recorded."""
MODES = ("bare", "inbox")
"""The modes `measure` runs by default (``--floor`` adds "floor", ``--unmetered``
"unmetered")."""
INBOX_MODES = ("inbox", "unmetered")
"""The modes that run the inbox's middleware; "unmetered" with its metrics off."""


def _reset() -> None:
    reset_database()
    if CLAIMS == "compact":
        with admin() as conn:
            conn.execute(
                "INSERT INTO inbox_layout (name, value, changed_at, changed_by)"
                " VALUES ('claims', 'compact', now(), 'bench')"
            )


def _broker(mode: str, engine: Any) -> tuple[dramatiq.Broker, dramatiq.Actor[Any, Any]]:
    broker = StubBroker()
    options: dict[str, Any] = {"queue_name": f"hotpath-{mode}", "broker": broker}
    if mode in INBOX_MODES:
        broker.add_middleware(InboxMiddleware(engine, check_database=False, claims=CLAIMS))
        options["inbox_consumer"] = "hotpath"

        def credit(account: int) -> None:
            current_session().execute(UPDATE, {"account": account})

    elif mode == "floor":
        credit = _floor(engine, f"credit_{mode}")
    else:

        def credit(account: int) -> None:
            with Session(engine) as session, session.begin():
                session.execute(UPDATE, {"account": account})

    actor = dramatiq.actor(credit, actor_name=f"credit_{mode}", **options)
    if mode == "floor":  # hands the floor's actor its message, as the inbox's middleware does
        broker.add_middleware(CurrentMessage())
    return broker, actor


def _floor(engine: Any, actor_name: str) -> Callable[[int], None]:
    """The floor's actor on psycopg (``--floor``, `bench.floor`): the delivery read from
    the message as the inbox's Dramatiq adapter reads it."""
    floor = Floor(engine.dialect)

    def credit(account: int) -> None:
        message = CurrentMessage.get_current_message()
        assert message is not None
        # the identity and the hash as the inbox's Dramatiq adapter reads and computes them
        delivery = Delivery(
            "hotpath",
            payload.message_identity(message),
            payload.hash(payload.arguments(message)),
        )
        with Session(engine) as session:
            floor.run(session, delivery, lambda s: s.execute(UPDATE, {"account": account}))

    payload = ActorPayload(actor_name, credit, None)
    return credit


def _messages(actor: dramatiq.Actor[Any, Any], count: int) -> list[MessageProxy]:
    run = uuid.uuid4().hex[:8]
    return [
        MessageProxy(
            actor.message_with_options(
                args=(n % 100 + 1,), **identity(producer="hotpath", message_id=f"{run}-{n}")
            )
        )
        for n in range(count)
    ]


def _consume(broker: dramatiq.Broker, actor: dramatiq.Actor[Any, Any]) -> Callable[[Any], None]:
    def consume(message: MessageProxy) -> None:
        # What dramatiq's WorkerThread.process_message does for a message that succeeds.
        broker.emit_before("process_message", message)
        result = actor(*message.args, **message.kwargs)
        broker.emit_after("process_message", message, result=result)

    return consume


# Where the inbox's message goes, by the functions that do each part: (label, file ending,
# function name, the caller it is counted under or None for every call). Indented labels
# are part of the one above; "rest" is whatever the listed parts leave.
Part = tuple[str, str, str, "str | None"]
PARTS: dict[str, list[Part]] = {
    "psycopg": [
        (
            "arrival (adapter: identity, hash)",
            "dramatiq/_middleware.py",
            "before_process_message",
            None,
        ),
        ("  payload hash (RFC 8785, SHA-256)", "dramatiq/_payload.py", "hash", None),
        ("session opened", "sqlalchemy/orm/session.py", "__call__", "_run"),
        ("claim (BEGIN + INSERT, verdict)", "_storage/base.py", "_claim", None),
        ("  session's connection", "sqlalchemy/orm/session.py", "connection", "_claim"),
        ("  driver call (literals, libpq)", "_storage/driver.py", "claim_with_begin", None),
        ("  claim histogram", "_storage/base.py", "claim_took", None),
        ("handler (the bare UPDATE)", "bench/hotpath.py", "credit", None),
        ("commit checks (transaction state)", "_storage/base.py", "_before_commit", None),
        ("COMMIT with its check", "_storage/base.py", "_commit", None),
        ("  driver call", "_storage/driver.py", "commit_checked", None),
        ("  SQLAlchemy's commit", "sqlalchemy/orm/session.py", "commit", "_commit"),
        ("commit histogram, decision counter", "_storage/base.py", "committed", None),
        ("session closed", "sqlalchemy/orm/session.py", "close", "_run"),
        ("settlement (core, adapter's settle)", "dramatiq/_middleware.py", "settle", None),
        ("after hook (dramatiq's middleware)", "dramatiq/broker.py", "emit_after", None),
    ],
    # On asyncpg the claim, the commit and the handler run in greenlets, whose switches
    # cProfile nests wrongly: only the own-time table below is told.
    "asyncpg": [],
}


def breakdown(profiler: cProfile.Profile, parts: list[Part], count: int, measured: float) -> None:
    """Print ``parts`` of the profiled inbox messages in µs a message, scaled to
    ``measured`` µs (the median inbox CPU without the profiler)."""
    stats: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    profiled = sum(entry[2] for entry in stats.values())  # every function's own time

    def seconds(path: str, name: str, caller: str | None) -> float:
        total = 0.0
        for (filename, _, function), (_, _, _, cumulative, callers) in stats.items():
            if function != name or not filename.endswith(path):
                continue
            if caller is None:
                total += cumulative
            else:
                total += sum(c[3] for (_, _, f), c in callers.items() if f == caller)
        return total

    scale = measured / (profiled / count * 1e6)
    print(
        f"\nwhere an inbox message's {measured:.0f} µs of CPU go (cProfile, scaled by {scale:.2f})"
    )
    listed = 0.0
    for label, path, name, caller in parts:
        value = seconds(path, name, caller) / count * 1e6 * scale
        if not label.startswith(" "):
            listed += value
        print(f"  {label:38s} {value:6.1f} µs")
    if parts:
        print(f"  {'rest (core steps, wrappers, dramatiq)':38s} {measured - listed:6.1f} µs")
    # Own time by package: robust where inclusive times are not (a greenlet switch inside
    # a call, on asyncpg, confuses cProfile's nesting but not whose code ran).
    packages: dict[str, float] = {}
    for (filename, _, function), (_, _, own, _, _) in stats.items():
        name = _package(filename, function)
        packages[name] = packages.get(name, 0.0) + own
    print(f"\nthe same {measured:.0f} µs by whose code ran (own time)")
    for name, own in sorted(packages.items(), key=lambda item: -item[1])[:14]:
        print(f"  {name:38s} {own / count * 1e6 * scale:6.1f} µs")


_C_CODE = (
    ("psycopg", "psycopg's C (libpq, its system calls)"),
    ("asyncpg", "asyncpg's C"),
    ("greenlet", "greenlet (switches)"),
    ("socket", "sockets (system calls)"),
    ("select", "event loop's poll (system calls)"),
    ("_hashlib", "hashlib (SHA-256)"),
    ("json", "json's C encoder"),
)


def _package(filename: str, function: str) -> str:
    """The package (the inbox's: its subpackage) of a profiled function's file."""
    if filename == "~":  # a built-in: by whose C code it is
        for marker, name in _C_CODE:
            if marker in function:
                return name
        return "Python's built-ins"
    path = filename.replace("\\", "/")
    if "/inbox_middleware/" in path:
        return "inbox_middleware." + path.rsplit("/inbox_middleware/", 1)[1].split("/")[
            0
        ].removesuffix(".py")
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/")[0].removesuffix(".py")
    if "/bench/" in path:
        return "the benchmark's handler"
    return "standard library (" + path.rsplit("/", 1)[-1].removesuffix(".py") + ")"


def measure(
    count: int,
    reps: int,
    profile: bool,
    parts: bool = False,
    modes: tuple[str, ...] = MODES,
    latency: bool = False,
) -> None:
    prepare_database()
    _reset()
    engines = _engines(modes)
    setups = _setups(engines)
    clocks = Clocks(setups)
    # CPU time, not wall time: a wait on the database costs nothing here
    profiler = cProfile.Profile(time.process_time) if profile else None
    metered = metrics.enabled  # as the environment set it (INBOX_PROMETHEUS_METRICS)
    for _ in range(reps):
        for mode, (broker, actor) in setups.items():
            messages = _messages(actor, count)
            consume = _consume(broker, actor)
            if profiler is not None and mode == "inbox":
                profiler.enable()
            metrics.enabled = metered and mode != "unmetered"
            clocks.start(mode)
            for message in messages:
                consume(message)
            clocks.stop(count)
            metrics.enabled = metered
            if profiler is not None:
                profiler.disable()
    cpu = clocks.cpu
    if parts:
        profiles, calls = _profiled(setups, count)
        alone = _arrival_alone(*setups["inbox"], count)
    for engine in engines.values():
        engine.dispose()
    _report(cpu)
    if latency:
        _report_latency(clocks)
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(30)
    if parts:
        breakdown(profiles["inbox"], PARTS["psycopg"], count, statistics.median(cpu["inbox"]))
        print(
            f"\nPython and built-in calls a message: inbox {calls['inbox']:.0f}, "
            f"bare {calls['bare']:.0f}; the arrival alone, in a loop of its own (no round "
            f"trips between): {alone:.1f} µs a message"
        )


Setups = dict[str, tuple[dramatiq.Broker, dramatiq.Actor[Any, Any]]]


def _engines(modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    """An engine a mode: bare runs on one the inbox does not guard, as it would without it."""
    return {
        mode: create_engine(
            sqlalchemy_url(), pool_size=2, connect_args={"application_name": _application(mode)}
        )
        for mode in modes
    }


def _application(mode: str) -> str:
    return f"hotpath-{mode}"


class Clocks:
    """A mode's clocks over its runs, a message: the process's CPU, the wall clock and the
    CPU of the PostgreSQL backends serving the mode (None where ``/proc`` does not show
    them: a server on another host)."""

    def __init__(self, modes: Any) -> None:
        self.cpu: dict[str, list[float]] = {mode: [] for mode in modes}
        self.wall: dict[str, list[float]] = {mode: [] for mode in modes}
        self.server: dict[str, list[float]] = {mode: [] for mode in modes}

    def start(self, mode: str) -> None:
        self._mode = mode
        self._backends = backends(_application(mode))
        self._server = server_cpu(self._backends)
        self._wall = time.perf_counter()
        self._cpu = time.process_time()

    def stop(self, count: int) -> None:
        cpu = time.process_time() - self._cpu
        wall = time.perf_counter() - self._wall
        self.cpu[self._mode].append(cpu / count * 1e6)
        self.wall[self._mode].append(wall / count * 1e6)
        server = server_cpu(self._backends)
        if server is not None and self._server is not None:
            self.server[self._mode].append((server - self._server) / count * 1e6)


def _setups(engines: dict[str, Any]) -> Setups:
    """Each mode's broker and actor, warmed: the pool, the statement caches, the imports."""
    setups = {mode: _broker(mode, engine) for mode, engine in engines.items()}
    for broker, actor in setups.values():
        consume = _consume(broker, actor)
        for message in _messages(actor, 200):
            consume(message)
    return setups


def _profiled(setups: Setups, count: int) -> tuple[dict[str, cProfile.Profile], dict[str, float]]:
    """Each mode's profile over ``count`` messages, and its Python and built-in calls a
    message."""
    profiles, calls = {}, {}
    for mode, (broker, actor) in setups.items():
        messages = _messages(actor, count)
        consume = _consume(broker, actor)
        profiles[mode] = cProfile.Profile(time.process_time)
        profiles[mode].enable()
        for message in messages:
            consume(message)
        profiles[mode].disable()
        calls[mode] = _calls(profiles[mode], count)
    return profiles, calls


def _calls(profile: cProfile.Profile, count: int) -> float:
    """The Python and built-in calls ``profile`` counted, a message of ``count``."""
    stats: dict[Any, Any] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return float(sum(entry[1] for entry in stats.values())) / count


def calls_per_message(count: int = 1000) -> dict[str, float]:
    """Each mode's Python and built-in calls a message: what a message runs, counted, so
    the same on any machine and in any run (CPU time moves with the machine's load)."""
    prepare_database()
    _reset()
    engines = _engines()
    try:
        return _profiled(_setups(engines), count)[1]
    finally:
        for engine in engines.values():
            engine.dispose()


def _arrival_alone(broker: dramatiq.Broker, actor: dramatiq.Actor[Any, Any], count: int) -> float:
    """The inbox middleware's before-hook (the arrival: identity, arguments, payload hash,
    delivery) run over ``count`` messages in a loop of its own: its CPU a message with warm
    caches, to set beside its part of the profile, where round trips come between."""
    hook = next(m for m in broker.middleware if isinstance(m, InboxMiddleware))
    messages = _messages(actor, count)
    start = time.process_time()
    for message in messages:
        hook.before_process_message(broker, message)
    return (time.process_time() - start) / count * 1e6


def measure_async(
    count: int,
    reps: int,
    profile: bool,
    parts: bool = False,
    latency: bool = False,
    modes: tuple[str, ...] = MODES,
) -> None:
    prepare_database()
    _reset()
    profiled = {mode: cProfile.Profile(time.process_time) for mode in ("bare", "inbox")}
    clocks = asyncio.run(_measure_async(count, reps, profile, profiled if parts else None, modes))
    cpu = clocks.cpu
    _report(cpu)
    if latency:
        _report_latency(clocks)
    if parts:
        breakdown(profiled["inbox"], PARTS["asyncpg"], count, statistics.median(cpu["inbox"]))
        calls = {mode: _calls(profiling, count) for mode, profiling in profiled.items()}
        print(
            f"\nPython and built-in calls a message: inbox {calls['inbox']:.0f}, "
            f"bare {calls['bare']:.0f}"
        )


async def _measure_async(
    count: int,
    reps: int,
    profile: bool,
    profiled: dict[str, cProfile.Profile] | None = None,
    names: tuple[str, ...] = MODES,
) -> Clocks:
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from inbox_middleware._storage import AsyncInbox

    # An engine a mode: bare runs on one the inbox does not guard.
    engines = [
        create_async_engine(
            sqlalchemy_url("asyncpg"),
            pool_size=2,
            connect_args={"server_settings": {"application_name": _application(mode)}},
        )
        for mode in names
    ]
    engine = dict(zip(names, engines, strict=True))
    inbox = AsyncInbox(engine["inbox"], claims=CLAIMS)
    sessions = async_sessionmaker(engine["bare"], expire_on_commit=False)
    if "floor" in engine:
        floor_sessions = async_sessionmaker(engine["floor"], expire_on_commit=False)
        floor = Floor(engine["floor"].dialect)
    run = uuid.uuid4().hex[:8]

    async def bare(n: int) -> None:
        async with sessions() as session, session.begin():
            await session.execute(UPDATE, {"account": n % 100 + 1})

    async def inboxed(n: int) -> None:
        async def handler(session: Any) -> None:
            await session.execute(UPDATE, {"account": n % 100 + 1})

        payload = {"account": n % 100 + 1}
        delivery = Delivery(
            "hotpath", MessageIdentity("hotpath", f"{run}-{n}"), hash_json(payload, "json.v1")
        )
        await inbox.process(delivery, handler)

    async def floored(n: int) -> None:
        # the delivery as the inbox's mode builds it, for a consumer of its own (the same
        # ids as the inbox's mode: each claim first seen); the statements alone, the
        # update awaited as the inbox's handler awaits it
        payload = {"account": n % 100 + 1}
        delivery = Delivery(
            "hotpath-floor",
            MessageIdentity("hotpath", f"{run}-{n}"),
            hash_json(payload, "json.v1"),
        )

        async def update(session: Any) -> None:
            await session.execute(UPDATE, payload)

        async with floor_sessions() as session:
            await floor.run_async(session, delivery, update)

    every = {"bare": bare, "inbox": inboxed, "floor": floored}
    modes = {name: every[name] for name in names}
    for consume in modes.values():  # warm: pool, statement caches, imports
        for n in range(-200, 0):
            await consume(n)
    clocks = Clocks(modes)
    profiler = cProfile.Profile(time.process_time) if profile else None
    for rep in range(reps):
        for mode, consume in modes.items():
            first = rep * count
            if profiler is not None and mode == "inbox":
                profiler.enable()
            clocks.start(mode)
            for n in range(first, first + count):
                await consume(n)
            clocks.stop(count)
            if profiler is not None:
                profiler.disable()
    for mode, profiling in (profiled or {}).items():
        profiling.enable()
        for n in range(reps * count, (reps + 1) * count):
            await modes[mode](n)
        profiling.disable()
    for engine in engines:
        await engine.dispose()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return clocks


def _report(cpu: dict[str, list[float]]) -> None:
    for mode, values in cpu.items():
        print(f"{mode:6} {statistics.median(values):7.1f} µs CPU/msg  runs {_runs(values)}")
    for mode, label in (("inbox", "added"), ("floor", "floor+"), ("unmetered", "unmetered+")):
        if mode in cpu:  # above bare, in the same repetitions
            added = [m - b for m, b in zip(cpu[mode], cpu["bare"], strict=True)]
            print(f"{label:6} {statistics.median(added):7.1f} µs CPU/msg  runs {_runs(added)}")


def _report_latency(clocks: Clocks) -> None:
    """Each mode's wall time and server CPU a message, and the inbox's above bare's."""
    for name, measured in (("wall", clocks.wall), ("server", clocks.server)):
        if not all(measured.values()):
            print(f"{name:6} not measured (the server's processes are not on this host)")
            continue
        for mode, values in measured.items():
            print(f"{mode:6} {statistics.median(values):7.1f} µs {name}/msg  runs {_runs(values)}")
        added = [i - b for i, b in zip(measured["inbox"], measured["bare"], strict=True)]
        print(f"{'added':6} {statistics.median(added):7.1f} µs {name}/msg  runs {_runs(added)}")


def _runs(values: list[float]) -> str:
    return " ".join(f"{v:.0f}" for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hotpath")
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--breakdown", action="store_true", help="the inbox's CPU a message, part by part"
    )
    parser.add_argument("--driver", choices=("psycopg", "asyncpg"), default="psycopg")
    parser.add_argument("--claims", choices=("library", "compact"), default="library")
    parser.add_argument(
        "--latency", action="store_true", help="each message's wall time and server CPU too"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="a third mode: the claim, the update and the checked COMMIT alone (bench.floor)",
    )
    parser.add_argument(
        "--unmetered",
        action="store_true",
        help="one more mode: the inbox with its metrics off (psycopg)",
    )
    args = parser.parse_args(argv)
    if args.unmetered and args.driver != "psycopg":
        parser.error("--unmetered runs on psycopg only")
    modes = (*MODES, "floor") if args.floor else MODES
    if args.unmetered:
        modes = (*modes, "unmetered")
    global CLAIMS  # noqa: PLW0603 (the setting every inbox of the run is made with)
    CLAIMS = args.claims
    if args.driver == "asyncpg":
        measure_async(args.messages, args.reps, args.profile, args.breakdown, args.latency, modes)
    else:
        measure(args.messages, args.reps, args.profile, args.breakdown, modes, args.latency)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
