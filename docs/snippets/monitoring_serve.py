"""The metrics endpoint beside the worker processes: the aggregate of every worker's
samples (PROMETHEUS_MULTIPROC_DIR) and the table gauges, read at most every 30 s."""

from __future__ import annotations

from inbox_middleware.metrics import MetricsServer, serve


# --8<-- [start:serve]
def serve_metrics(database_url: str, port: int = 9300, addr: str = "0.0.0.0") -> MetricsServer:
    # The workers' folder comes from PROMETHEUS_MULTIPROC_DIR. The URL is read through a
    # one-connection psycopg engine, disposed of when the server is closed.
    return serve(port, addr=addr, engine=database_url, cache_seconds=30)


# --8<-- [end:serve]
