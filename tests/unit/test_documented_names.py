"""Every name the documentation imports or renders imports from where it says, without a
deprecation warning (the suite turns warnings into errors): the reference's ``:::``
lines, and the imports of every page, snippet, example and README. Parsed from the files,
so a page that names a moved module fails here."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted(
    [
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("docs/**/*.py"),
        *ROOT.glob("examples/**/*.py"),
        ROOT / "README.md",
        ROOT / "README-pypi.md",
    ]
)
RENDERED = re.compile(r"^::: (inbox_middleware[\w.]*)", re.MULTILINE)
FROM_IMPORT = re.compile(r"^\s*from (inbox_middleware[\w.]*) import \(?([\w, \n]+?)\)?$", re.M)
IMPORT = re.compile(r"^\s*import (inbox_middleware[\w.]*)", re.MULTILINE)


def documented() -> set[tuple[str, str]]:
    """(module, name) pairs; an empty name imports the module alone."""
    found: set[tuple[str, str]] = set()
    for path in DOCUMENTS:
        text = path.read_text()
        for dotted in RENDERED.findall(text):
            found.add(("", dotted))
        for module, names in FROM_IMPORT.findall(text):
            for name in names.replace("\n", " ").split(","):
                if name.strip():
                    found.add((module, name.split(" as ")[0].strip()))
        for module in IMPORT.findall(text):
            found.add((module, ""))
    return found


def resolve(dotted: str) -> object:
    """The object a dotted name renders: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(dotted)


def test_documented_names__the_pages_name_many():
    names = documented()
    assert len(names) > 100
    assert ("", "inbox_middleware.Inbox") in names


@pytest.mark.parametrize(("module", "name"), sorted(documented()))
def test_documented_names__import_without_a_deprecation(module, name):
    if not module:
        resolve(name)
    elif not name:
        importlib.import_module(module)
    else:
        assert getattr(importlib.import_module(module), name) is not None
