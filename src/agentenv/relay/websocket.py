"""WebSockets relayed by fragments, so what one connection holds is a small window, not a message.

A relay that forwards whole messages holds each one until its client has taken it: with
messages of up to AENV_PROXY_MAX_WS_MESSAGE_BYTES (16 MiB) and the few a WebSocket library
queues ahead, one client that never reads made the node hold ~128 MiB of the guest's bytes,
and 48 of them 6 GiB. Here the sandbox's side is read frame header by frame header and payload
by pieces of at most `WS_WINDOW` bytes, each piece sent on to the client as a fragment of the
same message (RFC 6455 5.4: intermediaries may refragment) before the next is read. The
client's side is uvicorn's WebSocket protocol with one more ASGI message
(`FragmentingWebSocketProtocol`) that waits until the client's socket has drained below the
transport's high-water mark (64 KiB). A client that does not read therefore stops the reading
of its upstream, as a TCP relay would: per connection the relay holds about one window each way
of the sandbox's bytes, and the kernel's socket buffers the rest.

`UpstreamWebSocket` is the relay's client to the sandbox: the opening handshake through h11,
then frames read and written here (no extensions offered, so none accepted; pings answered).
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import h11
import httpx
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState, ProtocolError
from websockets.frames import Close, CloseCode, Frame, Opcode
from websockets.utils import accept_key, generate_key

#: bytes of one fragment: the most of a sandbox's message read before the client took the last
WS_WINDOW = 64 << 10
#: the ASGI scope extension (and message type) of fragment sends
FRAGMENTS = "websocket.send.fragment"
#: bytes of the upstream's handshake answer (status line and headers)
MAX_HANDSHAKE_BYTES = 64 << 10


class UpstreamRefused(Exception):
    """The upstream did not open the WebSocket (connect failed, a status other than 101, a
    bad handshake)."""


class UpstreamViolation(Exception):
    """The upstream broke RFC 6455 (or a limit) after the handshake: close with `code`."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class Piece:
    """A piece of a data message from the upstream: `first` of its message (its opcode says
    text or binary), `fin` when the message ends with it."""

    data: bytes
    text: bool
    first: bool
    fin: bool


@dataclass(frozen=True)
class Closed:
    """The upstream's close frame."""

    code: int
    reason: str


