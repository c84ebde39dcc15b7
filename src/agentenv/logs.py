"""Structured logging: one JSON object per line on stderr, for every server in the project."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_RESERVED = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup(level: str = "info") -> None:
    """Send every logger's records to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.Formatter.converter = time.gmtime


class Sampled:
    """Which of a run of like events to log: the first, then every `every`th (with the count in
    the line). What a stranger can cause as fast as it can send is counted, never written once
    per event: a flood of refusals is not a flood of log lines."""

    def __init__(self, every: int = 1000) -> None:
        self.every = every
        self.count = 0

    def tick(self) -> bool:
        self.count += 1
        return self.count == 1 or self.count % self.every == 0
