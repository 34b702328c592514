"""The Dramatiq worker's count flusher: a daemon thread started when the worker boots,
stopped (with a last flush) when it shuts down. See `inbox_middleware._operate.tally`."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from .._operate.tally import CountFlusher
from .._storage.counts import flush_counts_async

if TYPE_CHECKING:
    from .._storage import Inbox
    from .._storage.aio import AsyncInbox

__all__ = ["count_flusher"]


def count_flusher(
    inbox: Inbox | None, async_inbox: AsyncInbox | None, interval: float | None
) -> CountFlusher | None:
    """A started flusher writing through the sync engine, else through the async one on
    Dramatiq's event loop thread (whose connections belong to that loop); None when
    counting is off (``count_interval=None``)."""
    if interval is None:
        return None
    if inbox is not None:
        flusher = CountFlusher.for_engine(inbox.engine, inbox.naming, interval)
    else:
        assert async_inbox is not None
        engine, naming = async_inbox.engine, async_inbox.naming

        def write(worker: str, since: datetime, counts: dict[tuple[str, str], int]) -> None:
            from dramatiq.asyncio import get_event_loop_thread

            loop_thread = get_event_loop_thread()
            if loop_thread is None or not loop_thread.loop.is_running():
                raise RuntimeError("Dramatiq's event loop is not running (add AsyncIO)")

            async def flush() -> None:
                async with engine.begin() as conn:
                    await flush_counts_async(conn, naming, worker, since, counts)

            loop_thread.run_coroutine(flush())

        flusher = CountFlusher(write, interval)
    flusher.start()
    return flusher
