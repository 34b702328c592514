"""What the monitoring guide shows works: its snippets run here, and the Grafana dashboard
and alert rules only use metrics the library exports."""

from __future__ import annotations

import importlib.util
import io
import json
import re
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import text

from inbox_middleware._core.identity import MessageIdentity, hash_json
from inbox_middleware._core.protocol import Delivery
from inbox_middleware._observe.instruments import _INSTRUMENTS
from inbox_middleware._storage import Inbox
from inbox_middleware.dramatiq import identity
from inbox_middleware.faststream import FastStreamInbox, identity_headers

from ..apps.domain import balance
from ..support.dramatiq_worker import drain, running_worker
from ..support.faststream_brokers import Harness, eventually
from .test_metrics import Scrape

ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = ROOT / "docs" / "snippets"


def load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"snippet_{name}", SNIPPETS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported_names(pg_engine: Any, tmp_path: Path, monkeypatch: Any) -> set[str]:
    """Every sample name the library exports: instruments, and the served table gauges."""
    names = set()
    for kind, name, _, _ in _INSTRUMENTS.values():
        if kind == "counter":
            names.add(f"{name}_total")
        elif kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    with pg_engine.begin() as conn:  # one of each row, so every table gauge has a sample
        conn.execute(
            text(
                "INSERT INTO message_outbox (effect_id, destination, payload) "
                "VALUES ('e', 'd', '{}');"
                "INSERT INTO consumer_inbox (consumer_name, producer_name, message_id, "
                "payload_sha256, hash_scheme) VALUES ('c', 'p', 'm', 'h', 's');"
                "INSERT INTO inbox_retention (consumer_name, scenarios, minimum_seconds, "
                "dominant_scenario) VALUES ('*', '{}', 60, 'x');"
                "INSERT INTO inbox_poison (consumer_name, producer_name, message_id, "
                "payload_sha256, hash_scheme, reason_code) VALUES ('c', 'p', 'm', 'h', 's', 'r')"
            )
        )
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    server = load("monitoring_serve").serve_metrics(
        str(pg_engine.url.render_as_string(hide_password=False)), port=0, addr="127.0.0.1"
    )
    with server:
        scrape = Scrape(server.url)
    served = {name for name, _ in scrape.samples}
    assert {"inbox_table_stats_up", "inbox_repair_pending", "inbox_outbox_pending"} <= served
    return names | served


def used_names(expression: str) -> set[str]:
    return set(re.findall(r"\binbox_[a-z_]+\b", expression))


def test_dashboard_and_alerts__use_only_exported_metrics(pg_engine, tmp_path, monkeypatch):
    exported = exported_names(pg_engine, tmp_path, monkeypatch)
    dashboard = json.loads((ROOT / "docs" / "grafana" / "inbox-middleware.json").read_text())
    expressions = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(expressions) >= 20
    used = set().union(*(used_names(e) for e in expressions))
    assert used <= exported, used - exported
    # Every exported series is on the dashboard (histograms through their buckets)
    assert {n for n in exported if not n.endswith(("_sum", "_count"))} - used == set()
    rules = yaml.safe_load((ROOT / "docs" / "grafana" / "alerts.yml").read_text())
    alerts = [r for group in rules["groups"] for r in group["rules"]]
    assert "InboxProducerStoppedSendingIds" in {a["alert"] for a in alerts}
    for alert in alerts:
        assert used_names(alert["expr"]) <= exported, alert["alert"]


def test_logging_snippet__one_json_line_per_decision(pg_engine):
    import logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("inbox_middleware")
    level = logger.level
    load("monitoring_logging").log_inbox_decisions_as_json(handler)
    try:
        inbox = Inbox(pg_engine)
        delivery = Delivery("logs", MessageIdentity("orders", "o-1"), hash_json({"a": 1}, "j.v1"))
        inbox.process(delivery, lambda session: None)
        inbox.process(delivery, lambda session: None)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["inbox_event"] for line in lines] == [
        "claimed",
        "committed",
        "duplicate",
        "committed",
    ]
    duplicate = lines[2]
    assert (duplicate["level"], duplicate["inbox_consumer"], duplicate["inbox_message_id"]) == (
        "INFO",
        "logs",
        "o-1",
    )
    assert duplicate["inbox_decision"] == "duplicate" and duplicate["inbox_shadow"] is False
    assert duplicate["inbox_stored_sha256"] == duplicate["inbox_payload_sha256"]


def test_shadow_snippet__dramatiq_actor_processes_a_duplicate(stub_broker, pg_engine):
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0)"))
    add_credit = load("monitoring_shadow").dramatiq_consumer(stub_broker, pg_engine)
    with running_worker(stub_broker, threads=1) as worker:
        for _ in range(2):
            add_credit.send_with_options(args=(7, 10), **identity(producer="p", message_id="m"))
        drain(stub_broker, "default", worker)
    with pg_engine.connect() as conn:
        assert balance(conn, 7) == 20  # processed twice: shadow mode skips nothing


async def test_shadow_snippet__faststream_subscriber_processes_a_duplicate(
    pg_async_engine, pg_engine
):
    with pg_engine.begin() as conn:
        conn.execute(text("INSERT INTO accounts VALUES (7, 0)"))
    inbox = FastStreamInbox(pg_async_engine, retry_backoff=(0.05, 0.5))
    h = Harness("rabbit", [inbox.middleware])
    inbox.guard(h.broker)
    load("monitoring_shadow").faststream_consumer(h.broker, inbox, queue=h.name)

    def credited() -> int:
        with pg_engine.connect() as conn:
            return balance(conn, 7)

    try:
        async with h.broker:
            await h.broker.start()
            for _ in range(2):
                await h.publish(
                    {"account": 7, "delta": 10}, identity_headers(producer="p", message_id="m")
                )
            await eventually(lambda: credited() == 20, what="both deliveries processed")
    finally:
        await h.cleanup()


def test_metrics_reference__names_every_exported_metric_and_nothing_else(
    pg_engine, tmp_path, monkeypatch
):
    names = exported_names(pg_engine, tmp_path, monkeypatch)
    histograms = {n.removesuffix("_bucket") for n in names if n.endswith("_bucket")}
    series = {f"{h}{suffix}" for h in histograms for suffix in ("_bucket", "_sum", "_count")}
    exported = (names - series) | histograms
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    rows = [line.split("|")[1] for line in page.splitlines() if line.startswith("| `")]
    documented = set().union(*(re.findall(r"`(inbox_[a-z_]+)`", row) for row in rows))
    assert documented == exported, (documented - exported, exported - documented)
