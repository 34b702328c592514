"""A real HTTP server on 127.0.0.1 that applies each ``Idempotency-Key`` once.

It plays the remote side of the outbox: the first request with a key is applied and
answered 201; a repeated key is answered 200 with ``"replayed": true`` and not applied
again. A test can make it hang after applying (an ambiguous timeout for the client),
answer slowly, or refuse with a status, and can read what it received.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    key: str | None
    body: Any
    headers: dict[str, str]
    at: float


@dataclass
class Behaviour:
    hang_after_apply: int = 0
    """How many of the next first-time requests are applied and then not answered."""
    slow: float = 0.0
    """Seconds to wait after applying before answering."""
    status: int | None = None
    """Answer every request with this status, without applying it."""


@dataclass
class Remote:
    behaviour: Behaviour = field(default_factory=Behaviour)

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.applied: dict[str, Any] = {}
        self.received: list[Received] = []
        self.active: Counter[str] = Counter()
        self.max_concurrent_per_key = 0
        self._closing = threading.Event()
        remote = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real APIs

            def do_POST(self) -> None:
                remote._handle(self)

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # a burst of concurrent deliveries is not dropped

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/effects"

    def requests_for(self, key: str) -> int:
        with self.lock:
            return sum(1 for r in self.received if r.key == key)

    def close(self) -> None:
        self._closing.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("content-length") or 0)
        body = json.loads(request.rfile.read(length) or b"null")
        key = request.headers.get("Idempotency-Key")
        behaviour = self.behaviour
        with self.lock:
            self.received.append(Received(key, body, dict(request.headers), time.time()))
            self.active[key or ""] += 1
            self.max_concurrent_per_key = max(self.max_concurrent_per_key, self.active[key or ""])
            if behaviour.status is not None:
                status, answer, hang, slow = behaviour.status, {"error": "refused"}, False, 0.0
            elif key in self.applied:
                status, answer, hang, slow = 200, {"replayed": True, "key": key}, False, 0.0
            else:
                self.applied[key or ""] = body
                status, answer = 201, {"applied": True, "key": key}
                hang = behaviour.hang_after_apply > 0
                behaviour.hang_after_apply -= 1 if hang else 0
                slow = behaviour.slow
        try:
            if hang:
                self._closing.wait(30)  # the client gives up first: an ambiguous timeout
                return
            if slow:
                self._closing.wait(slow)
            data = json.dumps(answer).encode()
            request.send_response(status)
            request.send_header("content-type", "application/json")
            request.send_header("content-length", str(len(data)))
            request.end_headers()
            request.wfile.write(data)
        except OSError:
            pass  # the client went away
        finally:
            with self.lock:
                self.active[key or ""] -= 1
