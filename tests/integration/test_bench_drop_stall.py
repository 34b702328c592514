"""`python -m bench.drop_stall` runs its windows and reports each, on the test server."""

from __future__ import annotations

import json

import psycopg
import pytest
from bench import drop_stall
from bench.common import PG

pytestmark = pytest.mark.postgres


def test_drop_stall__each_window_runs_its_transactions_and_drops_its_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(drop_stall, "WINDOW", 1.5)

    drop_stall.main(["--server", PG, "--megabytes", "4", "--pieces", "4", "--rounds", "1"])

    lines = capsys.readouterr().out.splitlines()
    windows = [json.loads(line) for line in lines if line.startswith('{"window"')]
    assert [w["window"] for w in windows] == ["nothing", "large", "nothing", "small"]
    assert all(w["transactions"] > 100 for w in windows)  # 1,000 a second for 1.5 s
    assert [w["drop_seconds"] > 0 for w in windows] == [False, True, False, True]
    report = json.loads("\n".join(lines[len(windows) :]))
    assert report["summary"]["nothing"]["p99_over_nothing"] == 1.0
    assert set(report["summary"]) == {"nothing", "large", "small"}
    with psycopg.connect(f"{PG}/postgres") as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname = %s", (drop_stall.DATABASE,)
        ).fetchone()
    assert row == (0,)
