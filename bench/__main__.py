"""Run the benchmarks side by side, in one run, and report ratios.

    python -m bench                 # the full run (about 20 minutes on 2 cores)
    python -m bench --quick         # CI's regression checks (under 2 minutes)
    python -m bench --only dramatiq,limit --messages 3000

Every figure is the median of --reps repetitions (5; 3 with --quick), the modes of a group
alternating within each repetition so that a noisy machine affects them alike; a ratio is
the median of the ratios within each repetition, with their range. The Dramatiq runs also
measure the worker's CPU time per message (its process tree, user and system), which
swings far less than throughput on a shared machine. Output: a table on stdout,
bench/results/latest.json and, after a full run, its charts (bench.plots).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import ceiling, contention, dramatiq_bench, hotpath, limit, plots
from bench.common import Measurement, Report, machine, prepare_database, spread

RESULTS = Path(__file__).resolve().parent / "results"
GROUPS = ("dramatiq", "limit", "duplicates", "scaling", "faststream", "ceiling", "contention")
# The peers a user would pick instead (bench.peers), in the full Dramatiq group: they need
# the bench extra's packages, which the quick check does not.
PEERS = ["redis_setnx", "select_insert", "powertools", "justonce"]
# The quick mode's regression checks (the real targets are judged from full runs):
# - the Python calls the inbox adds to a message in the hot path (bench.hotpath, counted
#   under cProfile: the same in every run, where its CPU time moves with the machine's
#   load). 270 in December 2026 (inbox 710, bare 440); the inbox's CPU follows how much
#   code a message runs.
# - the worker's throughput, inbox / bare. Eight threads and a broker on 2 cores make it
#   swing: 0.46 [0.42, 0.72] in one CI run, 0.59 to 0.67 on a quiet machine the same day,
#   with nothing changed. The floor catches a collapse (a lock serializing the threads, a
#   round trip more a message), not a few percent.
CALLS_CEILING = 320
QUICK_FLOOR = 0.35


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--quick", action="store_true", help="bare vs inbox only, small N")
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=None, help="5; 3 with --quick")
    parser.add_argument("--only", default=",".join(GROUPS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    groups = ["dramatiq"] if args.quick else args.only.split(",")
    messages = 3000 if args.quick else args.messages
    reps = args.reps or (3 if args.quick else 5)

    prepare_database()
    report = Report(machine(), {"messages": messages, "reps": reps, "groups": groups})
    runners: dict[str, Callable[[Report, int, int, bool], None]] = {
        "dramatiq": run_dramatiq,
        "limit": run_limit,
        "duplicates": run_duplicates,
        "scaling": run_scaling,
        "faststream": run_faststream,
        "ceiling": run_ceiling,
        "contention": run_contention,
    }
    for group in groups:
        runners[group](report, messages, reps, args.quick)
    compute_ratios(report)
    print(render(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(report.to_json())
    if not args.quick:
        plots.write(report, args.out)
    if args.quick:
        return quick_checks(report)
    return 0


def quick_checks(report: Report) -> int:
    """The quick mode's two regression checks (`CALLS_CEILING`, `QUICK_FLOOR`): 1 when
    either fails."""
    calls = hotpath.calls_per_message()
    added = calls["inbox"] - calls["bare"]
    print(
        f"\nthe hot path's Python calls a message: inbox {calls['inbox']:.0f}, bare "
        f"{calls['bare']:.0f}, added {added:.0f} (the ceiling: {CALLS_CEILING})"
    )
    failed = 0
    if added > CALLS_CEILING:
        print(
            f"FAIL: the inbox adds {added:.0f} calls a message, above {CALLS_CEILING}",
            file=sys.stderr,
        )
        failed = 1
    ratio = report.ratios["dramatiq inbox / bare"]["median"]
    if ratio < QUICK_FLOOR:
        print(f"FAIL: inbox/bare ratio {ratio:.2f} is below {QUICK_FLOOR}", file=sys.stderr)
        failed = 1
    return failed


def _measure(report: Report, group: str, modes: list[str], reps: int, run, unit="msg/s"):
    measurements = {mode: Measurement(group, mode, unit) for mode in modes}
    for rep in range(reps):
        for mode in modes:
            value = _again(run, mode)
            cpu = ""
            if isinstance(value, tuple):  # throughput, CPU µs a message (and the server's)
                value, per_message, *server = value
                measurements[mode].cpu_us.append(per_message)
                cpu = f"  {per_message:6.0f} µs CPU/msg"
                if server:
                    measurements[mode].server_cpu_us.append(server[0])
                    cpu += f", server {server[0]:6.0f}"
            measurements[mode].runs.append(value)
            print(f"  {group:10s} {mode:24s} rep {rep + 1}: {value:8.0f} {unit}{cpu}", flush=True)
    report.measurements.extend(measurements.values())
    return measurements


def _again(run: Callable[[str], Any], mode: str, tries: int = 3) -> Any:
    """``run(mode)``, run again when it failed: on a shared machine another session's test
    may restart a broker or the database in the middle of a repetition."""
    for attempt in range(1, tries + 1):
        try:
            return run(mode)
        except Exception as exc:
            if attempt == tries:
                raise
            print(f"  {mode}: {type(exc).__name__} ({exc}); once more in 10 s", flush=True)
            time.sleep(10)
    raise AssertionError("unreachable")


def run_dramatiq(report: Report, messages: int, reps: int, quick: bool) -> None:
    modes = ["bare", "inbox"] if quick else ["bare", "inbox", *PEERS, "empty"]
    # justonce runs at about a tenth of the others' pace (a connection per call): a fifth
    # of the messages keeps its repetitions as long as theirs.
    found = _measure(
        report,
        "dramatiq",
        modes,
        reps,
        lambda mode: dramatiq_bench.throughput(
            mode, messages // 5 if mode == "justonce" else messages
        ),
    )
    if quick:
        return
    # Latency at a pace every mode sustains: half of the slowest mode's throughput, but for
    # justonce, an order of magnitude slower (a connection per call), measured for
    # throughput only.
    paced = [mode for mode in modes if mode != "justonce"]
    pace = min(found[mode].median for mode in paced if mode != "empty") / 2
    for mode in paced:
        p50, p99 = dramatiq_bench.latency(mode, min(messages // 4, 1500), pace)
        found[mode].p50_ms, found[mode].p99_ms = p50, p99
        found[mode].note = f"latency at {pace:.0f} msg/s"


def run_limit(report: Report, messages: int, reps: int, quick: bool) -> None:
    _measure(
        report,
        "limit",
        list(limit.MODES),
        reps,
        lambda mode: limit.throughput(limit.MODES[mode]),
        unit="tx/s",
    )


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


def _paired(a: Measurement, b: Measurement) -> list[float]:
    """a / b within each repetition (the modes of a group alternate within one; across
    groups, the n-th repetition of one is paired with the n-th of the other)."""
    return [x / y for x, y in zip(a.runs, b.runs, strict=False) if y]


def compute_ratios(report: Report) -> None:
    def find(key: tuple[str, str]) -> Measurement | None:
        with contextlib.suppress(KeyError):  # a group that did not run this time
            return report.find(*key)
        return None

    def ratio(name: str, a: tuple[str, str], b: tuple[str, str]) -> None:
        found, base = find(a), find(b)
        if found and base and found.runs and base.runs:
            runs = _paired(found, base)
            report.ratios[name] = spread(runs) | {"runs": runs}

    ratio("dramatiq inbox / bare", ("dramatiq", "inbox"), ("dramatiq", "bare"))
    for peer in PEERS:
        ratio(f"dramatiq {peer} / bare", ("dramatiq", peer), ("dramatiq", "bare"))
    for peer in ("powertools", "justonce", "redis_setnx"):
        ratio(f"dramatiq inbox / {peer}", ("dramatiq", "inbox"), ("dramatiq", peer))
    ratio("dramatiq inbox / empty handler", ("dramatiq", "inbox"), ("dramatiq", "empty"))
    ratio("limit claim / no claim", ("limit", "claim + update"), ("limit", "update only"))
    inbox, bare = find(("dramatiq", "inbox")), find(("dramatiq", "bare"))
    with_claim, without = find(("limit", "claim + update")), find(("limit", "update only"))
    if inbox and bare and with_claim and without:
        # What the inbox reaches in the worker against what the database allows the claim.
        runs = [
            worker / allowed
            for worker, allowed in zip(
                _paired(inbox, bare), _paired(with_claim, without), strict=False
            )
        ]
        report.ratios["dramatiq inbox / bare ÷ limit claim / no claim"] = spread(runs) | {
            "runs": runs
        }
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
    ratio("faststream floor / bare", ("faststream", "floor"), ("faststream", "bare"))
    ratio("faststream inbox / floor", ("faststream", "inbox"), ("faststream", "floor"))
    ratio("faststream floor_sync / bare", ("faststream", "floor_sync"), ("faststream", "bare"))
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
    compute_cpu(report, find)


def compute_cpu(report: Report, find: Callable[[tuple[str, str]], Measurement | None]) -> None:
    """The CPU the inbox adds per message, from the same run: inbox minus bare per
    first-seen message, and a duplicate's own cost (from the 90% run, less its first-seen
    tenth at the first-seen run's cost), each within a repetition."""

    def figure(name: str, runs: list[float]) -> None:
        if runs:
            report.cpu[name] = spread(runs) | {"runs": runs}

    inbox, bare = find(("dramatiq", "inbox")), find(("dramatiq", "bare"))
    if inbox and bare:
        figure("bare, per message", bare.cpu_us)
        figure("inbox, per first-seen message", inbox.cpu_us)
        added = [i - b for i, b in zip(inbox.cpu_us, bare.cpu_us, strict=False)]
        figure("inbox - bare, per first-seen message", added)
    # FastStream: the worker's CPU and the server's, a message, against bare's.
    fs_bare = find(("faststream", "bare"))
    for mode in ("inbox", "floor", "floor_sync"):
        found = find(("faststream", mode))
        if not (found and fs_bare):
            continue
        for part, runs, base in (
            ("worker", found.cpu_us, fs_bare.cpu_us),
            ("server", found.server_cpu_us, fs_bare.server_cpu_us),
        ):
            figure(
                f"faststream {mode} - bare, {part}",
                [m - b for m, b in zip(runs, base, strict=False)],
            )
    first = find(("duplicates", "first-seen (0% duplicates)"))
    mostly = find(("duplicates", "90% duplicates"))
    if first and mostly:
        duplicate = [(m - 0.1 * f) / 0.9 for m, f in zip(mostly.cpu_us, first.cpu_us, strict=False)]
        figure("inbox, per duplicate", duplicate)
        if bare:
            figure(
                "inbox duplicate - bare, per message",
                [d - b for d, b in zip(duplicate, bare.cpu_us, strict=False)],
            )


