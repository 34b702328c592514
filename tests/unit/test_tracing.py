"""Tracing switched off costs nothing: no OpenTelemetry import, shared no-op hooks."""

from __future__ import annotations

import subprocess
import sys

from inbox_middleware._observe import tracing


def test_tracing__off_imports_no_opentelemetry():
    # A process that imports both adapters and runs a claim with tracing off loads no
    # OpenTelemetry module beyond what the frameworks import themselves
    program = """
import sys
import dramatiq, faststream, sqlalchemy  # FastStream imports opentelemetry.semconv itself
def otel(): return sorted(name for name in sys.modules if name.startswith("opentelemetry"))
frameworks = otel()
from sqlalchemy import create_engine
import inbox_middleware.dramatiq, inbox_middleware.faststream
from inbox_middleware._core.identity import MessageIdentity
from inbox_middleware._core.protocol import Decision
from inbox_middleware._storage import Inbox, migrate
from inbox_middleware.faststream._payload import delivery
engine = create_engine("sqlite://")
migrate(engine)
claim = delivery(consumer="c", identity=MessageIdentity("p", "m"), body=b"{}", headers={},
                 handler_version="", source="q", canonical=None, content_type=None)
outcome = Inbox(engine).process(claim, lambda session: None)
assert outcome.decision is Decision.FIRST
assert otel() == frameworks, otel()
"""
    env = {"INBOX_OTEL_METRICS": "0", "PATH": ""}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, env=env)
    assert done.returncode == 0, done.stderr.decode()


def test_tracing__hooks_outside_a_traced_delivery_are_shared_no_ops():
    # No observer: the trampoline then runs the claim's steps with nothing in between.
    assert tracing.claim(1).observer is None
    assert tracing.claim(1) is tracing.claim(2)
    assert tracing.phase("inbox.handler") is tracing.phase("inbox.commit")
    assert tracing.trace_id() is None
    assert tracing.exemplar() is None
    assert tracing.tracing_for(False) is tracing.OFF
    assert not tracing.tracing_for(None)
