"""One schedule's verdict, its replay and its shrinking: what `__main__` and the CI test
share."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .check import Finding, check
from .run import HarnessTrouble, History, ensure_services, exclusive, run_schedule
from .schedule import Schedule, draw

__all__ = ["Verdict", "explore", "replay_command", "select"]

SLOWNESS = {"stuck", "left-in-broker", "unsettled", "lost-or-left"}
"""Findings a starved machine can cause by itself; any other is a finding whatever the
load."""


@dataclass
class Verdict:
    schedule: Schedule
    outcome: str
    """ok, finding, refused (a refused start-up: correct), harness (the explorer's trouble)"""
    findings: list[Finding] = field(default_factory=list)
    trouble: str = ""
    seconds: float = 0.0
    folder: Path | None = None
    excerpt: str = ""
    history: History | None = None

    def line(self) -> str:
        head = f"seed {self.schedule.seed} [{self.outcome.upper()}] {self.seconds:.0f}s"
        if self.history is not None:
            h = self.history
            head += (
                f" | {self.schedule.config.target}: sent {len(h.sent)}, applied "
                f"{len({e[0] for e in h.effects})}, claims {len(h.claims)}, poison "
                f"{len(h.poison)}, quarantine {len(h.quarantine)} rows / "
                f"{len(h.destinations.get('quarantine', []))} messages, dead letters "
                f"{len(h.destinations.get('dead-letter', []))}, worker restarts "
                f"{len(h.worker_exits)}, settled in {h.settle_seconds:.0f}s"
            )
            if h.placements:
                head += " | applied by database " + "/".join(str(len(p)) for p in h.placements)
            if h.extra.get("moved") is not None:  # operator move
                head += " | t1 moved to d0" if h.extra["moved"] else " | t1 NOT moved (events)"
            if h.faults_missed:
                head += f" | faults not as scheduled: {', '.join(h.faults_missed)}"
            seen = _workload_summary(h.extra)
            if seen:
                head += f" | {seen}"
            if h.extra.get("not_available"):
                head += f" | not available: {', '.join(h.extra['not_available'])}"
        if self.outcome == "finding":
            return head + " | " + " | ".join(map(str, self.findings))
        if self.outcome == "harness":
            return head + f" | harness trouble, not a finding: {self.trouble}"
        return head


def _workload_summary(extra: dict[str, Any]) -> str:
    """What the workload axes' extras did, in a few numbers."""
    parts = []
    if extra.get("downstream"):
        parts.append(f"outputs applied downstream {len(extra['downstream'])}")
    if "outbox" in extra:
        received = extra.get("received", [])
        deliveries = sum(d for *_, d in received)
        parts.append(
            f"outbox effects {len(extra['outbox'])}, received {len(received)} "
            f"in {deliveries} deliveries"
        )
    if extra.get("decisions"):
        done = [d for d in extra["decisions"] if d[4] == 0]
        parts.append(f"operator decisions {len(done)}/{len(extra['decisions'])}")
    if extra.get("purges"):
        parts.append(f"purges {len(extra['purges'])}")
    return ", ".join(parts)


def select(seed: int, faults: list[int] | None = None, intents: int | None = None) -> Schedule:
    """The seed's schedule, with only the faults at ``faults`` (indices) and the first
    ``intents`` intents, as a shrunk schedule's replay names them."""
    schedule = draw(seed)
    kept = None if faults is None else [f for k, f in enumerate(schedule.faults) if k in faults]
    keys = None if intents is None else {i.key for i in schedule.intents[:intents]}
    if kept is None and keys is None:
        return schedule
    return schedule.without(faults=kept, keys=keys)


def replay_command(
    schedule: Schedule, repeat: int = 5, faults: list[int] | None = None, intents: int | None = None
) -> str:
    command = f"python -m tests.explore --seed {schedule.seed} --repeat {repeat}"
    if faults is not None:
        command += f" --faults {','.join(map(str, faults)) or 'none'}"
    if intents is not None:
        command += f" --intents {intents}"
    return command


_INTERESTING = re.compile(r"error|exception|traceback|refus|lost|critical|warning", re.IGNORECASE)


def _excerpt(folder: Path, limit: int = 40) -> str:
    events = folder / "events.txt"
    lines: list[str] = []
    if events.exists():
        lines += events.read_text(errors="replace").split("\n\n")[0].splitlines()
    for log in sorted(folder.glob("w*.log")):
        hits = [
            f"{log.name}: {line}"
            for line in log.read_text(errors="replace").splitlines()
            if _INTERESTING.search(line)
        ]
        lines += hits[:8]
    return "\n".join(lines[:limit])


def explore(schedule: Schedule, keep: bool = False, log: Any = print) -> Verdict:
    """Run ``schedule`` once on the explorer's servers, and judge its history."""
    folder = Path(tempfile.mkdtemp(prefix=f"inbox-explore-{schedule.seed}-"))
    verdict: Verdict
    with exclusive():
        started = time.monotonic()  # the wait for another schedule's end not counted
        try:
            ensure_services()
            history = run_schedule(schedule, folder, log)
        except HarnessTrouble as exc:
            verdict = Verdict(schedule, "harness", trouble=str(exc))
        else:
            findings = check(history)
            if findings and history.refused and not history.effects and not history.claims:
                verdict = Verdict(schedule, "refused", history=history)
            elif (
                findings
                and not history.settled
                and history.load > 6
                and all(f.kind in SLOWNESS for f in findings)
            ):
                verdict = Verdict(
                    schedule,
                    "harness",
                    findings=findings,
                    history=history,
                    trouble=f"not settled, the machine's load at {history.load:.1f} (starved?)",
                )
            else:
                verdict = Verdict(
                    schedule, "finding" if findings else "ok", findings, history=history
                )
    verdict.seconds = time.monotonic() - started
    verdict.folder = folder
    if verdict.outcome != "ok":
        verdict.excerpt = _excerpt(folder)
    if verdict.outcome == "ok" and not keep:
        shutil.rmtree(folder, ignore_errors=True)
        verdict.folder = None
    return verdict


def shrink(schedule: Schedule, log: Any = print) -> tuple[list[int], int]:
    """Drop faults one at a time, then halve the intents, keeping each cut that still
    fails (one run each: a cut is kept only when the smaller schedule failed); the fault
    indices and the intent count left."""
    faults = list(range(len(schedule.faults)))
    intents = len(schedule.intents)
    for index in list(faults):
        trial = [f for f in faults if f != index]
        verdict = explore(select(schedule.seed, trial, intents))
        log(f"  shrink: without fault {index}: {verdict.outcome}")
        if verdict.outcome == "finding":
            faults = trial
    while intents > 4:
        half = intents // 2
        verdict = explore(select(schedule.seed, faults, half))
        log(f"  shrink: first {half} intents: {verdict.outcome}")
        if verdict.outcome != "finding":
            break
        intents = half
    return faults, intents
