"""constraints.txt pins the environment the project is tested in (scripts/bootstrap installs
through it): it must cover everything ``.[dev]`` installs, this environment must be the one
it pins, and the library's floors for the frameworks it adapts are the versions it pins
(the floors are what the suite runs on, not older releases nobody tests).

The library's own dependencies stay ranges in pyproject.toml; scripts/constraints
regenerates the file.
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# The floors that are the pinned versions: what the adapters and the storage build on.
FLOORS_ARE_PINS = ("dramatiq", "faststream", "sqlalchemy")


def pins() -> dict[str, Version]:
    pinned = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        pin = line.split("#", 1)[0].strip()
        if pin:
            name, version = pin.split("==")
            pinned[canonicalize_name(name)] = Version(version)
    return pinned


def installed_by(requirement: str) -> dict[str, Version]:
    """Every distribution ``pip install requirement`` brings here, with its version: the
    requirement's dependencies followed through their extras and markers."""
    found: dict[str, Version] = {}
    pending = [Requirement(requirement)]
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        wanted = pending.pop()
        name = canonicalize_name(wanted.name)
        key = (name, frozenset(wanted.extras))
        if key in seen:
            continue
        seen.add(key)
        distribution = metadata.distribution(name)
        found[name] = Version(distribution.version)
        for text in distribution.requires or []:
            needed = Requirement(text)
            extras = wanted.extras or {""}
            if needed.marker is None or any(
                needed.marker.evaluate({**default_environment(), "extra": extra})
                for extra in extras
            ):
                pending.append(needed)
    return found


def test_constraints__pin_everything_the_dev_extra_installs_at_the_version_installed():
    pinned = pins()
    installed = installed_by("inbox-middleware[dev]")
    installed.pop("inbox-middleware")
    missing = sorted(set(installed) - set(pinned))
    assert missing == [], f"not in constraints.txt (run scripts/constraints): {missing}"
    stale = {
        name: (str(version), str(pinned[name]))
        for name, version in installed.items()
        if version != pinned[name]
    }
    assert stale == {}, f"installed, pinned (run scripts/bootstrap dev): {stale}"


def test_constraints__pin_the_build_backend_and_satisfy_the_library_ranges():
    pinned = pins()
    assert "hatchling" in pinned, "the wheel's build backend is pinned too"
    declared = list(PROJECT["dependencies"])
    for extra in PROJECT["optional-dependencies"].values():
        declared += extra
    for text in declared:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "inbox-middleware":
            continue
        assert name in pinned, f"{name} is a dependency and is not pinned"
        assert requirement.specifier.contains(pinned[name]), (text, str(pinned[name]))


def test_constraints__the_frameworks_floors_are_the_tested_versions():
    pinned = pins()
    floors: dict[str, set[Version]] = {}
    declared = list(PROJECT["dependencies"])
    for extra in PROJECT["optional-dependencies"].values():
        declared += extra
    for text in declared:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                floors.setdefault(name, set()).add(Version(spec.version))
    for name in FLOORS_ARE_PINS:
        assert floors[name] == {pinned[name]}, (
            f"{name}: floors {sorted(map(str, floors[name]))}, tested {pinned[name]}: "
            "the floor is the version the suite runs on"
        )
