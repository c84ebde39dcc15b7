"""The server name (SNI) of a TLS ClientHello, read from the first bytes a client sends.

Only what the egress proxy needs: it never decrypts and never answers; it reads the handshake
records (a ClientHello may span several records), finds the server_name extension (RFC 6066,
section 3) and returns the host name, or None when the hello names none (a client connecting by
address). Every length is checked against what is there: garbage raises NotClientHello, a
prefix of a valid hello raises Incomplete.
"""

from __future__ import annotations

import re

MAX_HELLO = 64 << 10  # bytes of handshake records the proxy waits for, at most
_RECORD_HANDSHAKE = 0x16
_HANDSHAKE_CLIENT_HELLO = 0x01
_EXT_SERVER_NAME = 0x0000
_NAME_TYPE_HOST = 0x00
# What a DNS host name may hold (RFC 6066 forbids a trailing dot; tolerated, the policy strips it).
_HOST_NAME = re.compile(rb"^[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})$")


class Incomplete(Exception):
    """The bytes so far are a valid prefix of a ClientHello; more are needed."""


class NotClientHello(ValueError):
    """The bytes are not (a prefix of) a well-formed TLS ClientHello; the message says why."""


def looks_like_tls(data: bytes) -> bool:
    """First byte a handshake record and a TLS-ish major version: worth parsing as TLS."""
    return len(data) >= 1 and data[0] == _RECORD_HANDSHAKE and (len(data) < 2 or data[1] == 3)


def _handshake_bytes(data: bytes) -> bytes:
    """The handshake message bytes gathered from consecutive handshake records, up to the end
    of the ClientHello (raises Incomplete when its end has not arrived)."""
    out = bytearray()
    pos = 0
    needed: int | None = None
    while needed is None or len(out) < needed:
        if len(data) - pos < 5:
            raise Incomplete
        ctype, major, length = data[pos], data[pos + 1], int.from_bytes(data[pos + 3:pos + 5])
        if ctype != _RECORD_HANDSHAKE:
            raise NotClientHello(f"TLS record type {ctype}, not handshake")
        if major != 3:
            raise NotClientHello(f"TLS record version {major}.{data[pos + 2]}")
        if length == 0 or length > 16384 + 2048:
            raise NotClientHello(f"TLS record length {length}")
        pos += 5
        chunk = data[pos:pos + length]
        out += chunk
        if len(out) >= 4 and needed is None:
            if out[0] != _HANDSHAKE_CLIENT_HELLO:
                raise NotClientHello(f"handshake type {out[0]}, not ClientHello")
            needed = 4 + int.from_bytes(out[1:4])
            if needed > MAX_HELLO:
                raise NotClientHello(f"ClientHello of {needed} bytes is too large")
        if len(chunk) < length:
            if needed is not None and len(out) >= needed:
                break
            raise Incomplete
        pos += length
    return bytes(out[:needed])


class _Reader:
    """Bounds-checked reads over one message; running off the end is a malformed hello."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.pos, self.what = data, 0, what

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise NotClientHello(f"{self.what} is truncated")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def int(self, n: int) -> int:
        return int.from_bytes(self.take(n))

    def vector(self, length_bytes: int) -> bytes:
        return self.take(self.int(length_bytes))

    @property
    def left(self) -> int:
        return len(self.data) - self.pos


def server_name(data: bytes) -> str | None:
    """The SNI host name (lower case) of the ClientHello at the start of `data`, or None when
    it has no server_name extension. Raises Incomplete or NotClientHello."""
    if not data:
        raise Incomplete
    if not looks_like_tls(data):
        raise NotClientHello("not a TLS handshake record")
    message = _handshake_bytes(data)
    hello = _Reader(message[4:], "ClientHello")
    version = hello.int(2)
    if version >> 8 != 3:
        raise NotClientHello(f"ClientHello version {version:#06x}")
    hello.take(32)  # random
    if len(hello.vector(1)) > 32:
        raise NotClientHello("session id longer than 32 bytes")
    suites = hello.vector(2)
    if not suites or len(suites) % 2:
        raise NotClientHello("bad cipher suite list")
    if not hello.vector(1):
        raise NotClientHello("empty compression method list")
    if hello.left == 0:
        return None  # no extensions at all (SSL 3.0 style)
    extensions = _Reader(hello.vector(2), "extensions")
    if hello.left:
        raise NotClientHello("bytes after the extensions")
    found: str | None = None
    seen: set[int] = set()
    while extensions.left:
        ext_type = extensions.int(2)
        body = extensions.vector(2)
        if ext_type in seen:
            raise NotClientHello(f"extension {ext_type} appears twice")
        seen.add(ext_type)
        if ext_type == _EXT_SERVER_NAME:
            found = _parse_server_name(body)
    return found


def _parse_server_name(body: bytes) -> str | None:
    ext = _Reader(body, "server_name extension")
    names = _Reader(ext.vector(2), "server_name list")
    if ext.left:
        raise NotClientHello("bytes after the server_name list")
    host: str | None = None
    while names.left:
        name_type = names.int(1)
        name = names.vector(2)
        if name_type != _NAME_TYPE_HOST:
            continue  # no other type is defined; skip what we cannot read
        if host is not None:
            raise NotClientHello("two host names in server_name")  # RFC 6066 allows one
        if not _HOST_NAME.match(name) or ".." in name.decode("ascii"):
            raise NotClientHello(f"server_name {name[:80]!r} is not a host name")
        host = name.decode("ascii").lower()
    return host
