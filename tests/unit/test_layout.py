"""The four layers hold: the pure core imports no framework and no database driver, an
import points only down the layers, neither adapter imports the other, and no modules
import each other in a circle (the import-linter contracts in pyproject.toml;
``scripts/house`` and ``python -m bench.house`` measure the same graph)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from importlinter import configuration
from importlinter.application.use_cases import lint_imports

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "inbox_middleware"
LAYERS = 4
FRAMEWORKS_AND_DRIVERS = {"dramatiq", "faststream", "sqlalchemy", "psycopg", "asyncpg"}


def contracts() -> dict[str, dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["id"]: contract for contract in config["contracts"]}


def top_level_modules() -> set[str]:
    modules = {path.stem for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    return {f"inbox_middleware.{name}" for name in modules | packages}


def test_layout__contracts_are_kept(capsys):
    configuration.configure()  # what the lint-imports command does first
    kept = lint_imports(str(ROOT / "pyproject.toml"), cache_dir=None, no_logo=True)
    assert kept, capsys.readouterr().out


def test_layout__the_core_is_one_package_that_imports_no_framework_and_no_driver():
    core = contracts()["core"]
    assert core["source_modules"] == ["inbox_middleware._core"]
    assert set(core["forbidden_modules"]) == FRAMEWORKS_AND_DRIVERS  # type: ignore[arg-type]
    assert "ignore_imports" not in core


def test_layout__four_layers_and_every_module_on_one():
    layers = contracts()["floors"]["layers"]
    assert len(layers) == LAYERS  # type: ignore[arg-type]
    on_a_layer = [
        name.strip()
        for layer in layers  # type: ignore[attr-defined]
        for name in layer.replace("|", ":").split(":")
    ]
    assert len(on_a_layer) == len(set(on_a_layer))
    assert set(on_a_layer) == top_level_modules()
