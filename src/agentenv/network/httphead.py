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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MAX_HEAD = 64 << 10
_METHOD = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}$")
_VERSION = re.compile(rb"^HTTP/1\.[01]$")
_FIELD_NAME = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_HOST = re.compile(r"^[a-z0-9_]([a-z0-9_.-]{0,252})$")
_STATUS_LINE = re.compile(rb"^HTTP/1\.[01] ([1-5][0-9][0-9])(?: [^\r\n]*)?$")


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
        if self.method.upper() == "CONNECT":
            # Authority form: the tunnel goes where the target says, whatever Host says.
            target_host = _host_of(self.target)
            if hosts and _host_of(hosts[0]) != target_host:
                raise HttpError("the Host header and the CONNECT target name different hosts")
            return target_host
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
    end, raw_lines, headers = _header_fields(data, line_end, "request")
    return RequestHead(parts[0].decode("ascii"), parts[1].decode("latin-1"),
                       parts[2].decode("ascii"), raw_lines, headers, end + 4, request_line,
                       data[:end + 4])


def _header_fields(data: bytes, line_end: int,
                   what: str) -> tuple[int, list[bytes], list[tuple[str, str]]]:
    """The header section after the start line ending at `line_end`: (where the head's final
    CRLFCRLF starts, the lines as sent, (lower-case name, stripped value) pairs)."""
    end = data.find(b"\r\n\r\n", line_end)
    if end < 0:
        if len(data) > MAX_HEAD:
            raise HttpError(f"{what} head longer than {MAX_HEAD} bytes")
        raise Incomplete
    if end + 4 > MAX_HEAD:
        raise HttpError(f"{what} head longer than {MAX_HEAD} bytes")
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
    return end, raw_lines, headers


@dataclass
class ResponseHead:
    status: int
    headers: list[tuple[str, str]]
    length: int  # bytes of the head, final CRLFCRLF included

    def get_all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]


def parse_response_head(data: bytes) -> ResponseHead:
    """The response head at the start of `data`. Raises Incomplete or HttpError."""
    line_end = data.find(b"\r\n")
    if line_end < 0:
        if len(data) > MAX_HEAD:
            raise HttpError("no response status line")
        raise Incomplete
    match = _STATUS_LINE.match(data[:line_end])
    if match is None:
        raise HttpError(f"not an HTTP/1.x status line: {data[:min(line_end, 80)]!r}")
    end, _, headers = _header_fields(data, line_end, "response")
    return ResponseHead(int(match.group(1)), headers, end + 4)


def without_h2c(head: RequestHead) -> RequestHead:
    """The head without an upgrade to HTTP/2 in clear text (`Upgrade: h2c` and its
    HTTP2-Settings): the server answers in HTTP/1.1 and the connection stays one the proxy can
    read. After a switch to h2c the client could ask the server for any host in HTTP/2 frames
    the proxy does not parse. An Upgrade offering h2c among other protocols is refused."""
    offers = [t.strip().lower() for v in head.get_all("upgrade") for t in v.split(",")]
    if "h2c" not in offers:
        return head
    if set(offers) != {"h2c"}:
        raise HttpError("an Upgrade offering h2c with other protocols")
    kept = [line for line, (name, _) in zip(head.lines, head.headers, strict=True)
            if name not in ("upgrade", "http2-settings")]
    return parse_request_head(head.request_line + b"\r\n"
                              + b"".join(x + b"\r\n" for x in kept) + b"\r\n")


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
        return "length", _content_length(cl)
    return "length", 0


def _content_length(values: list[str]) -> int:
    distinct = {c.strip() for v in values for c in v.split(",")}
    if len(distinct) != 1 or not next(iter(distinct)).isdigit() or len(next(iter(distinct))) > 18:
        raise HttpError(f"bad Content-Length {values!r}")
    return int(distinct.pop())


# And a response (RFC 9112 section 6.3), given the method of the request it answers.
def _response_framing(method: str, head: ResponseHead) -> tuple[str, int]:
    if method == "HEAD" or head.status < 200 or head.status in (204, 304):
        return "length", 0
    if method == "CONNECT" and head.status < 300:
        return "raw", 0
    te = head.get_all("transfer-encoding")
    if te:
        codings = [c.strip().lower() for v in te for c in v.split(",") if c.strip()]
        return ("chunked", 0) if codings and codings[-1] == "chunked" else ("raw", 0)
    cl = head.get_all("content-length")
    if cl:
        return "length", _content_length(cl)
    return "raw", 0  # the body ends when the server closes


