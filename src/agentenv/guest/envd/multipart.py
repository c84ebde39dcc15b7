"""A streaming multipart/form-data parser that keeps each part's raw filename.

The E2B SDKs put the full target path in `filename` ("/home/user/a.txt"); general-purpose parsers
tend to cut it down to a base name, so envd reads the headers itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

MAX_HEADER_BYTES = 16 * 1024


class MultipartError(ValueError):
    pass


@dataclass
class PartHeaders:
    name: str | None
    filename: str | None
    content_type: str | None


@dataclass
class PartStart:
    headers: PartHeaders


@dataclass
class PartData:
    data: bytes


@dataclass
class PartEnd:
    pass


Event = PartStart | PartData | PartEnd

_PARAM = re.compile(r';\s*([A-Za-z0-9_*.-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


def boundary_of(content_type: str) -> bytes:
    for match in _PARAM.finditer(content_type):
        if match.group(1).lower() == "boundary":
            value = match.group(2).strip()
            if value.startswith('"'):
                value = value[1:-1]
            if value:
                return value.encode("latin-1")
    raise MultipartError("multipart body without a boundary")


def parse_disposition(value: str) -> tuple[str | None, str | None]:
    name = filename = None
    for match in _PARAM.finditer(value):
        key = match.group(1).lower()
        raw = match.group(2).strip()
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        if key == "name":
            name = raw
        elif key == "filename":
            filename = raw
    return name, filename


class MultipartParser:
    """Feed body chunks; get PartStart / PartData / PartEnd events back, in order."""

    def __init__(self, boundary: bytes) -> None:
        self._delimiter = b"\r\n--" + boundary
        self._buffer = bytearray(b"\r\n")  # the first delimiter has no preceding CRLF
        self._state = "preamble"  # preamble | headers | data | epilogue
        self.finished = False

    def feed(self, chunk: bytes) -> Iterator[Event]:
        self._buffer += chunk
        while True:
            if self._state == "preamble":
                index = self._buffer.find(self._delimiter)
                if index < 0:
                    # Keep only what could still be the start of the delimiter.
                    del self._buffer[: max(0, len(self._buffer) - len(self._delimiter))]
                    return
                after = index + len(self._delimiter)
                if len(self._buffer) < after + 2:
                    return
                tail = bytes(self._buffer[after : after + 2])
                if tail == b"--":
                    self._state, self.finished = "epilogue", True
                    return
                del self._buffer[: after]
                self._state = "headers"
            elif self._state == "headers":
                end = self._buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buffer) > MAX_HEADER_BYTES:
                        raise MultipartError("multipart part headers are too long")
                    return
                block = bytes(self._buffer[:end]).decode("utf-8", errors="replace")
                del self._buffer[: end + 4]
                yield PartStart(self._parse_headers(block))
                self._state = "data"
            elif self._state == "data":
                index = self._buffer.find(self._delimiter)
                if index < 0:
                    keep = len(self._delimiter) + 1
                    if len(self._buffer) > keep:
                        cut = len(self._buffer) - keep
                        yield PartData(bytes(self._buffer[:cut]))
                        del self._buffer[:cut]
                    return
                after = index + len(self._delimiter)
                if len(self._buffer) < after + 2:
                    if index:
                        yield PartData(bytes(self._buffer[:index]))
                        del self._buffer[:index]
                    return
                if index:
                    yield PartData(bytes(self._buffer[:index]))
                yield PartEnd()
                tail = bytes(self._buffer[after : after + 2])
                if tail == b"--":
                    self._state, self.finished = "epilogue", True
                    self._buffer.clear()
                    return
                del self._buffer[:after]
                self._state = "headers"
            else:
                self._buffer.clear()
                return

    @staticmethod
    def _parse_headers(block: str) -> PartHeaders:
        name = filename = content_type = None
        # The block starts with the CRLF that ends the delimiter line (plus any transport padding).
        for line in block.split("\r\n"):
            key, sep, value = line.partition(":")
            if not sep:
                continue
            key = key.strip().lower()
            if key == "content-disposition":
                name, filename = parse_disposition(value)
            elif key == "content-type":
                content_type = value.strip()
        return PartHeaders(name, filename, content_type)
