"""Run the chaos alone, at any size, on any broker an adapter supports::

    python -m tests.chaos --adapter dramatiq --broker rabbitmq --messages 100000
    python -m tests.chaos --adapter faststream --broker nats --messages 100000
    python -m tests.chaos --adapter faststream --broker kafka --messages 10000

or one production topology's run (`tests.chaos.topologies`), the broker chosen by it::

    python -m tests.chaos --topology failover --adapter dramatiq --messages 20000
    python -m tests.chaos --topology failover-async --adapter faststream
    python -m tests.chaos --topology persistent-redis --adapter dramatiq

It runs on a database of its own (cloned from the tests' template, dropped at the end),
prints progress and the one-line summary, and exits 1 when the invariant does not hold,
or (from 50,000 messages) when the never-killed worker's RSS grew by 10% or more over
the second half of the run. Restarts the machine's PostgreSQL once, and RabbitMQ once
when it is the broker; Redis is the machine's persistent one (SIGKILLed once); NATS is a
server the run starts itself; Kafka (the machine's tansu, memory only) is not restarted.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from . import topologies
from .run import Config, run
from .targets import BROKERS

LONG_RUN = 50_000  # from this size on, memory growth is checked
RSS_LIMIT = 0.10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--adapter", choices=sorted(BROKERS), default="dramatiq")
    parser.add_argument(
        "--broker",
        choices=["rabbitmq", "rabbitmq-quorum", "redis", "nats", "kafka"],
        default="rabbitmq",
    )
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the logs folder")
    parser.add_argument("--topology", choices=topologies.TOPOLOGIES)
    args = parser.parse_args(argv)
    if args.topology is not None:
        config = topologies.config(
            args.topology, args.adapter, args.messages, workers=args.workers, seed=args.seed
        )
    else:
        config = Config(
            args.adapter, args.broker, args.messages, workers=args.workers, seed=args.seed
        )
    if config.broker not in BROKERS[args.adapter]:
        parser.error(f"{args.adapter} runs on {', '.join(BROKERS[args.adapter])}")
    folder = Path(tempfile.mkdtemp(prefix="inbox-chaos-"))
    what = args.topology or "chaos"
    print(f"{what} {args.adapter}/{config.broker}, {args.messages} messages; logs in {folder}")
    ok = False
    try:
        with topologies.run_database(args.topology or "", args.adapter) as (url, admin_url):
            report = run(config, url, folder, admin_url=admin_url)
        print(report.summary())
        for problem in report.problems:
            print(f"  problem: {problem}")
        ok = not report.problems
        growth = report.rss_growth
        if args.messages >= LONG_RUN:
            if growth is None:
                print("  problem: the never-killed worker's memory could not be followed")
                ok = False
            elif growth >= RSS_LIMIT:
                print(f"  problem: RSS grew {growth:.1%} over the second half")
                ok = False
    finally:
        if ok and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
