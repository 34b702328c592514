"""Deprecated import paths: each old module of a documented path is an alias that
warns once, then is the module it moved to."""

from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["moved", "warn_moved"]


def warn_moved(name: str, public: str, stacklevel: int = 3) -> None:
    """Warn that the module ``name`` moved; ``public`` is where its names are imported now."""
    warnings.warn(
        f"{name} is deprecated and goes in the next release: import from {public}",
        DeprecationWarning,
        # The import machinery's frames are skipped: the level above the alias module's
        # body is the importer.
        stacklevel=stacklevel,
    )


def moved(name: str, target: str, public: str) -> None:
    """Make the module ``name`` an alias of ``target`` (the same module object)."""
    warn_moved(name, public, stacklevel=4)
    sys.modules[name] = importlib.import_module(target)
