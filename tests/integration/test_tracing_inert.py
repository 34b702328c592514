"""``tracing=True`` where nothing would record the spans (the OpenTelemetry API alone,
which the ``otel`` extra installs, or no TracerProvider set) says so once, at a worker's
start (Dramatiq) or its first traced delivery (FastStream), naming what to install or
configure; with an SDK provider it says nothing. Each case runs in a process of its own:
OpenTelemetry's global provider can be set once per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..support.faststream_worker import ROOT

DRAMATIQ = """
import logging, sys
if sys.argv[1] == "api-only":  # as after `pip install inbox-middleware[otel]`
    sys.modules["opentelemetry.sdk"] = None
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
import dramatiq
from dramatiq.brokers.stub import StubBroker
from sqlalchemy import create_engine
from inbox_middleware.dramatiq import InboxMiddleware, identity
from inbox_middleware._storage import migrate
if sys.argv[1] == "provider":
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    trace.set_tracer_provider(TracerProvider())
engine = create_engine("sqlite:///" + sys.argv[2])
migrate(engine)
broker = StubBroker()
broker.add_middleware(InboxMiddleware(engine, tracing=True))
dramatiq.set_broker(broker)

@dramatiq.actor(inbox_consumer="billing")
def act(n: int) -> None:
    pass

worker = dramatiq.Worker(broker, worker_threads=1)
worker.start()
logging.getLogger("test").info("STARTED")
for n in range(2):
    act.send_with_options(args=(n,), **identity(producer="p", message_id=f"m-{n}"))
broker.join(act.queue_name)
worker.join()
worker.stop()
"""

FASTSTREAM = """
import asyncio, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from faststream.rabbit import RabbitBroker, TestRabbitBroker
from sqlalchemy.ext.asyncio import create_async_engine
from inbox_middleware.faststream import FastStreamInbox, InboxSession, identity_headers

async def main() -> None:
    engine = create_async_engine(sys.argv[2])
    inbox = FastStreamInbox(engine, tracing=True)
    broker = RabbitBroker(middlewares=[inbox.middleware])

    @broker.subscriber("orders", dependencies=[inbox.consumer("billing")])
    async def handle(body: dict, session: InboxSession) -> None:
        pass

    async with TestRabbitBroker(broker) as test:
        for n in range(2):
            headers = identity_headers(producer="p", message_id=f"m-{n}")
            await test.publish({"n": n}, queue="orders", headers=headers)
    await engine.dispose()

asyncio.run(main())
"""


def run(script: str, case: str, where: str) -> str:
    ran = subprocess.run(
        [sys.executable, "-c", script, case, where],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return ran.stderr + ran.stdout


def warnings(output: str) -> list[str]:
    return [line for line in output.splitlines() if "tracing is on but records nothing" in line]


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("api-only", "the OpenTelemetry SDK is not installed (the otel extra brings only"),
        ("sdk", "no TracerProvider is set, so OpenTelemetry's global provider is a no-op"),
    ],
)
def test_dramatiq__tracing_that_records_nothing_warns_once_at_start(tmp_path, case, says):
    output = run(DRAMATIQ, case, str(tmp_path / "inbox.db"))
    (line,) = warnings(output)
    assert line.startswith("WARNING inbox_middleware: ")
    assert says in line
    assert "set_tracer_provider" in line or "pip install opentelemetry-sdk" in line
    # at start-up: before the worker took any message
    assert output.index("tracing is on") < output.index("STARTED")


def test_dramatiq__tracing_with_a_provider_says_nothing(tmp_path):
    assert warnings(run(DRAMATIQ, "provider", str(tmp_path / "inbox.db"))) == []


def test_faststream__tracing_that_records_nothing_warns_once(pg_async_url):
    (line,) = warnings(run(FASTSTREAM, "sdk", pg_async_url))
    assert "no TracerProvider is set" in line
