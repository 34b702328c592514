"""Import an optional integration, or fail saying which extra installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str, *alternatives: str) -> ModuleType:
    """``module``, or an ImportError whose hint can be pasted into any shell (quoted)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = f"run `pip install 'inbox-middleware[{extra}]'`"
        if alternatives:
            hint += f" (or the extra of your broker: {', '.join(alternatives)})"
        raise ImportError(f"{module} is not installed; {hint}") from exc