class UpstreamWebSocket:
    """A client WebSocket to a sandbox's port, read in windows."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 leftover: bytes, subprotocol: str | None) -> None:
        self._reader = reader
        self._writer = writer
        self._leftover = bytearray(leftover)
        self.subprotocol = subprotocol
        self._close_sent = False

    @classmethod
    async def open(cls, url: httpx.URL, headers: Sequence[tuple[bytes, bytes]],
                   subprotocols: Sequence[str], connect_timeout: float,
                   open_timeout: float, tls: ssl.SSLContext | None = None) -> UpstreamWebSocket:
        """Connect and complete the opening handshake (`headers`: the client's, forwarded).
        An https:// or wss:// `url` is TLS, verified with `tls` (the system's CAs if None)."""
        secure = url.scheme in ("https", "wss")
        port = url.port or (443 if secure else 80)
        context = (tls or ssl.create_default_context()) if secure else None
        try:
            async with asyncio.timeout(connect_timeout):
                reader, writer = await asyncio.open_connection(
                    url.host, port, limit=WS_WINDOW, ssl=context,
                    server_hostname=url.host if secure else None)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            raise UpstreamRefused(f"connect to port {port}: {exc or 'timed out'}") from exc
        try:
            async with asyncio.timeout(open_timeout):
                return await cls._handshake(reader, writer, url, headers, subprotocols)
        except BaseException as exc:
            writer.transport.abort()
            if isinstance(exc, TimeoutError):
                raise UpstreamRefused(f"no handshake answer within {open_timeout:g} s") from exc
            if isinstance(exc, OSError | h11.ProtocolError):
                raise UpstreamRefused(f"handshake: {exc}") from exc
            raise

    @classmethod
    async def _handshake(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         url: httpx.URL, headers: Sequence[tuple[bytes, bytes]],
                         subprotocols: Sequence[str]) -> UpstreamWebSocket:
        key = generate_key()
        request_headers = [
            (b"host", url.netloc),
            (b"upgrade", b"websocket"),
            (b"connection", b"Upgrade"),
            (b"sec-websocket-key", key.encode()),
            (b"sec-websocket-version", b"13"),
        ]
        if subprotocols:
            request_headers.append((b"sec-websocket-protocol", ", ".join(subprotocols).encode()))
        request_headers += [(n, v) for n, v in headers if n.lower() != b"host"]
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HANDSHAKE_BYTES)
        writer.write(conn.send(h11.Request(method="GET", target=url.raw_path,
                                           headers=request_headers)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(WS_WINDOW))
                continue
            if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                break
            if isinstance(event, h11.Response):
                raise UpstreamRefused(f"the upstream answered {event.status_code}, not 101")
            if isinstance(event, h11.ConnectionClosed):
                raise UpstreamRefused("the upstream closed the connection in the handshake")
            if not isinstance(event, h11.InformationalResponse):
                raise UpstreamRefused(f"unexpected handshake event {type(event).__name__}")
        answer = {name.lower(): value for name, value in event.headers}
        if answer.get(b"sec-websocket-accept", b"").decode("latin-1") != accept_key(key):
            raise UpstreamRefused("the upstream's Sec-WebSocket-Accept is wrong")
        if answer.get(b"upgrade", b"").lower() != b"websocket":
            raise UpstreamRefused("the upstream's 101 does not upgrade to websocket")
        if b"sec-websocket-extensions" in answer:
            raise UpstreamRefused("the upstream chose an extension none was offered")
        chosen = answer.get(b"sec-websocket-protocol")
        subprotocol = chosen.decode("latin-1") if chosen is not None else None
        if subprotocol is not None and subprotocol not in subprotocols:
            raise UpstreamRefused(f"the upstream chose subprotocol {subprotocol[:40]!r}, "
                                  "which was not offered")
        return cls(reader, writer, conn.trailing_data[0], subprotocol)

    async def _read(self, size: int) -> bytes:
        if self._leftover:
            taken = bytes(self._leftover[:size])
            del self._leftover[:size]
            if len(taken) == size:
                return taken
            return taken + await self._reader.readexactly(size - len(taken))
        return await self._reader.readexactly(size)

    async def receive(self, max_message_bytes: int) -> AsyncIterator[Piece | Closed]:
        """The upstream's messages as pieces of at most WS_WINDOW bytes, then its close frame
        (`UpstreamViolation` for a broken frame or a message over `max_message_bytes`;
        asyncio.IncompleteReadError when the connection ends without one)."""
        in_message = False
        text = False
        size = 0
        while True:
            head = await self._read(2)
            fin = bool(head[0] & 0x80)
            opcode = head[0] & 0x0F
            length = head[1] & 0x7F
            if head[0] & 0x70:
                raise UpstreamViolation(CloseCode.PROTOCOL_ERROR, "reserved bits set")
            if head[1] & 0x80:
                raise UpstreamViolation(CloseCode.PROTOCOL_ERROR, "a server frame is masked")
            if length == 126:
                (length,) = struct.unpack("!H", await self._read(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", await self._read(8))
            if opcode >= Opcode.CLOSE:
                if length > 125 or not fin:
                    raise UpstreamViolation(CloseCode.PROTOCOL_ERROR, "bad control frame")
                payload = await self._read(length)
                if opcode == Opcode.PING:
                    await self._send_frame(Frame(Opcode.PONG, payload))
                elif opcode == Opcode.CLOSE:
                    try:
                        close = Close.parse(payload)
                    except (ProtocolError, UnicodeDecodeError) as exc:
                        raise UpstreamViolation(CloseCode.PROTOCOL_ERROR, str(exc)) from exc
                    yield Closed(close.code, close.reason)
                    return
                elif opcode != Opcode.PONG:
                    raise UpstreamViolation(CloseCode.PROTOCOL_ERROR, f"opcode {opcode}")
                continue
            if opcode == Opcode.CONT:
                if not in_message:
                    raise UpstreamViolation(CloseCode.PROTOCOL_ERROR, "unexpected continuation")
                first = False
            elif opcode in (Opcode.TEXT, Opcode.BINARY):
                if in_message:
                    raise UpstreamViolation(CloseCode.PROTOCOL_ERROR, "expected a continuation")
                in_message, text, size, first = True, opcode == Opcode.TEXT, 0, True
            else:
                raise UpstreamViolation(CloseCode.PROTOCOL_ERROR, f"opcode {opcode}")
            size += length
            if size > max_message_bytes:
                raise UpstreamViolation(CloseCode.MESSAGE_TOO_BIG,
                                        f"a message is over {max_message_bytes} bytes")
            remaining = length
            while True:
                data = await self._read(min(remaining, WS_WINDOW)) if remaining else b""
                remaining -= len(data)
                last = fin and not remaining
                if data or last:
                    yield Piece(data, text, first, last)
                    first = False
                if not remaining:
                    break
            if fin:
                in_message = False

    async def _send_frame(self, frame: Frame) -> None:
        if self._close_sent:
            return
        self._writer.write(frame.serialize(mask=True))
        await self._writer.drain()

    async def send(self, message: bytes | str) -> None:
        """One client message, in frames of at most WS_WINDOW bytes (the upstream's reading
        paces the writing)."""
        data = message.encode() if isinstance(message, str) else message
        opcode = Opcode.TEXT if isinstance(message, str) else Opcode.BINARY
        view = memoryview(data)
        offset = 0
        while True:
            piece = bytes(view[offset:offset + WS_WINDOW])
            offset += len(piece)
            await self._send_frame(Frame(opcode, piece, fin=offset >= len(data)))
            if offset >= len(data):
                return
            opcode = Opcode.CONT

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        """Send a close frame (once) and end the connection once it is written (or after a
        few seconds, for an upstream that does not read)."""
        if not self._close_sent and not self._writer.is_closing():
            frame = Frame(Opcode.CLOSE, Close(code, reason[:120]).serialize())
            self._writer.write(frame.serialize(mask=True))
            self._close_sent = True
            try:
                async with asyncio.timeout(5):
                    await self._writer.drain()
            except (OSError, TimeoutError):
                pass
        self._writer.transport.abort()


def wire_close_code(code: int | None) -> int:
    """A close code that may be sent in a close frame (1005/1006/1015 are reserved for
    "no code", "no close frame" and TLS failures: answered as 1000, 1011)."""
    if code is None or code == CloseCode.NO_STATUS_RCVD:
        return CloseCode.NORMAL_CLOSURE
    try:
        Close(code, "").check()
    except ProtocolError:
        return CloseCode.INTERNAL_ERROR
    return code


class FragmentingWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol plus the ASGI message `websocket.send.fragment` (scope
    extension of the same name): `data` (bytes), `text` and `first` (the message's first
    fragment, sent as a text or binary frame; later ones as continuations) and `fin`. Like
    every send it waits until the client's socket has drained below the high-water mark."""

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][FRAGMENTS] = {}

    async def send(self, message: Any) -> None:
        if message["type"] != FRAGMENTS:
            await super().send(message)
            return
        await self.writable.wait()
        if self.disconnected:
            raise ClientDisconnected()
        if self.close_sent:
            return
        data = message["data"]
        try:
            if not message["first"]:
                self.conn.send_continuation(data, fin=message["fin"])
            elif message["text"]:
                self.conn.send_text(data, fin=message["fin"])
            else:
                self.conn.send_binary(data, fin=message["fin"])
        except InvalidState:
            raise ClientDisconnected() from None
        self.transport.write(b"".join(self.conn.data_to_send()))
