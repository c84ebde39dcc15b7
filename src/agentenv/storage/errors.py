"""Errors raised by the overlaybd storage engine.

Every problem with bytes on disk (a layer, ZFile, tar wrapper, writable upper or image config
that is truncated, corrupt or inconsistent) raises exactly one type, `LayerFormatError`, whose
message names the file, the byte offset and the problem. Misuse of an image (writing a
read-only image, reading past the end) raises `ImageUsageError`.
"""

from __future__ import annotations

from pathlib import Path

from agentenv.errors import AgentEnvError


class StorageError(AgentEnvError):
    """Base class of every storage error."""


class LayerFormatError(StorageError):
    """A layer, upper or image config on disk is malformed, truncated or inconsistent."""

    def __init__(self, path: Path | str, offset: int | None, problem: str) -> None:
        self.path = str(path)
        self.offset = offset
        self.problem = problem
        where = f" at offset {offset}" if offset is not None else ""
        super().__init__(f"{self.path}{where}: {problem}")


class ImageUsageError(StorageError):
    """An operation the image cannot do: write to a read-only image, I/O past the end, ..."""
