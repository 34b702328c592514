"""Explore configurations and fault schedules, and check their histories::

    python -m tests.explore --seeds 40            # 40 fresh seeds (consecutive: every
                                                  # pair of axis values once 40 have run)
    python -m tests.explore --hours 2             # fresh seeds for two hours
    python -m tests.explore --seed 17 --repeat 5  # one schedule five times: how often
                                                  # does its finding reproduce?
    python -m tests.explore --seed 17 --shrink    # the smallest schedule that still fails
    python -m tests.explore --seed 17 --faults 0,2 --intents 12   # a shrunk schedule
    python -m tests.explore --seed 0 --repeat 12 --library OLD/src  # on another commit

Runs on the explorer's own PostgreSQL (5445), PgBouncer (6445), Redis (6390) and
RabbitMQ (5673), started by ``scripts/services explore-postgres explore-pgbouncer
explore-redis explore-rabbitmq``, a NATS server of each run's own, and the machine's
Kafka (tansu, never restarted). Exits 1 when a schedule had a finding, 2 when only the
harness was in trouble.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from pathlib import Path

from .explorer import Verdict, explore, replay_command, select, shrink
from .space import ROWS


def report(verdict: Verdict, print_: object = print) -> None:
    out = print_  # type: ignore[assignment]
    out(verdict.line())  # type: ignore[operator]
    if verdict.outcome in ("finding", "harness"):
        out(f"  configuration: {verdict.schedule.describe()}")  # type: ignore[operator]
        out(f"  replay: {replay_command(verdict.schedule)}")  # type: ignore[operator]
        if verdict.folder is not None:
            out(f"  logs: {verdict.folder}")  # type: ignore[operator]
        for line in verdict.excerpt.splitlines():
            out(f"    {line}")  # type: ignore[operator]


def _indices(text: str | None) -> list[int] | None:
    if text is None:
        return None
    return [] if text == "none" else [int(x) for x in text.split(",")]


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.explore",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seed", type=int, help="run this seed's schedule")
    parser.add_argument("--repeat", type=int, default=1, help="times to run --seed")
    parser.add_argument("--seeds", type=int, help="run this many fresh seeds")
    parser.add_argument("--hours", type=float, help="run fresh seeds for this long")
    parser.add_argument("--first", type=int, help="first of the fresh seeds (default: random)")
    parser.add_argument("--faults", help="--seed: keep only these fault indices (or 'none')")
    parser.add_argument("--intents", type=int, help="--seed: keep only the first N intents")
    parser.add_argument("--shrink", action="store_true", help="--seed: shrink a failing schedule")
    parser.add_argument("--keep", action="store_true", help="keep the logs of passing schedules")
    parser.add_argument(
        "--library",
        help="a folder holding another commit's inbox_middleware package, which the workers "
        "and the CLI then import (git archive COMMIT src | tar -x -C DIR; DIR/src)",
    )
    args = parser.parse_args(argv)
    # Stopped (SIGTERM, or SIGINT even when started in the background): the running
    # schedule's workers, database and queues are cleaned up on the way out.
    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, _exit)
    if args.library:
        library = Path(args.library).resolve()
        if not (library / "inbox_middleware" / "__init__.py").exists():
            parser.error(f"no inbox_middleware package in {library}")
        os.environ["EXPLORE_LIBRARY"] = str(library)
        print(f"workers and CLI import the library in {library}")
    if args.seed is not None:
        schedule = select(args.seed, _indices(args.faults), args.intents)
        print(schedule.describe())
        outcomes: dict[str, int] = {}
        for _ in range(args.repeat):
            verdict = explore(schedule, keep=args.keep)
            report(verdict)
            outcomes[verdict.outcome] = outcomes.get(verdict.outcome, 0) + 1
        print(
            f"seed {args.seed}: {outcomes} in {args.repeat} run(s); "
            f"the finding reproduced {outcomes.get('finding', 0)}/{args.repeat}"
        )
        if args.shrink and outcomes.get("finding"):
            faults, intents = shrink(schedule)
            print(
                f"smallest failing schedule: faults {faults}, {intents} intents: "
                f"{replay_command(schedule, 5, faults, intents)}"
            )
        return 1 if outcomes.get("finding") else (2 if outcomes.get("harness") else 0)
    first = args.first if args.first is not None else random.SystemRandom().randrange(10**6)
    count = args.seeds if args.seeds is not None else (None if args.hours else len(ROWS))
    until = time.monotonic() + args.hours * 3600 if args.hours else None
    print(f"exploring from seed {first} ({len(ROWS)} rows in the pairwise array)")
    totals: dict[str, int] = {}
    seed = first
    while (count is None or seed - first < count) and (until is None or time.monotonic() < until):
        verdict = explore(select(seed), keep=args.keep)
        report(verdict)
        totals[verdict.outcome] = totals.get(verdict.outcome, 0) + 1
        seed += 1
    print(f"explored seeds {first}..{seed - 1}: {totals}")
    return 1 if totals.get("finding") else (2 if totals.get("harness") else 0)


if __name__ == "__main__":
    sys.exit(main())
