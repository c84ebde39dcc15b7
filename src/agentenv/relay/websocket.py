"""WebSockets relayed by fragments, so what one connection holds is a small window, not a message.

A relay that forwards whole messages holds each one until its peer has taken it: with messages
of up to AENV_PROXY_MAX_WS_MESSAGE_BYTES (16 MiB) and the few a WebSocket library queues
ahead, one client that never reads made the node hold ~128 MiB of the guest's bytes, and 48 of
them 6 GiB; the other way, 32 clients each sending one 16 MiB message to a guest that does not
read made it hold over 1 GiB. So both sides are read frame header by frame header and payload
by pieces of at most `WS_WINDOW` bytes, each piece sent on as a fragment of the same message
(RFC 6455 5.4: intermediaries may refragment) before the next is read:

- the sandbox's side: `UpstreamWebSocket`, the relay's client to the sandbox (the opening
  handshake through h11, then frames read and written here; no extensions offered, so none
  accepted; pings answered).
- the client's side: uvicorn's WebSocket protocol (its handshake, pings, close and sends) with
  the frame reading replaced (`FragmentingWebSocketProtocol`): an app that accepts with
  `"fragments": True` receives `websocket.receive.fragment` messages; reading stops while the
  app holds WS_WINDOW bytes it has not taken, so a sandbox that does not read stops the client
  (TCP's window, as a TCP relay would). Sends of fragments wait until the client's socket has
  drained below the transport's high-water mark (64 KiB).

Per connection the relay therefore holds about one window each way and one socket read; the
kernel's socket buffers hold the rest. No compression is negotiated with clients
(permessage-deflate would need whole frames, and a small frame can inflate to the message cap).
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
from websockets.frames import Close, CloseCode, Frame, Opcode, apply_mask
from websockets.utils import accept_key, generate_key

#: bytes of one fragment: the most of a sandbox's message read before the client took the last
WS_WINDOW = 64 << 10
#: the ASGI scope extension (and message type) of fragment sends
FRAGMENTS = "websocket.send.fragment"
#: the ASGI message type (and scope extension) of fragments received, for an app that accepted
#: with `"fragments": True`
RECEIVED_FRAGMENT = "websocket.receive.fragment"
#: bytes of the upstream's handshake answer (status line and headers)
MAX_HANDSHAKE_BYTES = 64 << 10


class UpstreamRefused(Exception):
    """The upstream did not open the WebSocket (connect failed, a status other than 101, a
    bad handshake)."""


class FrameViolation(Exception):
    """A peer broke RFC 6455 (or a limit) after the handshake: close with `code`."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class Piece:
    """A piece of a data message: `first` of its message (its opcode says text or binary),
    `fin` when the message ends with it."""

    data: bytes
    text: bool
    first: bool
    fin: bool


@dataclass(frozen=True)
class Closed:
    """The upstream's close frame."""

    code: int
    reason: str


def _check_control(opcode: int, fin: bool, length: int) -> None:
    """RFC 6455 5.5: a control frame is whole and at most 125 bytes; 0xB-0xF are reserved."""
    if opcode not in (Opcode.CLOSE, Opcode.PING, Opcode.PONG):
        raise FrameViolation(CloseCode.PROTOCOL_ERROR, f"opcode {opcode}")
    if length > 125 or not fin:
        raise FrameViolation(CloseCode.PROTOCOL_ERROR, "bad control frame")


class _Messages:
    """A peer's data messages so far: each data frame checked against the message it starts
    or continues, and the message's size against the limit, before its payload is read."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.within = False
        self.text = False
        self.first = False  # no piece of the message passed on yet
        self.size = 0

    def start_frame(self, opcode: int, length: int) -> None:
        if opcode == Opcode.CONT:
            if not self.within:
                raise FrameViolation(CloseCode.PROTOCOL_ERROR, "unexpected continuation")
        elif opcode in (Opcode.TEXT, Opcode.BINARY):
            if self.within:
                raise FrameViolation(CloseCode.PROTOCOL_ERROR, "expected a continuation")
            self.within, self.text, self.first, self.size = True, opcode == Opcode.TEXT, True, 0
        else:
            raise FrameViolation(CloseCode.PROTOCOL_ERROR, f"opcode {opcode}")
        self.size += length
        if self.size > self.max_bytes:
            raise FrameViolation(CloseCode.MESSAGE_TOO_BIG,
                                 f"a message is over {self.max_bytes} bytes")

    def piece(self, data: bytes, last: bool) -> Piece | None:
        """What `data` of the current frame passes on (None: nothing); `last`: the message
        ends with it."""
        if not data and not last:
            return None
        piece = Piece(data, self.text, self.first, last)
        self.first = False
        self.within = not last
        return piece


@dataclass(frozen=True)
class Control:
    """A client's control frame, whole and as it came (masked)."""

    raw: bytes


