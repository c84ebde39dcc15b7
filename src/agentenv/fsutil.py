"""Crash-safe file writes, shared by every record the node and blockd read back after a crash.

`atomic_write` leaves either the old file or the complete new one, never a torn or empty file:
the data goes to a temporary file in the same directory, is fsynced, renamed over the target,
and the directory is fsynced so that the rename itself survives a power loss.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path | str, data: bytes | str, *, mode: int = 0o600) -> None:
    """Replace `path` with `data` atomically and durably (temp file, fsync, rename, fsync dir)."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    # pid in the name: two processes saving the same record never share a temporary file.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path | str, obj: Any, *, indent: int | None = None,
                      mode: int = 0o600) -> None:
    atomic_write(path, json.dumps(obj, indent=indent), mode=mode)
