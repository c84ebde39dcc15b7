"""HTTP/1.x request heads: the Host a client asks for, and a framer for a client's byte stream.

The egress proxy reads the Host of every request on a plain-HTTP connection (a keep-alive
connection can ask another host in its next request) and, for hosts with header `rules`, sets
their headers. It does not buffer bodies: `RequestStream` passes body bytes through as they
come and only holds back an incomplete head (at most MAX_HEAD bytes). Anything it cannot frame
without guessing (both Content-Length and Transfer-Encoding, two different Content-Lengths, a
folded header line, a malformed chunk) raises HttpError: the proxy then resets the connection
rather than let two parties disagree on where a request ends.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

MAX_HEAD = 64 << 10
_METHOD = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}$")
_VERSION = re.compile(rb"^HTTP/1\.[01]$")
_FIELD_NAME = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_HOST = re.compile(r"^[a-z0-9_]([a-z0-9_.-]{0,252})$")


class Incomplete(Exception):
    """A valid prefix of a request head; more bytes are needed."""


class NotHttp(ValueError):
    """The bytes do not start an HTTP/1.x request."""


class HttpError(ValueError):
    """An HTTP request the proxy will not pass on (the message says why)."""


@dataclass
class RequestHead:
    method: str
    target: str
    version: str
    lines: list[bytes]  # the header lines as sent, without CRLF
    headers: list[tuple[str, str]]  # (lower-case name, value stripped)
    length: int  # bytes of the head, final CRLFCRLF included
    request_line: bytes
    raw: bytes  # the head as sent

    def get_all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    def host(self) -> str | None:
        """The host the request is for: the authority of an absolute-form target, else the
        Host header (port dropped, lower case); None when neither names one. Raises HttpError
        for two Host headers or one that is not a host name."""
        hosts = self.get_all("host")
        if len(hosts) > 1:
            raise HttpError("two Host headers")
        lowered = self.target.lower()
        for scheme in ("http://", "https://"):
            if lowered.startswith(scheme):
                authority = self.target[len(scheme):].split("/", 1)[0].split("?", 1)[0]
                target_host = _host_of(authority.rsplit("@", 1)[-1])
                # A server may route by either: both must name the same host.
                if hosts and _host_of(hosts[0]) != target_host:
                    raise HttpError("the Host header and the request target name different hosts")
                return target_host
        return _host_of(hosts[0]) if hosts else None


def _host_of(authority: str) -> str | None:
    """The host of an authority (port dropped, lower case); None for an IPv6 literal or
    nothing; HttpError for what is not a host name."""
    host = authority.lower()
    if host.startswith("["):
        return None  # an IPv6 literal: no name to decide by
    host = host.rsplit(":", 1)[0] if ":" in host else host
    host = host.rstrip(".")
    if not host:
        return None
    if not _HOST.match(host) or ".." in host:
        raise HttpError(f"Host {authority[:80]!r} is not a host name")
    return host


def looks_like_http(data: bytes) -> bool:
    """The first bytes could begin a request line (a method token then a space)."""
    head = data[:33]
    space = head.find(b" ")
    token = head if space < 0 else head[:space]
    return bool(token) and _METHOD.match(token) is not None and (space > 0 or len(head) < 33)


def parse_request_head(data: bytes) -> RequestHead:
    """The request head at the start of `data`. Raises Incomplete, NotHttp or HttpError."""
    if not data:
        raise Incomplete
    line_end = data.find(b"\r\n")
    if line_end < 0:
        if not looks_like_http(data) or len(data) > MAX_HEAD:
            raise NotHttp("not an HTTP/1.x request line")
        raise Incomplete
    request_line = data[:line_end]
    parts = request_line.split(b" ")
    if len(parts) != 3 or not _METHOD.match(parts[0]) or not _VERSION.match(parts[2]) \
            or not parts[1] or any(b < 0x21 or b == 0x7F for b in parts[1]):
        raise NotHttp("not an HTTP/1.x request line")
    end = data.find(b"\r\n\r\n", line_end)
    if end < 0:
        if len(data) > MAX_HEAD:
            raise HttpError(f"request head longer than {MAX_HEAD} bytes")
        raise Incomplete
    if end + 4 > MAX_HEAD:
        raise HttpError(f"request head longer than {MAX_HEAD} bytes")
    raw_lines = data[line_end + 2:end].split(b"\r\n") if end > line_end else []
    headers: list[tuple[str, str]] = []
    for line in raw_lines:
        if line[:1] in (b" ", b"\t"):
            raise HttpError("folded header line")
        name, colon, value = line.partition(b":")
        if not colon or not _FIELD_NAME.match(name):
            raise HttpError(f"malformed header line {line[:80]!r}")
        if b"\n" in value or b"\r" in value or b"\0" in value:
            raise HttpError(f"bad characters in header {name[:80]!r}")
        headers.append((name.decode("ascii").lower(), value.strip(b" \t").decode("latin-1")))
    return RequestHead(parts[0].decode("ascii"), parts[1].decode("latin-1"),
                       parts[2].decode("ascii"), raw_lines, headers, end + 4, request_line,
                       data[:end + 4])


def with_headers(head: RequestHead, set_headers: tuple[tuple[str, str], ...]) -> bytes:
    """The head's bytes with each of `set_headers` set (an existing header of that name, in any
    case, is replaced); other lines stay byte for byte."""
    if not set_headers:
        return head.raw
    final: dict[str, tuple[str, str]] = {}
    for name, value in set_headers:
        final[name.lower()] = (name, value)
    kept = [line for line, (name, _) in zip(head.lines, head.headers, strict=True)
            if name not in final]
    added = [f"{name}: {value}".encode("latin-1") for name, value in final.values()]
    return head.request_line + b"\r\n" + b"".join(x + b"\r\n" for x in kept + added) + b"\r\n"


# What a request carries after its head (RFC 9112 section 6).
def _body_framing(head: RequestHead) -> tuple[str, int]:
    te = head.get_all("transfer-encoding")
    cl = head.get_all("content-length")
    if te and cl:
        raise HttpError("both Transfer-Encoding and Content-Length")
    if te:
        codings = [c.strip().lower() for v in te for c in v.split(",") if c.strip()]
        if not codings or codings[-1] != "chunked":
            raise HttpError("a request Transfer-Encoding must end in chunked")
        return "chunked", 0
    if cl:
        values = {c.strip() for v in cl for c in v.split(",")}
        if len(values) != 1 or not next(iter(values)).isdigit() or len(next(iter(values))) > 18:
            raise HttpError(f"bad Content-Length {cl!r}")
        return "length", int(values.pop())
    return "length", 0


# Per request head: the rewritten head bytes to forward (raise to refuse the request).
HeadHook = Callable[[RequestHead], bytes]


class RequestStream:
    """Frames the client->server bytes of an HTTP/1.x connection: every request head goes
    through `on_head` (which decides and may rewrite it), bodies pass through untouched.
    After a request that switches protocols (Upgrade, CONNECT), bytes that are not a request
    head are passed raw to the end."""

    def __init__(self, on_head: HeadHook) -> None:
        self.on_head = on_head
        self._buf = b""
        self._state = "head"  # head | body | chunk_size | chunk_data | chunk_crlf | trailer | raw
        self._left = 0
        self.requests = 0

    def feed(self, data: bytes) -> bytes:
        """The bytes to forward for `data` (what is held back waits for the next feed)."""
        if self._state == "raw":
            return data
        buf = self._buf + data if self._buf else data
        self._buf = b""
        out: list[bytes] = []
        pos = 0
        while pos < len(buf):
            state = self._state
            if state == "raw":
                out.append(buf[pos:])
                pos = len(buf)
            elif state == "head":
                while buf.startswith(b"\r\n", pos):  # stray CRLF between requests (RFC 9112 2.2)
                    pos += 2
                if pos >= len(buf) or buf[pos:] == b"\r":
                    break
                try:
                    head = parse_request_head(buf[pos:pos + MAX_HEAD + 4])
                except Incomplete:
                    break
                except NotHttp as exc:
                    if self._after_upgrade:
                        # The server switched protocols: what follows is not ours to frame.
                        self._state = "raw"
                        continue
                    raise HttpError(f"request {self.requests + 1}: {exc}") from None
                out.append(self.on_head(head))
                self.requests += 1
                pos += head.length
                kind, size = _body_framing(head)
                upgrade = head.method.upper() == "CONNECT" or bool(head.get_all("upgrade"))
                if kind == "chunked":
                    self._state = "chunk_size"
                elif size:
                    self._state, self._left = "body", size
                # After Upgrade or CONNECT the next bytes are either the other protocol (the
                # server agreed: pass them raw) or the client's next request (it declined:
                # keep checking heads, so a declined upgrade cannot smuggle a request).
                self._after_upgrade = upgrade
            elif state in ("body", "chunk_data"):
                take = min(self._left, len(buf) - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = "chunk_crlf" if state == "chunk_data" else "head"
            elif state in ("chunk_size", "chunk_crlf", "trailer"):
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > 4096:
                        raise HttpError("chunk line longer than 4096 bytes")
                    break
                line = buf[pos:end]
                out.append(buf[pos:end + 2])
                pos = end + 2
                if state == "chunk_crlf":
                    if line:
                        raise HttpError("chunk data not followed by CRLF")
                    self._state = "chunk_size"
                elif state == "chunk_size":
                    size_text = line.split(b";", 1)[0].strip()
                    if not size_text or len(size_text) > 15 or \
                            not all(c in b"0123456789abcdefABCDEF" for c in size_text):
                        raise HttpError(f"bad chunk size {line[:40]!r}")
                    size = int(size_text, 16)
                    if size:
                        self._state, self._left = "chunk_data", size
                    else:
                        self._state = "trailer"
                elif not line:  # trailer section ends with an empty line
                    self._state = "head"
        if pos < len(buf):
            self._buf = buf[pos:]
            if len(self._buf) > MAX_HEAD + 4:
                raise HttpError(f"request head longer than {MAX_HEAD} bytes")
        return b"".join(out)

    _after_upgrade = False