def render(report: Report) -> str:
    lines = [
        f"machine: {report.machine['cpus']} cpus, Python {report.machine['python']}, "
        f"PostgreSQL {report.machine['postgresql']} "
        f"(synchronous_commit={report.machine['synchronous_commit']})",
        f"settings: {report.settings}",
        "",
        f"{'group':11s} {'mode':32s} {'median':>8s} {'unit':12s} {'CPU µs':>7s} "
        f"{'server':>7s} {'p50 ms':>7s} {'p99 ms':>7s}  runs",
    ]
    for m in report.measurements:
        p50 = f"{m.p50_ms:7.1f}" if m.p50_ms is not None else " " * 7
        p99 = f"{m.p99_ms:7.1f}" if m.p99_ms is not None else " " * 7
        cpu = f"{spread(m.cpu_us)['median']:7.0f}" if m.cpu_us else " " * 7
        server = f"{spread(m.server_cpu_us)['median']:7.0f}" if m.server_cpu_us else " " * 7
        runs = " ".join(f"{r:.0f}" for r in m.runs)
        lines.append(
            f"{m.group:11s} {m.mode:32s} {m.median:8.0f} {m.unit:12s} {cpu} {server} {p50} "
            f"{p99}  {runs}"
        )
    lines += ["", "ratios (median of the repetitions' ratios, [min, max]):"]
    lines += [
        f"  {name:48s} {r['median']:5.2f}  [{r['low']:.2f}, {r['high']:.2f}]"
        for name, r in report.ratios.items()
    ]
    if report.cpu:
        lines += ["", "CPU, µs per message (median of the repetitions, [min, max]):"]
        lines += [
            f"  {name:48s} {c['median']:5.0f}  [{c['low']:.0f}, {c['high']:.0f}]"
            for name, c in report.cpu.items()
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
