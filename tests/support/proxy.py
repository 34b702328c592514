"""A TCP proxy on 127.0.0.1 that a test can break: refuse new connections, cut live ones,
or black-hole them (bytes taken and never passed on, nothing answered: what a network
that drops packets does to a client without a timeout).

Pointing an engine at the proxy turns "the database is down" and "the connection dropped
mid-transaction" into real network failures, without stopping the shared server.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable


class Proxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._links: list[socket.socket] = []
        self._accepting = True
        self._closed = False
        self._holed = False
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    # -- faults ---------------------------------------------------------------------------

    def refuse(self) -> None:
        """New connections are reset at once; live ones keep working."""
        with self._lock:
            self._accepting = False

    def cut(self) -> None:
        """Reset every live connection (both directions)."""
        with self._lock:
            links, self._links = self._links, []
        for sock in links:
            _reset(sock)

    def down(self) -> None:
        self.refuse()
        self.cut()

    def up(self) -> None:
        self._accepting = True

    def blackhole(self) -> None:
        """From now on nothing passes either way and nothing is answered: live connections
        hang, new ones are accepted and never served."""
        self._holed = True

    def unblackhole(self) -> None:
        """End the black hole: the connections it swallowed bytes of are reset (their
        peers would wait forever otherwise); new ones are served again."""
        self._holed = False
        self.cut()
        with self._lock:
            held, self._held = self._held, []
        for sock in held:
            _reset(sock)

    def close(self) -> None:
        self._closed = True
        self.down()
        self._listener.close()

    # -- plumbing -------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._accepting:
                _reset(client)
                continue
            if self._holed:
                with self._lock:
                    self._held.append(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                # A connection accepted just before refuse() must not outlive the cut
                # that follows it: refuse() and this check share the lock.
                admitted = self._accepting
                if admitted:
                    self._links += [client, server]
            if not admitted:
                _reset(server)
                _reset(client)
                continue
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        _pump(source, sink, lambda: self._holed)


def _pump(
    source: socket.socket, sink: socket.socket, holed: Callable[[], bool] = lambda: False
) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            if not holed():
                sink.sendall(data)
    _reset(sink)
    _reset(source)


def _reset(sock: socket.socket) -> None:
    # shutdown() first: close() alone does not release a socket that a pump thread is
    # blocked reading, so the peer would never learn the connection is gone.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
