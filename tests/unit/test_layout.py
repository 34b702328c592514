"""The house's floors hold: the core imports no framework, an import points only down, and
no modules import each other in a circle (the import-linter contracts in pyproject.toml;
``scripts/house`` measures the same graph)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from importlinter import configuration
from importlinter.application.use_cases import lint_imports

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "inbox_middleware"
# What may import a framework: the adapters, the command line, the test tools.
NOT_CORE = {"dramatiq", "faststream", "cli", "testing", "contract"}


def contracts() -> dict[str, dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["id"]: contract for contract in config["contracts"]}


def test_layout__contracts_are_kept(capsys):
    configuration.configure()  # what the lint-imports command does first
    kept = lint_imports(str(ROOT / "pyproject.toml"), cache_dir=None, no_logo=True)
    assert kept, capsys.readouterr().out


def test_layout__every_module_outside_the_adapters_is_core():
    # A new module is in the core, and so under the no-framework contract, unless it is
    # an adapter or a test tool.
    modules = {path.stem for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    core = {f"inbox_middleware.{name}" for name in (modules | packages) - NOT_CORE}
    assert set(contracts()["core"]["source_modules"]) == core  # type: ignore[arg-type]


def test_layout__every_module_is_on_a_floor():
    floors = {
        name.strip()
        for layer in contracts()["floors"]["layers"]  # type: ignore[attr-defined]
        for name in layer.replace("|", ":").split(":")
    }
    modules = {path.stem for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert {f"inbox_middleware.{name}" for name in modules | packages} == floors
