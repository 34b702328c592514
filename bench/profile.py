"""Where a worker spends its CPU per message: bare against inbox, by package.

    python -m bench.profile dramatiq             # 8,000 messages per mode
    python -m bench.profile faststream --messages 5000
    python -m bench.profile faststream --mode floor   # the guarantee's statements alone

Each mode's worker (the benchmark's own, see `dramatiq_worker` and `faststream_worker`)
runs under py-spy, sampling only the thread that holds the GIL (``--gil``): in a worker
bound by its own Python, that is the time each message costs. Messages are enqueued
before the worker starts; the table divides the samples by the message count, so the
start-up (imports, connections) is spread over them alike in both modes and shows as its
own rows. Output: microseconds per message by package, then the functions whose own time
grew most with the inbox. py-spy comes with the ``bench`` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from bench.common import ROOT, prepare_database, reset_database, wait_applied

_PY_SPY = ("record", "--gil", "--nonblocking", "--subprocesses", "-f", "raw")
_FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*?):\d+\)$")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile")
    parser.add_argument("adapter", choices=("dramatiq", "faststream"))
    parser.add_argument("--messages", type=int, default=8000)
    parser.add_argument("--rate", type=int, default=500, help="samples a second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--mode",
        choices=("inbox", "floor", "floor_sync"),
        default="inbox",
        help="the mode set against bare: the inbox, or a floor (FastStream: the guarantee's "
        "statements alone, see bench.faststream_worker)",
    )
    args = parser.parse_args(argv)
    if args.mode != "inbox" and args.adapter != "faststream":
        parser.error("the floors are FastStream's (python -m bench.hotpath --floor is Dramatiq's)")
    py_spy = _py_spy()
    if py_spy is None:
        parser.error("py-spy is not installed: pip install -e '.[bench]'")

    prepare_database()
    folder = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    profiles = {}
    for mode in ("bare", args.mode):
        output = folder / f"{args.adapter}-{mode}.txt"
        rate = _record(py_spy, args.adapter, mode, args.messages, args.rate, output)
        profiles["bare" if mode == "bare" else "inbox"] = _load(output)
        print(f"{args.adapter} {mode}: {rate:.0f} msg/s while sampled ({output})")
    print(report(profiles, args.messages, args.rate, args.top))
    return 0


def _py_spy() -> str | None:
    """py-spy: on PATH, else beside this interpreter (a virtual environment's ``bin``,
    when it is run as ``.venv/bin/python -m bench.profile`` without being activated)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def _record(py_spy: str, adapter: str, mode: str, messages: int, rate: int, output: Path) -> float:
    """Run ``mode``'s worker under py-spy over ``messages`` messages; msg/s while sampled."""
    queue = f"profile_{adapter}_{mode}"
    reset_database()
    env = os.environ | {"BENCH_MODE": mode, "BENCH_QUEUE": queue}
    command: Sequence[str]
    if adapter == "dramatiq":
        from bench.dramatiq_bench import _purge, send, worker_arguments

        _purge(queue)
        send(mode, queue, messages, messages)
        command = worker_arguments()
    else:
        from bench.faststream_bench import WORKER_ARGUMENTS, _cleanup, _prepare

        asyncio.run(_prepare(mode, queue, messages))
        command = WORKER_ARGUMENTS
    spy = subprocess.Popen(
        [py_spy, *_PY_SPY, "-r", str(rate), "-o", str(output), "--", sys.executable, *command],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        first, done = wait_applied(messages, timeout=600)
    finally:
        # Stop the worker, py-spy's child: py-spy writes its file once the worker is gone.
        children = Path(f"/proc/{spy.pid}/task/{spy.pid}/children").read_text().split()
        for pid in children:
            os.kill(int(pid), 15)
        spy.wait(timeout=120)
        if adapter == "faststream":
            asyncio.run(_cleanup(mode, queue))
    return (messages - 1) / max(done - first, 1e-6)


def _load(path: Path) -> tuple[Counter[str], Counter[str]]:
    """Samples by the package, and by the function, that held the GIL (self time)."""
    packages: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [_FRAME.match(frame) for frame in stack.split(";")]
        frames = [frame for frame in frames if frame]
        if not frames or not count.isdigit():
            continue
        leaf = frames[-1]
        package = _package(leaf["path"])
        packages[package] += int(count)
        functions[f"{leaf['function']} ({package})"] += int(count)
    return packages, functions


def _package(path: str) -> str:
    """The top-level package of a frame's file, or the file itself for the standard library."""
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    if "/" in path and not path.startswith(("/", "<")):
        head, rest = path.split("/", 1)
        return (
            f"{head}.{rest.split('/')[0].removesuffix('.py')}"
            if head == "inbox_middleware"
            else head
        )
    return path.rsplit("/", 1)[-1]


def report(
    profiles: dict[str, tuple[Counter[str], Counter[str]]], messages: int, rate: int, top: int
) -> str:
    def per_message(samples: int) -> float:
        return samples / rate / messages * 1e6

    bare, inbox = profiles["bare"], profiles["inbox"]
    lines = [
        "",
        "GIL time per message, µs                bare    inbox    added",
        f"{'total':36s} {per_message(sum(bare[0].values())):8.0f} "
        f"{per_message(sum(inbox[0].values())):8.0f} "
        f"{per_message(sum(inbox[0].values()) - sum(bare[0].values())):8.0f}",
    ]
    packages = sorted(set(bare[0]) | set(inbox[0]), key=lambda p: -max(bare[0][p], inbox[0][p]))
    for package in packages[:top]:
        b, i = bare[0][package], inbox[0][package]
        lines.append(
            f"  {package[:34]:34s} {per_message(b):8.0f} {per_message(i):8.0f} "
            f"{per_message(i - b):8.0f}"
        )
    lines += ["", "functions whose own time grew most, µs per message"]
    grown = sorted(set(inbox[1]), key=lambda f: -(inbox[1][f] - bare[1][f]))
    for function in grown[:top]:
        added = per_message(inbox[1][function] - bare[1][function])
        lines.append(f"  {function[:62]:62s} {added:6.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
