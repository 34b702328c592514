"""The command line is a package at the top of the house: nothing below imports it, and
code outside it may import only its options module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "inbox_middleware"


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, deferred imports too, as absolute names."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module[:-9]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            prefix = ".".join(base) if node.level else ""
            target = ".".join(part for part in (prefix, node.module or "") if part)
            names |= {f"{target}.{alias.name}" for alias in node.names} | {target}
    return names


def test_only_the_options_module_of_the_cli_is_imported_from_outside_it():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        if "cli" in path.relative_to(PACKAGE).parts:
            continue
        cli = {
            name
            for name in imported(path)
            if name == "inbox_middleware.cli" or name.startswith("inbox_middleware.cli.")
        }
        options = "inbox_middleware.cli._options"
        if any(name != options and not name.startswith(options + ".") for name in cli):
            offenders[str(path.relative_to(PACKAGE))] = sorted(cli)
    assert offenders == {}
