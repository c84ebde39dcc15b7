"""JSON-lines logging on stderr (envd cannot use the host's agentenv.logs)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

_STANDARD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        # "ts" as round(created, 6) would print, but without float rounding and repr: after a
        # snapshot restore the first log line pays for every code path it takes (QEMU's
        # translation cache starts empty), and those are long ones.
        micros = int(record.created * 1_000_000 + 0.5)
        seconds, fraction = divmod(micros, 1_000_000)
        ts = f"{seconds}.{fraction:06d}".rstrip("0")
        if ts.endswith("."):
            ts += "0"
        return '{"ts": ' + ts + ", " + json.dumps(line, default=str)[1:]


def setup(level: str) -> None:
    # envd's lines carry none of these: skip computing them for every record (the caller's
    # frame walk, thread and process names).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
