"""The ``inbox-middleware`` command line (`main`, run by `run`).

One private module per command group: ``_app`` (the group `main`, ``migrate``, ``check``),
``_status`` (``status``, ``explain``, ``metrics serve``), ``_repair`` (``quarantine``,
``poison``), ``_retention`` (``retention``, ``purge``), ``_outbox``; ``_output`` renders
tables and JSON. They share ``_options`` (the database options, the naming, the
connection), the only module of the package that code outside it may import. Importing
this package imports no command; the console script is ``inbox_middleware.cli:run``.
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
