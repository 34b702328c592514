"""Import an optional integration, or fail saying which extra installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module} is not installed; run `pip install inbox-middleware[{extra}]`"
        ) from exc
