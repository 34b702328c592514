"""The ``inbox-middleware`` command line (`main`, run by `run`).

One module per command group: ``app`` (the group `main`, ``migrate``, ``check``), ``status``
(``status``, ``explain``, ``metrics serve``), ``repair`` (``quarantine``, ``poison``),
``retention`` (``retention``, ``purge``), ``outbox``; ``output`` renders tables and JSON.
They share `options` (the database options, the naming, the connection), the only module
of the package that code outside it may import. Importing this package imports no command.
"""

from typing import TYPE_CHECKING, Any

__all__ = ["main", "run"]

if TYPE_CHECKING:
    from ._app import main, run


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import _app as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
