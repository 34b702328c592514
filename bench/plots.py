"""The benchmark's charts, one question each, from a run's results.

    python -m bench.plots bench/results/latest.json --out bench/results
    python -m bench.plots docs/assets/benchmark/results.json --out docs/assets/benchmark

- ratios.png: what deduplication costs. Each way of deduplicating, as its throughput over
  the bare transaction's (no deduplication) in the same run; the bar is the median of the
  ratios within each repetition (the modes alternate within one), the dots each of them;
  the dashed line is what the database allows the claim (the limit group).
- peers.png: how much faster the inbox is than each peer: its throughput over theirs.
- cpu.png: what the worker's process spends per message, in CPU µs: bare, the inbox's
  first-seen message and its duplicate, with the range over the repetitions.
- latency.png: each Dramatiq mode's send-to-commit latency, p50 and p99, at a pace every
  mode sustains.

`python -m bench` writes them beside latest.json after a full run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench.common import Measurement, Report

INBOX = "#2f6db3"
OTHER = "#9aa9b8"

# (group, mode, label): the ways of deduplicating, each against its group's bare mode.
ALTERNATIVES = [
    ("dramatiq", "inbox", "Dramatiq: inbox"),
    ("dramatiq", "redis_setnx", "Dramatiq: Redis SET NX first\n(not atomic with the database)"),
    ("dramatiq", "select_insert", "Dramatiq: SELECT, then INSERT\n(copies fail on the key)"),
    (
        "dramatiq",
        "powertools",
        "Dramatiq: Powertools idempotency\n(Redis, apart from the database)",
    ),
    ("dramatiq", "justonce", "Dramatiq: justonce\n(PostgreSQL, its own transactions)"),
    ("faststream", "inbox", "FastStream: inbox"),
]
PEERS = [
    ("powertools", "AWS Lambda Powertools\nidempotency (Redis)"),
    ("justonce", "justonce (PostgreSQL)"),
    ("redis_setnx", "Redis SET NX first"),
    ("select_insert", "SELECT, then INSERT"),
]
CPU = [
    ("bare, per message", "bare transaction"),
    ("inbox, per first-seen message", "inbox: first-seen"),
    ("inbox, per duplicate", "inbox: duplicate"),
]
LATENCY_MODES = [
    ("bare", "bare transaction\n(no deduplication)"),
    ("inbox", "inbox"),
    ("redis_setnx", "Redis SET NX first"),
    ("select_insert", "SELECT, then INSERT"),
    ("powertools", "Powertools idempotency"),
    ("empty", "empty handler\n(no database)"),
]


def load(path: Path) -> Report:
    """A report as `python -m bench` writes it (latest.json)."""
    data: dict[str, Any] = json.loads(path.read_text())
    fields = ("group", "mode", "unit", "runs", "cpu_us", "p50_ms", "p99_ms", "note")
    measurements = [
        Measurement(**{name: item[name] for name in fields if name in item})
        for item in data["measurements"]
    ]
    ratios, cpu = data.get("ratios", {}), data.get("cpu", {})
    return Report(data["machine"], data["settings"], measurements, ratios, cpu)


def write(report: Report, out: Path) -> list[Path]:
    """Draw the charts the report has data for into `out`; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    charts = (
        ("ratios.png", _ratios),
        ("peers.png", _peers),
        ("cpu.png", _cpu),
        ("latency.png", _latency),
    )
    for name, draw in charts:
        path = out / name
        if draw(report, path):
            written.append(path)
    return written


def _find(report: Report, group: str, mode: str) -> Measurement | None:
    try:
        return report.find(group, mode)
    except KeyError:
        return None


