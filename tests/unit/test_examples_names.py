"""The examples' folders hold test modules without a package, so pytest puts each folder on
``sys.path``: an example named like an installed package (``nats.py``) would be imported in
its place by every test that comes after it."""

from __future__ import annotations

from importlib.metadata import packages_distributions
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_examples__no_module_is_named_like_an_installed_package() -> None:
    installed = set(packages_distributions())
    modules = {path.stem for path in EXAMPLES.rglob("*.py")}
    assert modules, "no example found"
    assert sorted(modules & installed) == []
