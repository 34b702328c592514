"""Figures of the house: its layers and import contract, its public surface, its longest
functions and its size.

    python -m bench.house

Printed: the layers of the import contract in pyproject.toml (``[tool.importlinter]``)
and the other contracts; the public modules (no component of the dotted name starts
with ``_``) and the names their ``__all__`` exports; every module that has an ``__all__``;
the deprecated aliases (modules that warn when imported) apart;
the ten longest functions (lines, from ``def`` to the last line); the library's lines
(every line of ``src/inbox_middleware``, and those that are neither blank nor a comment).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src"
PACKAGE = SOURCE / "inbox_middleware"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def exported(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                value = node.value
                if isinstance(value, ast.List | ast.Tuple):
                    return [e.value for e in value.elts if isinstance(e, ast.Constant)]
    return None


def deprecated(tree: ast.Module) -> bool:
    """Is the module a deprecated alias (it calls ``moved`` or ``warn_moved`` when imported)?"""
    return any(
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id in {"moved", "warn_moved"}
        for node in tree.body
    )


def main() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = config["contracts"]
    print("import contract")
    for contract in contracts:
        print(f"  {contract['id']:<12} {contract['type']:<16} {contract['name']}")
        if contract["type"] == "layers":
            for layer in contract["layers"]:
                print(f"  {'':<12} layer  {layer}")
            print(f"  {'':<12} layers {len(contract['layers'])}")
        if "source_modules" in contract:
            print(f"  {'':<12} source modules listed {len(contract['source_modules'])}")

    files = sorted(PACKAGE.rglob("*.py"))
    modules = public = names = public_names = with_all = aliases = 0
    functions: list[tuple[int, str]] = []
    lines = code = 0
    for path in files:
        text = path.read_text()
        tree = ast.parse(text)
        name = module_name(path)
        modules += 1
        is_public = not any(part.startswith("_") for part in name.split("."))
        is_alias = is_public and deprecated(tree)
        aliases += is_alias
        is_public = is_public and not is_alias
        public += is_public
        names_here = exported(tree)
        if names_here is not None and names_here:
            with_all += 1
            names += len(names_here)
            if is_public:
                public_names += len(names_here)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                where = f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"
                functions.append((length, where))
        for line in text.splitlines():
            lines += 1
            stripped = line.strip()
            code += bool(stripped) and not stripped.startswith("#")

    print()
    print(f"modules                      {modules}")
    print(f"public modules               {public} (and {aliases} deprecated aliases)")
    print(f"modules exporting names      {with_all} ({names} names)")
    print(f"names public modules export  {public_names}")
    print()
    print("longest functions (lines)")
    for length, where in sorted(functions, reverse=True)[:10]:
        print(f"  {length:>4}  {where}")
    print()
    print(f"library lines                {lines} ({code} neither blank nor comment)")


if __name__ == "__main__":
    main()
