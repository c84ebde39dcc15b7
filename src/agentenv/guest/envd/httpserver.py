"""A small HTTP/1.1 server on asyncio streams and h11 that runs envd's ASGI app.

envd needs plain HTTP/1.1 only (the SDKs never speak h2c to it). Serving it here rather than
through uvicorn keeps the guest agent at about 18 MB instead of 29 MB of RSS (no TLS library,
no CLI framework) and lets a response's headers leave together with its first body bytes.

The first request after a snapshot restore (envd /init on every resume and fork) runs with QEMU's
translation cache empty, so every distinct code path it takes costs guest CPU: the request path
avoids needless ones (a task and a timer per read, per-request imports, exceptions as control flow).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import h11

log = logging.getLogger("envd.http")

READ_BYTES = 64 * 1024
MAX_HEADER_BYTES = 64 * 1024
IDLE_TIMEOUT_SECONDS = 300.0
MAX_DRAIN_BYTES = 4 * 1024 * 1024
WRITE_BUFFER_HIGH = 2 * 1024 * 1024
DRAIN_TIMEOUT_SECONDS = 2.0

App = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[None]]


class _Exchange:
    """One request and its response on a connection: the ASGI receive and send callables."""

    def __init__(self, connection: _Connection) -> None:
        self.connection = connection
        self.body_done = False
        self.response_started = False
        self.response_done = False
        self.pending_start: h11.Response | None = None
        self.disconnected = False

    async def receive(self) -> dict[str, Any]:
        conn = self.connection
        if self.disconnected or self.response_done:
            return {"type": "http.disconnect"}
        if not self.body_done:
            if conn.h11.they_are_waiting_for_100_continue:
                await conn.write(conn.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
            event = await conn.next_event()
            if isinstance(event, h11.Data):
                return {"type": "http.request", "body": bytes(event.data), "more_body": True}
            if isinstance(event, h11.EndOfMessage):
                self.body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            self.disconnected = True
            return {"type": "http.disconnect"}
        # The body is in: what comes now is the client going away (or pipelined bytes to keep).
        while True:
            data = await conn.reader.read(READ_BYTES)
            if not data:
                self.disconnected = True
                return {"type": "http.disconnect"}
            conn.h11.receive_data(data)

    async def send(self, message: dict[str, Any]) -> None:
        conn = self.connection
        kind = message["type"]
        if self.response_done or self.disconnected:
            return
        if kind == "http.response.start":
            if self.response_started:
                raise RuntimeError("the response has already started")
            self.response_started = True
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            # Held back so that the headers go out in one write with the first body bytes.
            self.pending_start = h11.Response(status_code=message["status"], headers=headers)
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.response_started:
            raise RuntimeError("the response body was sent before its start")
        out = bytearray()
        if self.pending_start is not None:
            out += conn.h11.send(self.pending_start)
            self.pending_start = None
        body = message.get("body", b"")
        if body:
            out += conn.h11.send(h11.Data(data=body))
        if not message.get("more_body", False):
            out += conn.h11.send(h11.EndOfMessage())
            self.response_done = True
        if out:
            try:
                await conn.write(bytes(out))
            except ConnectionError:
                self.disconnected = True


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)

    async def next_event(self, timeout: float | None = None) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            if timeout is None:
                data = await self.reader.read(READ_BYTES)
            else:
                # Not wait_for: that wraps the read in a task of its own.
                async with asyncio.timeout(timeout):
                    data = await self.reader.read(READ_BYTES)
            self.h11.receive_data(data)

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


class HttpServer:
    def __init__(self, app: App) -> None:
        self.app = app
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting: set[asyncio.Task[Any]] = set()  # connections getting their transport
        self._connections: set[asyncio.Task[None]] = set()
        self._idle: set[asyncio.Task[None]] = set()  # waiting for their next request

    async def start(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(listener.fileno(), self._accept)

    def _accept(self) -> None:
        """One accept per readiness of the listener (level-triggered: more pending connections
        wake it again). asyncio's own server accepts in a loop until EAGAIN, which raises an
        exception, strerror and all, on every connection: a cost on each first request."""
        listener, loop = self._listener, self._loop
        if listener is None or loop is None:
            return
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:
            # Out of file descriptors or memory: stop accepting for a second instead of spinning.
            log.warning("accept failed; pausing for 1 s", extra={"error": str(exc)})
            loop.remove_reader(listener.fileno())
            loop.call_later(1.0, self._resume_accepting, listener)
            return
        conn.setblocking(False)
        reader = asyncio.StreamReader(limit=READ_BYTES, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, self._serve_connection, loop=loop)
        task = loop.create_task(loop.connect_accepted_socket(lambda: protocol, conn))
        self._accepting.add(task)
        task.add_done_callback(self._accepted)

    def _accepted(self, task: asyncio.Task[Any]) -> None:
        self._accepting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # The client went away before its transport was made; nothing to serve.
            log.debug("connection lost while accepting", extra={"error": str(task.exception())})

    def _resume_accepting(self, listener: socket.socket) -> None:
        if self._listener is listener and self._loop is not None:
            self._loop.add_reader(listener.fileno(), self._accept)

    async def close(self, grace_seconds: float = 2.0) -> None:
        """Stop accepting; give open exchanges a moment to finish, then cut them."""
        if self._listener is not None and self._loop is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
        self._listener = None
        for task in self._accepting:
            task.cancel()
        for task in self._idle:
            task.cancel()  # nothing in flight: no need to wait for these
        if self._connections:
            _, pending = await asyncio.wait(set(self._connections), timeout=grace_seconds)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        # No TCP_NODELAY here: asyncio's socket transport sets it on every TCP connection (Nagle
        # would hold back headers, envelopes and chunks, which go out as separate writes).
        # Let a 1 MiB download chunk sit in the buffer without a drain wait per chunk.
        writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        connection = _Connection(reader, writer)
        try:
            await self._serve_requests(connection)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, asyncio.CancelledError):
            pass
        except h11.RemoteProtocolError as exc:
            await self._reject(connection, exc)
        except Exception:
            log.exception("connection failed", extra={"peer": str(writer.get_extra_info("peername"))})
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve_requests(self, connection: _Connection) -> None:
        task = asyncio.current_task()
        assert task is not None
        while True:
            self._idle.add(task)
            try:
                event = await connection.next_event(timeout=IDLE_TIMEOUT_SECONDS)
            finally:
                self._idle.discard(task)
            if isinstance(event, h11.ConnectionClosed):
                return
            if not isinstance(event, h11.Request):
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}")
            exchange = _Exchange(connection)
            await self.app(_scope(event, connection.writer), exchange.receive, exchange.send)
            if not exchange.response_done:
                if exchange.disconnected:
                    return
                if not exchange.response_started:
                    await exchange.send({"type": "http.response.start", "status": 500, "headers": [(b"content-length", b"0")]})
                    await exchange.send({"type": "http.response.body", "body": b""})
                else:
                    return  # an unfinished response: the only way to end it is to close
            if connection.h11.their_state is not h11.DONE and not await _drain_body(connection):
                return
            if connection.h11.our_state is h11.MUST_CLOSE:
                return
            connection.h11.start_next_cycle()

    @staticmethod
    async def _reject(connection: _Connection, exc: h11.RemoteProtocolError) -> None:
        if connection.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = f'{{"code":400,"message":"malformed HTTP request: {exc}"}}'.encode()
        with contextlib.suppress(Exception):
            response = h11.Response(
                status_code=exc.error_status_hint,
                headers=[(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")],
            )
            await connection.write(connection.h11.send(response) + connection.h11.send(h11.Data(data=body)) + connection.h11.send(h11.EndOfMessage()))


async def _drain_body(connection: _Connection) -> bool:
    """Read and drop what is left of a request body the app did not want (an error answered
    early). Closing with unread bytes would make the kernel reset the connection, and the client
    could lose the answer it has not read yet. Gives up on large or slow bodies."""
    dropped = 0
    try:
        while dropped <= MAX_DRAIN_BYTES:
            event = await connection.next_event(timeout=DRAIN_TIMEOUT_SECONDS)
            if not isinstance(event, h11.Data):
                return isinstance(event, h11.EndOfMessage)
            dropped += len(event.data)
    except (TimeoutError, ConnectionError, h11.RemoteProtocolError):
        return False
    return False


def _scope(request: h11.Request, writer: asyncio.StreamWriter) -> dict[str, Any]:
    target = bytes(request.target)
    path, _, query = target.partition(b"?")
    # By index: iterating h11's Headers goes through Sequence.__iter__, which stops on an IndexError.
    headers = request.headers
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": request.http_version.decode(),
        "method": request.method.decode("ascii"),
        "scheme": "http",
        "path": unquote(path.decode("latin-1")),
        "raw_path": path,
        "query_string": query,
        "headers": [(bytes(k), bytes(v)) for k, v in (headers[i] for i in range(len(headers)))],
        "client": writer.get_extra_info("peername"),
        "server": writer.get_extra_info("sockname"),
    }
