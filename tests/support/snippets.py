"""The docs' snippets, loaded by the tests that run them (``docs/snippets`` is no package:
each is a file a page includes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["SNIPPETS", "load_snippet"]

SNIPPETS = Path(__file__).resolve().parents[2] / "docs" / "snippets"


def load_snippet(name: str) -> ModuleType:
    """The snippet ``docs/snippets/<name>.py``, run as a module of its own."""
    spec = importlib.util.spec_from_file_location(f"docs_snippet_{name}", SNIPPETS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module
