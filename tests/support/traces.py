"""Spans in memory, and the text rendering of a delivery's span tree that the monitoring
page shows."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

DOCS = Path(__file__).resolve().parents[2] / "docs"


def snippet() -> ModuleType:
    """The monitoring page's tracing snippet, loaded from its file."""
    path = DOCS / "snippets" / "monitoring_tracing.py"
    spec = importlib.util.spec_from_file_location("docs_snippet_monitoring_tracing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The attributes a rendering shows, per span, in this order.
SHOWN = (
    "inbox.settlement",
    "inbox.decision",
    "inbox.reason",
    "inbox.attempt",
    "inbox.claim.wait_seconds",
    "inbox.database",
)


class Spans:
    """A tracer provider whose finished spans are kept in memory."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    @property
    def finished(self) -> tuple[ReadableSpan, ...]:
        return tuple(self.exporter.get_finished_spans())

    def deliveries(self, consumer: str = "billing") -> list[ReadableSpan]:
        """The delivery spans of ``consumer``, in the order they started."""
        found = [span for span in self.finished if span.name == f"inbox {consumer}"]
        return sorted(found, key=lambda span: span.start_time or 0)

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        parent_id = parent.context.span_id
        found = [s for s in self.finished if s.parent and s.parent.span_id == parent_id]
        return sorted(found, key=lambda span: span.start_time or 0)

    def tree(self, root: ReadableSpan, *, timings: bool = False) -> str:
        """``root`` and its descendants, one line each, with the attributes of `SHOWN`
        (without ``inbox.claim.wait_seconds`` unless ``timings``) and any error status."""
        lines = [_line(root, timings)]
        lines += self._below(root, "", timings)
        return "\n".join(lines)

    def _below(self, span: ReadableSpan, indent: str, timings: bool) -> Iterator[str]:
        children = self.children(span)
        for index, child in enumerate(children):
            last = index == len(children) - 1
            yield indent + ("└── " if last else "├── ") + _line(child, timings)
            yield from self._below(child, indent + ("    " if last else "│   "), timings)

    def clear(self) -> None:
        self.exporter.clear()

    @contextmanager
    def producer(self, name: str = "orders send") -> Iterator[Any]:
        """A producer's span, current while the block runs."""
        with self.provider.get_tracer("tests").start_as_current_span(name) as span:
            yield span


def _line(span: ReadableSpan, timings: bool) -> str:
    attributes = span.attributes or {}
    shown = [
        f"{name.removeprefix('inbox.')}={attributes[name]}"
        for name in SHOWN
        if name in attributes and (timings or name != "inbox.claim.wait_seconds")
    ]
    text = span.name + ("  " + " ".join(shown) if shown else "")
    if span.status.status_code is StatusCode.ERROR:
        text += f"  ERROR: {span.status.description}"
    return text
