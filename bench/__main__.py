"""Run the benchmarks side by side, in one run, and report ratios.

    python -m bench                 # the full run (about 20 minutes on 2 cores)
    python -m bench --quick         # CI's regression check (under 2 minutes)
    python -m bench --only dramatiq,ceiling --messages 3000

Every figure is the median of --reps repetitions, the modes of a group alternating within
each repetition so that a noisy machine affects them alike. Output: a table on stdout,
bench/results/latest.json and, after a full run, its charts (bench.plots): ratios.png
and latency.png.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

from bench import ceiling, contention, dramatiq_bench, plots
from bench.common import Measurement, Report, machine, prepare_database

RESULTS = Path(__file__).resolve().parent / "results"
GROUPS = ("dramatiq", "duplicates", "scaling", "faststream", "ceiling", "contention")
QUICK_FLOOR = 0.5  # CI fails below this inbox/bare ratio; the real targets need full runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--quick", action="store_true", help="bare vs inbox only, small N")
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", default=",".join(GROUPS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    groups = ["dramatiq"] if args.quick else args.only.split(",")
    messages = 3000 if args.quick else args.messages

    prepare_database()
    report = Report(machine(), {"messages": messages, "reps": args.reps, "groups": groups})
    runners: dict[str, Callable[[Report, int, int, bool], None]] = {
        "dramatiq": run_dramatiq,
        "duplicates": run_duplicates,
        "scaling": run_scaling,
        "faststream": run_faststream,
        "ceiling": run_ceiling,
        "contention": run_contention,
    }
    for group in groups:
        runners[group](report, messages, args.reps, args.quick)
    compute_ratios(report)
    print(render(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(report.to_json())
    if not args.quick:
        plots.write(report, args.out)
    if args.quick:
        ratio = report.ratios["dramatiq inbox / bare"]
        if ratio < QUICK_FLOOR:
            print(f"FAIL: inbox/bare ratio {ratio:.2f} is below {QUICK_FLOOR}", file=sys.stderr)
            return 1
    return 0


def _measure(report: Report, group: str, modes: list[str], reps: int, run, unit="msg/s"):
    measurements = {mode: Measurement(group, mode, unit) for mode in modes}
    for rep in range(reps):
        for mode in modes:
            value = run(mode)
            measurements[mode].runs.append(value)
            print(f"  {group:10s} {mode:24s} rep {rep + 1}: {value:8.0f} {unit}", flush=True)
    report.measurements.extend(measurements.values())
    return measurements


def run_dramatiq(report: Report, messages: int, reps: int, quick: bool) -> None:
    modes = ["bare", "inbox"] if quick else ["bare", "inbox", "redis_setnx", "select_insert"]
    if not quick:
        modes.append("empty")
    found = _measure(
        report, "dramatiq", modes, reps, lambda mode: dramatiq_bench.throughput(mode, messages)
    )
    if quick:
        return
    # Latency at a pace every mode sustains: half of the slowest mode's throughput.
    pace = min(m.median for name, m in found.items() if name != "empty") / 2
    for mode in modes:
        p50, p99 = dramatiq_bench.latency(mode, min(messages // 4, 1500), pace)
        found[mode].p50_ms, found[mode].p99_ms = p50, p99
        found[mode].note = f"latency at {pace:.0f} msg/s"


def run_duplicates(report: Report, messages: int, reps: int, quick: bool) -> None:
    shares = {"first-seen (0% duplicates)": 0.0, "50% duplicates": 0.5, "90% duplicates": 0.9}
    _measure(
        report,
        "duplicates",
        list(shares),
        reps,
        lambda mode: dramatiq_bench.throughput("inbox", messages, duplicates=shares[mode]),
    )


def run_scaling(report: Report, messages: int, reps: int, quick: bool) -> None:
    modes = ["bare, 1 process", "inbox, 1 process", "bare, 2 processes", "inbox, 2 processes"]
    _measure(
        report,
        "scaling",
        modes,
        reps,
        lambda mode: dramatiq_bench.throughput(
            mode.split(",")[0], messages, processes=2 if "2" in mode else 1
        ),
    )


def run_faststream(report: Report, messages: int, reps: int, quick: bool) -> None:
    from bench import faststream_bench

    faststream_bench.run(report, messages, reps, _measure)


def run_ceiling(report: Report, messages: int, reps: int, quick: bool) -> None:
    _measure(
        report,
        "ceiling",
        ["asyncpg, 1 connection", "asyncpg, 4 connections", "asyncpg, 8 connections"],
        reps,
        lambda mode: ceiling.throughput(int(mode.split(",")[1].split()[0])),
        unit="tx/s",
    )


def run_contention(report: Report, messages: int, reps: int, quick: bool) -> None:
    measurement = Measurement("contention", "32 deliveries of one message", "ms to settle")
    p50, p99 = contention.settle_times(32, rounds=20)
    measurement.runs, measurement.p50_ms, measurement.p99_ms = [p50], p50, p99
    report.measurements.append(measurement)


def compute_ratios(report: Report) -> None:
    def ratio(name: str, a: tuple[str, str], b: tuple[str, str]) -> None:
        with contextlib.suppress(KeyError):  # a group that did not run this time
            report.ratios[name] = report.find(*a).median / report.find(*b).median

    ratio("dramatiq inbox / bare", ("dramatiq", "inbox"), ("dramatiq", "bare"))
    ratio("dramatiq redis_setnx / bare", ("dramatiq", "redis_setnx"), ("dramatiq", "bare"))
    ratio("dramatiq select_insert / bare", ("dramatiq", "select_insert"), ("dramatiq", "bare"))
    ratio("dramatiq inbox / empty handler", ("dramatiq", "inbox"), ("dramatiq", "empty"))
    ratio(
        "dramatiq inbox / asyncpg ceiling (8)",
        ("dramatiq", "inbox"),
        ("ceiling", "asyncpg, 8 connections"),
    )
    ratio(
        "duplicate path (90%) / first-seen",
        ("duplicates", "90% duplicates"),
        ("duplicates", "first-seen (0% duplicates)"),
    )
    ratio(
        "scaling inbox 2 / 1 processes",
        ("scaling", "inbox, 2 processes"),
        ("scaling", "inbox, 1 process"),
    )
    ratio("faststream inbox / bare", ("faststream", "inbox"), ("faststream", "bare"))
    ratio(
        "faststream inbox with a result / inbox",
        ("faststream", "inbox_result"),
        ("faststream", "inbox"),
    )
    ratio(
        "faststream inbox with a result / bare with a result",
        ("faststream", "inbox_result"),
        ("faststream", "bare_result"),
    )
    ratio("faststream inbox / empty handler", ("faststream", "inbox"), ("faststream", "empty"))
    ratio(
        "faststream inbox / asyncpg ceiling (8)",
        ("faststream", "inbox"),
        ("ceiling", "asyncpg, 8 connections"),
    )
    ratio(
        "faststream batch / per-message inbox",
        ("faststream", "inbox, batch"),
        ("faststream", "inbox, per message, same broker"),
    )
    ratio(
        "faststream batch / asyncpg ceiling (1)",
        ("faststream", "inbox, batch"),
        ("ceiling", "asyncpg, 1 connection"),
    )
    ratio(
        "faststream batch / asyncpg ceiling (8)",
        ("faststream", "inbox, batch"),
        ("ceiling", "asyncpg, 8 connections"),
    )


def render(report: Report) -> str:
    lines = [
        f"machine: {report.machine['cpus']} cpus, Python {report.machine['python']}, "
        f"PostgreSQL {report.machine['postgresql']} "
        f"(synchronous_commit={report.machine['synchronous_commit']})",
        f"settings: {report.settings}",
        "",
        f"{'group':11s} {'mode':34s} {'median':>9s} {'unit':12s} {'p50 ms':>8s} {'p99 ms':>8s}"
        "  runs",
    ]
    for m in report.measurements:
        p50 = f"{m.p50_ms:8.1f}" if m.p50_ms is not None else " " * 8
        p99 = f"{m.p99_ms:8.1f}" if m.p99_ms is not None else " " * 8
        runs = " ".join(f"{r:.0f}" for r in m.runs)
        lines.append(f"{m.group:11s} {m.mode:34s} {m.median:9.0f} {m.unit:12s} {p50} {p99}  {runs}")
    lines += ["", "ratios (medians, this run):"]
    lines += [f"  {name:42s} {value:5.2f}" for name, value in report.ratios.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