class _Framer:
    """Message framing of one direction of an HTTP/1.x connection: heads go to `_head`,
    bodies (by length or chunked) pass through untouched; "raw" passes everything to the end."""

    def __init__(self) -> None:
        self._buf = b""
        self._state = "head"  # head | body | chunk_size | chunk_data | chunk_crlf | trailer | raw
        self._left = 0

    def _head(self, buf: bytes, pos: int, out: list[bytes]) -> int | None:
        """Handle the head at buf[pos:]: append what to forward to `out`, set the state for
        what follows; the position after it, or None while it is incomplete."""
        raise NotImplementedError

    def _frame(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        self._buf = b""
        out: list[bytes] = []
        pos = 0
        while pos < len(buf):
            state = self._state
            if state == "raw":
                out.append(buf[pos:])
                pos = len(buf)
            elif state == "hold":
                break
            elif state == "head":
                while buf.startswith(b"\r\n", pos):  # stray CRLF between messages (RFC 9112 2.2)
                    pos += 2
                if pos >= len(buf) or buf[pos:] == b"\r":
                    break
                after = self._head(buf, pos, out)
                if after is None:
                    break
                pos = after
            elif state in ("body", "chunk_data"):
                take = min(self._left, len(buf) - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = "chunk_crlf" if state == "chunk_data" else "head"
            else:  # chunk_size, chunk_crlf, trailer
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
                raise HttpError(f"more than {MAX_HEAD} bytes held back")
        return b"".join(out)

    def _body(self, kind: str, size: int) -> None:
        if kind == "chunked":
            self._state = "chunk_size"
        elif kind == "raw":
            self._state = "raw"
        elif size:
            self._state, self._left = "body", size


# Per request head: the rewritten head bytes to forward (raise to refuse the request).
HeadHook = Callable[[RequestHead], bytes]


class RequestStream(_Framer):
    """Frames the client->server bytes of an HTTP/1.x connection: every request head goes
    through `on_head` (which decides and may rewrite it), bodies pass through untouched.

    A request that asks to switch protocols (Upgrade, CONNECT) is the end of what can be framed
    only if the server agrees. So the bytes after it are held (at most MAX_HEAD) until its
    response is known (`responses()`, the server->client side, calls `_verdict`): 101 (a 2xx
    to CONNECT) passes them and all after raw; anything else, and they are request heads again,
    each decided. Held bytes released by the verdict go to `release`. Without this, a request
    the server declined followed by bytes the proxy took for the new protocol would carry a
    request for any Host to the server (smuggling past the decision by name)."""

    def __init__(self, on_head: HeadHook) -> None:
        super().__init__()
        self.on_head = on_head
        self.requests = 0
        self.release: Callable[[bytes], None] | None = None
        # Methods of the requests passed on whose final response has not come yet.
        self.unanswered: deque[tuple[str, bool]] = deque()
        self.blind = False  # the responses could not be framed: no upgrade can be known

    def feed(self, data: bytes) -> bytes:
        """The bytes to forward for `data` (what is held back waits for the next feed)."""
        if self._state == "raw":
            return data
        return self._frame(data)

    def _head(self, buf: bytes, pos: int, out: list[bytes]) -> int | None:
        try:
            head = parse_request_head(buf[pos:pos + MAX_HEAD + 4])
        except Incomplete:
            return None
        except NotHttp as exc:
            raise HttpError(f"request {self.requests + 1}: {exc}") from None
        out.append(self.on_head(head))
        self.requests += 1
        method = head.method.upper()
        upgrade = method == "CONNECT" or bool(head.get_all("upgrade"))
        self.unanswered.append((method, upgrade and not self.blind))
        kind, size = _body_framing(head)
        if upgrade and (kind == "chunked" or size):
            raise HttpError(f"request {self.requests}: a body with a request to switch protocols")
        self._body(kind, size)
        if upgrade and not self.blind:
            self._state = "hold"  # until the server answers it
        return pos + head.length

    def _verdict(self, switched: bool) -> None:
        """The server answered the request that asked to switch protocols."""
        self._state = "raw" if switched else "head"
        held, self._buf = self._buf, b""
        released = self.feed(held) if held else b""
        if released and self.release is not None:
            self.release(released)

    def _blinded(self) -> None:
        self.blind = True
        if self._state == "hold":
            self._verdict(False)

    def responses(self) -> ResponseStream:
        return ResponseStream(self)


class ResponseStream(_Framer):
    """Frames the server->client bytes of the connection `requests` frames (passed on
    unchanged) to learn each request's response: whether the server switched protocols."""

    def __init__(self, requests: RequestStream) -> None:
        super().__init__()
        self.requests = requests
        self._switched: bool | None = None  # the verdict on an upgrade, once its answer came

    def feed(self, data: bytes) -> bytes:
        """`data` unchanged; what it says is told to the request side (which may raise for
        the requests it held: those are the client's, decided as any other)."""
        if self._state != "raw":
            try:
                self._frame(data)
            except HttpError:
                # A server we cannot frame: its bytes still pass; no upgrade is let through.
                self._state, self._buf = "raw", b""
                self.requests._blinded()
        if self._switched is not None:
            switched, self._switched = self._switched, None
            self.requests._verdict(switched)
        return data

    def _head(self, buf: bytes, pos: int, out: list[bytes]) -> int | None:
        try:
            head = parse_response_head(buf[pos:pos + MAX_HEAD + 4])
        except Incomplete:
            return None
        if not self.requests.unanswered:
            raise HttpError(f"a response ({head.status}) to no request")
        if 100 <= head.status < 200 and head.status != 101:
            return pos + head.length  # interim (100 Continue): the final one follows
        method, upgrade = self.requests.unanswered.popleft()
        kind, size = ("raw", 0) if head.status == 101 else _response_framing(method, head)
        self._body(kind, size)
        if upgrade:
            self._switched = kind == "raw" and (head.status == 101 or method == "CONNECT")
        elif kind == "raw":
            self.requests._blinded()  # the rest cannot be framed (it ends with the connection)
        return pos + head.length
