"""The app of `faststream_app` served over ASGI, configured by the same environment:

- ``faststream run tests.apps.faststream_asgi:asgi``: FastStream's own `AsgiFastStream`;
- ``uvicorn tests.apps.faststream_asgi:fastapi``: a FastAPI app whose lifespan starts the
  broker (the guarded ``broker.start``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from faststream.asgi import AsgiFastStream

from .faststream_app import broker, engine

asgi = AsgiFastStream(broker)
asgi.after_shutdown(engine.dispose)


@contextlib.asynccontextmanager
async def lifespan(_: Any) -> AsyncIterator[None]:
    async with broker:
        await broker.start()
        yield
    await engine.dispose()


fastapi = FastAPI(lifespan=lifespan)
