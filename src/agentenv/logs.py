"""Structured logging: one JSON object per line on stderr, for every server in the project."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
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


class _Window:
    __slots__ = ("start", "suppressed", "written")

    def __init__(self, start: float) -> None:
        self.start = start
        self.written = 0
        self.suppressed: Counter[str] = Counter()


class PerKeyLimit:
    """Log lines a guest (or any client) can cause at will, limited per key (its slot's
    address): the first `burst` lines of each `window` seconds are written whole, the rest only
    counted by kind and written as one summary line (`log_suppressed`, counts per kind) when
    the window is over: at flush() (called by a periodic task, and by log() once a window),
    or at the key's next line. Counters (metrics) still count every event: this only bounds
    what reaches the log file."""

    def __init__(self, logger: logging.Logger, burst: int = 20, window: float = 60.0,
                 max_keys: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.burst, self.window = logger, burst, window
        self.max_keys, self.clock = max_keys, clock
        self._windows: dict[str, _Window] = {}
        self._flushed = clock()

    def log(self, key: str, kind: str, level: int, msg: str, extra: dict[str, Any]) -> None:
        """`msg` with `extra`, unless `key` wrote `burst` lines in this window already."""
        now = self.clock()
        if now - self._flushed >= self.window:  # (the summaries of keys gone quiet)
            self.flush()
        if key not in self._windows and len(self._windows) >= self.max_keys:
            key = "*"  # (so many keys at once: the new ones share a window)
        window = self._windows.get(key)
        if window is not None and now - window.start >= self.window:
            self._summarize(key, self._windows.pop(key))
            window = None
        if window is None:
            window = self._windows[key] = _Window(now)
        if window.written < self.burst:
            window.written += 1
            self.logger.log(level, msg, extra=extra)
        else:
            window.suppressed[kind] += 1

    def flush(self, everything: bool = False) -> None:
        """Write the summaries of the windows that are over (every window's, at a stop), and
        forget them."""
        now = self._flushed = self.clock()
        for key in [k for k, w in self._windows.items()
                    if everything or now - w.start >= self.window]:
            self._summarize(key, self._windows.pop(key))

    def _summarize(self, key: str, window: _Window) -> None:
        if window.suppressed:
            self.logger.warning("log lines suppressed", extra={
                "event": "log_suppressed", "key": key, "suppressed": dict(window.suppressed),
                "window_s": self.window})


def trim_log(log: Path, max_bytes: int) -> bool:
    """Keep a log that a process appends to (O_APPEND) and its rotated tail `<name>.1` within
    `max_bytes`: once the log holds more than half of it, its last half moves to `<name>.1` and
    the log is emptied; the writer appends on from the new end. Lines written between the
    copy and the truncation are lost (a log, not a record). True if it was rotated; a missing
    log is not an error."""
    keep = max(max_bytes // 2, 1)
    try:
        with open(log, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= keep:
                return False
            f.seek(size - keep)
            tail = f.read(keep)
            rotated = log.with_name(log.name + ".1")
            partial = log.with_name(log.name + ".1.new")
            partial.write_bytes(tail)
            os.replace(partial, rotated)
            f.truncate(0)
    except FileNotFoundError:
        return False
    return True
