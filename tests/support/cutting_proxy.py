"""A database proxy that cuts the connections PostgreSQL reports as mid-transaction.

`Proxy` cuts every live connection; a chaos run wants the interesting ones: those whose
server session has a transaction open (a claim taken, the handler's writes done or under
way, the commit not yet sent). PostgreSQL names each session's client port, which is the
local port of the proxy's upstream socket, so the two can be matched exactly (through
PgBouncer, its admin console links them).
"""

from __future__ import annotations

import socket
import time

import psycopg

from . import services
from .proxy import Proxy, _reset

__all__ = ["CuttingProxy"]

MID_TRANSACTION = """
    SELECT client_port FROM pg_stat_activity
    WHERE application_name = ANY(%s) AND xact_start IS NOT NULL
      AND state IN ('active', 'idle in transaction')
"""


def _client_ports_behind_pgbouncer(server_ports: set[int]) -> set[int]:
    """Through PgBouncer the sessions' client ports are PgBouncer's own: its admin console
    links each server connection (by its local port) to the client it serves now, whose
    port is the local port of this proxy's upstream socket."""
    host, port = services.postgres_address()
    with psycopg.connect(
        f"postgresql://postgres@{host}:{port}/pgbouncer", autocommit=True
    ) as console:
        servers = console.execute("SHOW SERVERS").fetchall()
        clients = console.execute("SHOW CLIENTS").fetchall()
    # columns: type, user, database, state, addr, port, local_addr, local_port, ..., ptr, link
    linked = {server[14] for server in servers if server[7] in server_ports and server[14]}
    return {int(client[5]) for client in clients if client[13] in linked}


class CuttingProxy(Proxy):
    def cut_ports(self, ports: set[int]) -> int:
        """Reset the links whose upstream socket uses one of ``ports``; how many."""
        cut: list[tuple[socket.socket, socket.socket]] = []
        with self._lock:
            kept: list[socket.socket] = []
            for client, server in zip(self._links[0::2], self._links[1::2], strict=True):
                try:
                    port = server.getsockname()[1]
                except OSError:
                    continue  # closed already: forget it
                if port in ports:
                    cut.append((client, server))
                else:
                    kept += [client, server]
            self._links = kept
        for client, server in cut:
            _reset(client)
            _reset(server)
        return len(cut)

    def cut_mid_transaction(
        self, admin: psycopg.Connection, applications: list[str], search: float = 0.0
    ) -> int:
        """Cut every connection of sessions named one of ``applications`` that has a
        transaction open right now (asked on ``admin``, a connection that does not pass
        through here); with ``search``, keep asking for up to that many seconds until one
        has (where transactions are short and few, one look mostly finds none)."""
        deadline = time.monotonic() + search
        rows = admin.execute(MID_TRANSACTION, (applications,)).fetchall()
        while not rows and time.monotonic() < deadline:
            time.sleep(0.002)
            rows = admin.execute(MID_TRANSACTION, (applications,)).fetchall()
        ports = {int(port) for (port,) in rows if port is not None}
        if services.THROUGH_POOLER:
            ports = _client_ports_behind_pgbouncer(ports)
        return self.cut_ports(ports)

    def links(self) -> int:
        with self._lock:
            return len(self._links) // 2