class ClientFrames:
    """A client's frames, read as its bytes come: data payloads as unmasked pieces of at most
    WS_WINDOW bytes as soon as they are here (a frame of any size is never gathered), control
    frames whole. What stays buffered between calls is at most a frame head."""

    def __init__(self, max_message_bytes: int) -> None:
        self._buffer = bytearray()
        self._messages = _Messages(max_message_bytes)
        self._remaining = -1  # payload bytes of the data frame being read; -1: a head is next
        self._mask = b""
        self._offset = 0  # payload bytes of the frame already read (the mask's phase)
        self._fin = False

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def hold(self, data: bytes) -> None:
        """Keep `data` unread (it came before the handshake was answered)."""
        self._buffer += data

    def feed(self, data: bytes) -> list[Piece | Control]:
        """What `data` (and what was held) completes; `FrameViolation` for a broken frame."""
        buf = self._buffer
        buf += data
        out: list[Piece | Control] = []
        while True:
            if self._remaining < 0:
                if len(buf) < 2:
                    return out
                fin, opcode, length = bool(buf[0] & 0x80), buf[0] & 0x0F, buf[1] & 0x7F
                start = 2 + (2 if length == 126 else 8 if length == 127 else 0)
                if buf[0] & 0x70:
                    raise FrameViolation(CloseCode.PROTOCOL_ERROR,
                                         "reserved bits set (no extension was negotiated)")
                if not buf[1] & 0x80:
                    raise FrameViolation(CloseCode.PROTOCOL_ERROR, "a client frame is not masked")
                if len(buf) < start + 4:
                    return out
                if length == 126:
                    (length,) = struct.unpack_from("!H", buf, 2)
                elif length == 127:
                    (length,) = struct.unpack_from("!Q", buf, 2)
                if opcode >= Opcode.CLOSE:
                    _check_control(opcode, fin, length)
                    end = start + 4 + length
                    if len(buf) < end:
                        return out
                    out.append(Control(bytes(buf[:end])))
                    del buf[:end]
                    continue
                self._messages.start_frame(opcode, length)
                self._mask = bytes(buf[start:start + 4])
                del buf[:start + 4]
                self._remaining, self._offset, self._fin = length, 0, fin
            if self._remaining and not buf:
                return out
            take = min(self._remaining, len(buf), WS_WINDOW)
            data = bytes(buf[:take])
            del buf[:take]
            if take:
                phase = self._offset % 4
                data = apply_mask(data, self._mask[phase:] + self._mask[:phase])
            self._offset += take
            self._remaining -= take
            piece = self._messages.piece(data, self._fin and not self._remaining)
            if piece is not None:
                out.append(piece)
            if not self._remaining:
                self._remaining = -1


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
        (`FrameViolation` for a broken frame or a message over `max_message_bytes`;
        asyncio.IncompleteReadError when the connection ends without one)."""
        messages = _Messages(max_message_bytes)
        while True:
            head = await self._read(2)
            fin = bool(head[0] & 0x80)
            opcode = head[0] & 0x0F
            length = head[1] & 0x7F
            if head[0] & 0x70:
                raise FrameViolation(CloseCode.PROTOCOL_ERROR, "reserved bits set")
            if head[1] & 0x80:
                raise FrameViolation(CloseCode.PROTOCOL_ERROR, "a server frame is masked")
            if length == 126:
                (length,) = struct.unpack("!H", await self._read(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", await self._read(8))
            if opcode >= Opcode.CLOSE:
                _check_control(opcode, fin, length)
                payload = await self._read(length)
                if opcode == Opcode.PING:
                    await self._send_frame(Frame(Opcode.PONG, payload))
                elif opcode == Opcode.CLOSE:
                    try:
                        close = Close.parse(payload)
                    except (ProtocolError, UnicodeDecodeError) as exc:
                        raise FrameViolation(CloseCode.PROTOCOL_ERROR, str(exc)) from exc
                    yield Closed(close.code, close.reason)
                    return
                continue
            messages.start_frame(opcode, length)
            remaining = length
            while True:
                data = await self._read(min(remaining, WS_WINDOW)) if remaining else b""
                remaining -= len(data)
                piece = messages.piece(data, fin and not remaining)
                if piece is not None:
                    yield piece
                if not remaining:
                    break

    async def _send_frame(self, frame: Frame) -> None:
        if self._close_sent:
            return
        self._writer.write(frame.serialize(mask=True))
        await self._writer.drain()

    async def send_piece(self, piece: Piece) -> None:
        """A piece of a client's message, as one frame (the upstream's reading paces the
        writing: this waits while the socket holds more than its high-water mark)."""
        opcode = Opcode.CONT if not piece.first else Opcode.TEXT if piece.text else Opcode.BINARY
        await self._send_frame(Frame(opcode, piece.data, fin=piece.fin))

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
    """uvicorn's WebSocket protocol with its frames read here (`ClientFrames`), and fragments
    either way (scope extensions of the same names):

    - send `websocket.send.fragment`: `data` (bytes), `text` and `first` (the message's first
      fragment, sent as a text or binary frame; later ones as continuations) and `fin`. Like
      every send it waits until the client's socket has drained below the high-water mark.
    - an app that accepts with `"fragments": True` receives `websocket.receive.fragment`
      messages of the same fields instead of whole messages; reading stops while it holds
      WS_WINDOW bytes it has not taken. Other apps receive whole messages (at most
      `ws_max_size` bytes, gathered here), reading stopped while one waits, as uvicorn does.

    Control frames (ping, pong, close) go to uvicorn's handling through websockets' protocol,
    which never sees a data frame."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._frames = ClientFrames(self.config.ws_max_size)
        self._head_taken = False
        self._fragments = False  # the app receives fragments
        self._held = 0  # bytes of fragments queued for the app
        self._message = bytearray()  # a whole message being gathered (apps without fragments)

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][FRAGMENTS] = {}
            scope["extensions"][RECEIVED_FRAGMENT] = {}

    def data_received(self, data: bytes) -> None:
        if not self._head_taken:  # the request head, as the HTTP protocol hands it over
            self._head_taken = True
            super().data_received(data)
            return
        if not self.handshake_complete:
            # RFC 6455 4.1: a client waits for the handshake's answer before it sends frames;
            # what comes early waits for the app's accept (and whether it takes fragments)
            self._frames.hold(data)
            self._pace()
            return
        if self.initial_response is not None or self.transport.is_closing():
            return
        self._take(data)

    def _take(self, data: bytes) -> None:
        try:
            events = self._frames.feed(data)
        except FrameViolation as exc:
            self._fail(exc.code, exc.reason)
            return
        for event in events:
            if isinstance(event, Control):
                self.conn.receive_data(event.raw)
                if self.conn.parser_exc is not None:  # e.g. a close frame's bad code
                    self.handle_parser_exception()
                    return
                self.handle_events()  # uvicorn's: ping, pong, close
                if self.transport.is_closing():
                    return
            elif not self._deliver(event):
                return
        self._pace()

    def _deliver(self, piece: Piece) -> bool:
        """Queue `piece` for the app (or the message it ends); False if the connection
        failed."""
        if self.close_sent:  # the app is past websocket.close: discarded, as uvicorn does
            return True
        if self._fragments:
            self._held += len(piece.data)
            self.queue.put_nowait({"type": RECEIVED_FRAGMENT, "data": piece.data,
                                   "text": piece.text, "first": piece.first, "fin": piece.fin})
            return True
        self._message += piece.data
        if not piece.fin:
            return True
        data = bytes(self._message)
        self._message.clear()
        if piece.text:
            try:
                self.queue.put_nowait({"type": "websocket.receive", "text": data.decode()})
            except UnicodeDecodeError:
                self._fail(CloseCode.INVALID_DATA, "a text message is not UTF-8")
                return False
        else:
            self.queue.put_nowait({"type": "websocket.receive", "bytes": data})
        return True

    def _full(self) -> bool:
        if not self.handshake_complete:
            return self._frames.buffered >= WS_WINDOW
        if self._fragments:
            return self._held >= WS_WINDOW
        return not self.queue.empty()

    def _pace(self) -> None:
        """Stop reading the client while the app holds what it has not taken; resume once it
        took it."""
        full = self._full()
        if full and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()
        elif not full and self.read_paused and not self.transport.is_closing():
            self.read_paused = False
            self.transport.resume_reading()

    def _fail(self, code: int, reason: str) -> None:
        self.conn.fail(code, reason)
        if self.conn.close_sent is None:  # not open any more: nothing to say
            self.transport.close()
            return
        self.handle_parser_exception()

    async def receive(self) -> Any:
        message = await self.queue.get()
        if message["type"] == RECEIVED_FRAGMENT:
            self._held -= len(message["data"])
        if self.read_paused:
            self._pace()
        return message

    async def send(self, message: Any) -> None:
        if message["type"] == "websocket.accept" and not self.handshake_complete:
            self._fragments = bool(message.get("fragments"))
            await super().send(message)
            if self.handshake_complete and not self.transport.is_closing():
                self._take(b"")  # what came early
            return
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
