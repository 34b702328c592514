"""Structured logs: every inbox decision is a log record whose ``inbox_*`` attributes carry
the event and the identity; this formatter writes them as one JSON object per line."""

from __future__ import annotations

import json
import logging


# --8<-- [start:formatter]
class InboxJsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in vars(record).items() if k.startswith("inbox_")}
        line = {"level": record.levelname, "message": record.getMessage(), **fields}
        return json.dumps(line, default=str)


def log_inbox_decisions_as_json(handler: logging.Handler, level: int = logging.DEBUG) -> None:
    handler.setFormatter(InboxJsonFormatter())
    logger = logging.getLogger("inbox_middleware")
    logger.addHandler(handler)
    logger.setLevel(level)  # DEBUG includes "claimed" and "committed"


# --8<-- [end:formatter]
