"""Running the dispatcher inside your own process instead of `outbox run`."""

import asyncio
import threading

from sqlalchemy import Engine

from inbox_middleware.outbox import Destinations, Dispatcher


async def serve(engine: Engine, destinations: Destinations, stop: asyncio.Event) -> None:
    """In an asyncio application (a FastStream app's lifespan, for example)."""
    dispatcher = Dispatcher(engine, destinations)
    task = asyncio.create_task(dispatcher.run())
    await stop.wait()
    dispatcher.stop()  # in-flight deliveries finish (or are released), then run() returns
    await task


def start_in_a_thread(
    engine: Engine, destinations: Destinations
) -> tuple[Dispatcher, threading.Thread]:
    """Beside synchronous code (a Dramatiq worker process): a thread with its own loop."""
    dispatcher = Dispatcher(engine, destinations)
    return dispatcher, dispatcher.start()


def stop_the_thread(dispatcher: Dispatcher, thread: threading.Thread) -> None:
    dispatcher.stop()  # safe from any thread
    thread.join()