def _ratios(report: Report, path: Path) -> bool:
    import matplotlib.pyplot as plt

    rows = []
    for group, mode, label in ALTERNATIVES:
        measured, bare = _find(report, group, mode), _find(report, group, "bare")
        if measured and bare:
            paired = [a / b for a, b in zip(measured.runs, bare.runs, strict=False)]
            rows.append((label, statistics.median(paired), paired, mode == "inbox"))
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 0.75 * len(rows) + 1.6))
    positions = range(len(rows))
    ax.barh(
        positions,
        [ratio for _, ratio, _, _ in rows],
        color=[INBOX if inbox else OTHER for *_, inbox in rows],
        height=0.6,
    )
    for index, (_, ratio, paired, _) in enumerate(rows):
        ax.plot(paired, [index] * len(paired), "o", color="black", markersize=3.5, zorder=3)
        ax.text(ratio + 0.02, index + 0.3, f"{ratio:.2f}", va="center", fontsize=9)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.text(1.0, -0.75, " bare = 1.0", fontsize=8, va="center")
    with_claim, without = (
        _find(report, "limit", "claim + update"),
        _find(report, "limit", "update only"),
    )
    if with_claim and without:
        allowed = statistics.median(
            [a / b for a, b in zip(with_claim.runs, without.runs, strict=False)]
        )
        ax.axvline(allowed, color=INBOX, linewidth=1, linestyle="--")
        label = f"the database's limit for the claim: {allowed:.2f} "
        ax.text(allowed, -0.75, label, fontsize=8, va="center", ha="right")
    ax.set_yticks(list(positions), [label for label, *_ in rows], fontsize=9)
    ax.set_ylim(len(rows) - 0.4, -1.1)
    ax.set_xlim(0, max(1.15, max(max(p, default=0) for _, _, p, _ in rows) + 0.05))
    ax.set_xlabel(
        "throughput ÷ the bare transaction's in the same run\n"
        "(bar: the median of the repetitions' ratios; dots: each repetition's)"
    )
    ax.set_title("What deduplication costs: throughput (higher is better)", fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _peers(report: Report, path: Path) -> bool:
    import matplotlib.pyplot as plt

    inbox = _find(report, "dramatiq", "inbox")
    rows = []
    for mode, label in PEERS:
        peer = _find(report, "dramatiq", mode)
        if inbox and peer:
            paired = [a / b for a, b in zip(inbox.runs, peer.runs, strict=False)]
            rows.append((label, statistics.median(paired), paired))
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 0.7 * len(rows) + 1.6))
    # Bars grow from 1 (as fast): right, the inbox is faster; left, the peer is.
    ratios = [ratio for _, ratio, _ in rows]
    colors = [INBOX if ratio >= 1 else OTHER for ratio in ratios]
    widths = [ratio - 1 for ratio in ratios]
    ax.barh(range(len(rows)), widths, left=1, color=colors, height=0.6)
    for index, (_, ratio, paired) in enumerate(rows):
        ax.plot(paired, [index] * len(paired), "o", color="black", markersize=3.5, zorder=3)
        ax.text(max(ratio, 1) * 1.03, index + 0.3, f"{ratio:.2f}x", va="center", fontsize=9)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), [label for label, *_ in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xscale("log")
    everything = [value for _, ratio, paired in rows for value in (ratio, *paired)]
    ax.set_xlim(min(0.5, min(everything) * 0.8), max(2.0, max(everything) * 1.5))
    ticks = [t for t in (0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20) if ax.get_xlim()[0] <= t]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(
        "the inbox's throughput ÷ the peer's (Dramatiq, same run, log scale)\n"
        "(bar: the median of the repetitions' ratios; dots: each repetition's)"
    )
    ax.set_title("The inbox against each peer (right of 1x: the inbox is faster)", fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _cpu(report: Report, path: Path) -> bool:
    import matplotlib.pyplot as plt

    rows = [(label, report.cpu[name]) for name, label in CPU if name in report.cpu]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 0.7 * len(rows) + 1.6))
    medians = [figure["median"] for _, figure in rows]
    errors = [
        [f["median"] - f["low"] for _, f in rows],
        [f["high"] - f["median"] for _, f in rows],
    ]
    colors = [OTHER if label.startswith("bare") else INBOX for label, _ in rows]
    ax.barh(range(len(rows)), medians, xerr=errors, color=colors, height=0.6, capsize=4)
    for index, (_, figure) in enumerate(rows):
        text = f" {figure['median']:.0f} µs [{figure['low']:.0f}-{figure['high']:.0f}]"
        ax.text(figure["high"], index, text, va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(f["high"] for _, f in rows) * 1.45)
    ax.set_xlabel(
        "CPU time of the worker's processes (user + system) per message, µs\n"
        "(bar: median of the repetitions; whisker: their range)"
    )
    ax.set_title("Dramatiq: CPU per message (lower is better)", fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _latency(report: Report, path: Path) -> bool:
    import matplotlib.pyplot as plt

    rows = [
        (label, found)
        for mode, label in LATENCY_MODES
        if (found := _find(report, "dramatiq", mode)) and found.p50_ms is not None
    ]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 0.7 * len(rows) + 1.6))
    height = 0.38
    for index, (_, m) in enumerate(rows):
        color = INBOX if m.mode == "inbox" else OTHER
        ax.barh(index - height / 2, m.p50_ms, height, color=color)
        ax.barh(index + height / 2, m.p99_ms, height, color=color, alpha=0.55)
        ax.text(m.p50_ms, index - height / 2, f" p50 {m.p50_ms:.1f}", va="center", fontsize=8)
        ax.text(m.p99_ms, index + height / 2, f" p99 {m.p99_ms:.1f}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(m.p99_ms or 0 for _, m in rows) * 1.18)
    pace = rows[0][1].note.removeprefix("latency at ") or "a pace every mode sustains"
    ax.set_xlabel(f"milliseconds from send to commit\nat {pace}, half the slowest mode's rate")
    ax.set_title("Dramatiq: latency per message, p50 and p99 (lower is better)", fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__)
    parser.add_argument("results", type=Path, help="a results file (latest.json)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    for path in write(load(args.results), args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
