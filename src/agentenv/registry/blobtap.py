"""Read a blob while it is still downloading, so conversion overlaps the download.

The downloader writes the blob to a file and reports each chunk (`advance`); a `TapReader`
reads that file behind it, waiting for more bytes until the download is finished. Whatever is
read this way is unverified until the download ends: a download that fails (a digest that does
not match, a dropped connection) makes the reader raise at that point, and callers must not
publish anything built from the stream before the download has succeeded.
"""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

from agentenv.registry.errors import PullError


class BlobTap:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.path: Path | None = None
        self._fd: int | None = None  # opened at start: the file is renamed when it completes
        self.written = 0
        self.done = False
        self.error: BaseException | None = None

    def start(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        with self._cond:
            self.path, self._fd = path, fd
            self._cond.notify_all()

    def advance(self, n: int) -> None:
        with self._cond:
            self.written += n
            self._cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.done = True
            self.error = error
            self._cond.notify_all()

    def open(self) -> TapReader:
        with self._cond:
            while self.path is None and not self.done:
                self._cond.wait()
            if self._fd is None:
                raise self.error or PullError("the blob download ended before it began")
            return TapReader(self, os.dup(self._fd))

    def close(self) -> None:
        with self._cond:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class TapReader(io.RawIOBase):
    def __init__(self, tap: BlobTap, fd: int) -> None:
        self.tap = tap
        self.fd = fd
        self.position = 0

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a growing blob has no usable file offset")

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        tap = self.tap
        with tap._cond:
            while self.position >= tap.written and not tap.done:
                tap._cond.wait()
            available = tap.written - self.position
            if available <= 0 and tap.error is not None:
                raise tap.error
        if available <= 0:
            return 0
        data = os.pread(self.fd, min(len(buffer), available), self.position)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()
