"""The tests' breakable proxy: a fault it reports must be the fault the test gets."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from tests.support import proxy as proxy_module
from tests.support.proxy import Proxy


def _echo_server() -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server


def _echo(conn: socket.socket) -> None:
    with contextlib.suppress(OSError), conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def test_proxy__a_connection_being_opened_as_it_goes_down_does_not_outlive_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a proxy whose connection to its upstream is still being opened
    upstream = _echo_server()
    opening, proceed = threading.Event(), threading.Event()
    connect = socket.create_connection

    def slow_connect(address: tuple[str, int], *args: object, **kwargs: object) -> socket.socket:
        opening.set()
        proceed.wait(5)
        return connect(address, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(proxy_module.socket, "create_connection", slow_connect)
    proxy = Proxy(upstream.getsockname())
    client = socket.socket()
    client.settimeout(5)
    try:
        client.connect(("127.0.0.1", proxy.port))
        assert opening.wait(5)
        # When the proxy goes down before that connection is through
        proxy.down()
        proceed.set()
        # Then the connection is reset, not left working past the outage
        echoed = b""
        with contextlib.suppress(ConnectionError):
            client.sendall(b"ping")
            echoed = client.recv(4)
        assert echoed == b""
    finally:
        client.close()
        proxy.close()
        upstream.close()
