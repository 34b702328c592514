"""The walk of one message through the library: which files it enters, in order.

    python -m bench.walk            # FastStream, on RabbitMQ and PostgreSQL of scripts/services
    python -m bench.walk --dramatiq # Dramatiq, from the actor call (`InboxActor.call`)

One first-seen message is published to a real RabbitMQ queue and consumed by an inbox
subscriber on a throwaway PostgreSQL database; every call of a function of
``src/inbox_middleware`` made while its `Subscription.consume` runs is recorded, with the
file it is called from (a coroutine resumed after an ``await`` is not a call). Printed:
the files entered, the calls from one file into another, the calls from
``faststream/_processing.py`` into another file (each comes back to it), and the calls up
the floors (a module calling one on a higher floor of the ``floors`` contract in
pyproject.toml: a call back).
"""

from __future__ import annotations

import asyncio
import dis
import functools
import os
import sys
import time
import uuid
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import CodeType
from typing import Any

from faststream.rabbit import RabbitBroker, RabbitQueue

from inbox_middleware._operate.throwaway import (
    DEFAULT_SERVER,
    SERVER_VARIABLE,
    Template,
    migrate_inbox,
)
from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers
from inbox_middleware.faststream._processing import Subscription

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "inbox_middleware"
BROKER_URL = os.environ.get("INBOX_BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")


@functools.cache
def _house() -> Any:
    return SourceFileLoader("house", str(ROOT / "scripts" / "house")).load_module()


@functools.cache
def floor(path: str) -> int:
    """The module's floor in the ``floors`` contract (0 the bottom), -1 when on none."""
    house = _house()
    module = "inbox_middleware." + ".".join(Path(path).with_suffix("").parts)
    module = module.removesuffix(".__init__")
    found = house.floor_of(module, house.floors_contract())
    return -1 if found is None else found[0]


@functools.cache
def _start(code: CodeType) -> int:
    """The offset of a function's first instruction: a frame there is a new call."""
    return next(i.offset for i in dis.get_instructions(code) if i.opname == "RESUME")


def _file(frame: Any) -> str | None:
    name = frame.f_code.co_filename if frame is not None else ""
    return str(Path(name).relative_to(PACKAGE)) if name.startswith(str(PACKAGE)) else None


async def walk() -> list[tuple[str | None, str]]:
    """(calling file, called file) for each call into the library during one consume."""
    template = Template(os.environ.get(SERVER_VARIABLE, DEFAULT_SERVER), migrate_inbox)
    database = template.clone()
    calls: list[tuple[str | None, str]] = []
    try:
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(database.async_url)
        inbox = FastStreamInbox(engine)
        broker = RabbitBroker(BROKER_URL, middlewares=[inbox.middleware], logger=None)
        queue = RabbitQueue(f"walk-{uuid.uuid4().hex[:8]}", auto_delete=True)
        done = asyncio.Event()

        @broker.subscriber(queue, dependencies=[inbox.consumer("walk")])
        async def handle(body: dict[str, Any], session: InboxSession) -> None:
            done.set()

        consume = Subscription.consume

        async def traced(self: Subscription, call_next: Any, message: Any, *rest: Any) -> Any:
            def profile(frame: Any, event: str, arg: Any) -> None:
                if event != "call" or frame.f_lasti > _start(frame.f_code):
                    return
                called = _file(frame)
                if called is not None:
                    calls.append((_file(frame.f_back), called))

            sys.setprofile(profile)
            try:
                return await consume(self, call_next, message, *rest)
            finally:
                sys.setprofile(None)

        Subscription.consume = traced  # type: ignore[method-assign]
        try:
            async with broker:
                await inbox.guard(broker).start()
                headers = identity_headers(producer="walk", message_id=uuid.uuid4().hex)
                await broker.publish({"n": 1}, queue, headers=headers)
                await asyncio.wait_for(done.wait(), 30)
                await asyncio.sleep(0.5)  # the ack after the commit
        finally:
            Subscription.consume = consume  # type: ignore[method-assign]
            await engine.dispose()
    finally:
        template.drop(database)
        template.close()
    return calls


def _profiler(calls: list[tuple[str | None, str]]) -> Any:
    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_lasti > _start(frame.f_code):
            return
        called = _file(frame)
        if called is not None:
            calls.append((_file(frame.f_back), called))

    return profile


def walk_dramatiq() -> list[tuple[str | None, str]]:
    """(calling file, called file) for each call into the library during one actor call."""
    import threading

    import dramatiq
    from dramatiq.brokers.rabbitmq import RabbitmqBroker
    from sqlalchemy import create_engine

    from inbox_middleware.dramatiq import InboxMiddleware, current_session, identity
    from inbox_middleware.dramatiq._actor import InboxActor

    template = Template(os.environ.get(SERVER_VARIABLE, DEFAULT_SERVER), migrate_inbox)
    database = template.clone()
    calls: list[tuple[str | None, str]] = []
    queue = f"walk-{uuid.uuid4().hex[:8]}"
    try:
        engine = create_engine(database.url)
        broker = RabbitmqBroker(url=BROKER_URL, confirm_delivery=True)
        broker.add_middleware(InboxMiddleware(engine))
        done = threading.Event()

        @dramatiq.actor(queue_name=queue, inbox_consumer="walk", broker=broker)
        def handle(n: int) -> None:
            current_session()
            done.set()

        call = InboxActor.call

        def traced(self: InboxActor, *args: Any) -> Any:
            sys.setprofile(_profiler(calls))
            try:
                return call(self, *args)
            finally:
                sys.setprofile(None)

        InboxActor.call = traced  # type: ignore[method-assign]
        worker = dramatiq.Worker(broker, worker_threads=1)
        worker.start()
        try:
            handle.send_with_options(
                args=(1,), **identity(producer="walk", message_id=uuid.uuid4().hex)
            )
            if not done.wait(30):
                raise TimeoutError("the actor did not run")
            time.sleep(0.5)  # the ack after the commit
        finally:
            worker.stop()
            InboxActor.call = call  # type: ignore[method-assign]
            broker.channel.queue_delete(queue)
            broker.close()
            engine.dispose()
    finally:
        template.drop(database)
        template.close()
    return calls


def main() -> None:
    dramatiq = "--dramatiq" in sys.argv
    calls = walk_dramatiq() if dramatiq else asyncio.run(walk())
    across = [(a, b) for a, b in calls if a is not None and a != b]
    files = sorted({b for _, b in calls})
    processing = "dramatiq/_actor.py" if dramatiq else "faststream/_processing.py"
    back = sum(1 for a, _ in across if a == processing)
    upward = [(a, b) for a, b in across if floor(b) > floor(a) >= 0]
    print(f"files entered            {len(files)}: {', '.join(files)}")
    print(f"calls between files      {len(across)}")
    print(f"returns to {processing} {back} (calls from it into another file)")
    print(f"calls up the floors      {len(upward)}")
    if "--list" in sys.argv:
        for a, b in across:
            print(f"  {a} -> {b}{'  (up)' if (a, b) in upward else ''}")


if __name__ == "__main__":
    main()
