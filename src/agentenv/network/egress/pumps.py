"""Moving a connection's bytes, one direction a pump: CopyPump through this process (where the
bytes must be read: HTTP heads), SplicePump by the kernel (splice(2): they never enter it)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from agentenv.network import httphead
from agentenv.network.egress.decisions import Refused

if TYPE_CHECKING:
    from agentenv.network.egress.conn import Conn


class _Direction:
    """What both pumps share: a read's outcome (nothing yet, the source failed, the source
    ended), unwatching, and the byte counters. Subclasses give `_recv` and `_finish` and hold
    the slots."""

    __slots__ = ()
    conn: Conn
    loop: asyncio.AbstractEventLoop
    src_fd: int
    dst_fd: int
    up: bool
    eof: bool
    writing: bool  # waiting for the destination to take more (not reading meanwhile)

    def _recv(self) -> int:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Unwatch the socket it waits on."""
        if self.writing:
            self.loop.remove_writer(self.dst_fd)
            self.writing = False
        elif not self.eof:
            self.loop.remove_reader(self.src_fd)

    def _received(self) -> int:
        """Bytes one `_recv` took; 0 when there were none (a failure or the end is passed on
        here, the caller only returns)."""
        try:
            n = self._recv()
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            self.conn.broken(exc, "guest" if self.up else "destination")
            return 0
        if n == 0:
            self.loop.remove_reader(self.src_fd)
            self.eof = True
            self._finish()
            return 0
        self.conn.last_active = self.loop.time()
        return n

    def _count(self, n: int) -> None:
        if self.up:
            self.conn.proxy.counters.bytes_up += n
        else:
            self.conn.proxy.counters.bytes_down += n


class CopyPump(_Direction):
    """One direction of a connection between two non-blocking sockets, copied through this
    process (used where bytes must be read: the HTTP request direction), driven by the event
    loop's readiness callbacks (no task per connection). Reads go through one shared buffer;
    only what the destination does not take at once is kept (bounded: reading stops until it
    is sent)."""

    __slots__ = ("conn", "dst", "dst_fd", "eof", "loop", "pending", "src", "src_fd",
                 "transform", "up", "writing")

    def __init__(self, conn: Conn, src: socket.socket, dst: socket.socket, up: bool,
                 transform: Callable[[bytes], bytes] | None, initial: bytes) -> None:
        self.conn, self.src, self.dst, self.up = conn, src, dst, up
        self.src_fd, self.dst_fd = src.fileno(), dst.fileno()
        self.loop = conn.proxy.loop
        self.transform = transform
        self.pending = memoryview(initial) if initial else None
        self.eof = False
        self.writing = False

    def start(self) -> None:
        if self.pending is not None:
            self._want_write()
        else:
            self.loop.add_reader(self.src_fd, self._readable)

    def _want_write(self) -> None:
        self.writing = True
        self.loop.add_writer(self.dst_fd, self._writable)

    def _recv(self) -> int:
        return self.src.recv_into(self.conn.proxy.buffer)

    def _readable(self) -> None:
        n = self._received()
        if not n:
            return
        data: bytes | memoryview = self.conn.proxy.view[:n]
        if self.transform is not None:
            try:
                data = self.transform(bytes(data))
            except Refused as exc:
                self.conn.refuse(str(exc), exc.kind, exc.fields)
                return
            except httphead.HttpError as exc:
                self.conn.refuse(f"HTTP: {exc}")
                return
            if not data:
                return
        self._send(data, from_reader=True)

    def _send(self, data: bytes | memoryview, from_reader: bool) -> None:
        try:
            sent = self.dst.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.conn.broken(exc, "destination" if self.up else "guest")
            return
        self._count(sent)
        if sent < len(data):
            # Keep the rest (a copy: the shared buffer is reused) and stop reading until sent.
            self.pending = memoryview(bytes(data[sent:]))
            if from_reader:
                self.loop.remove_reader(self.src_fd)
                self._want_write()
        else:
            self.pending = None
            if not from_reader:
                self.loop.remove_writer(self.dst_fd)
                self.writing = False
                if self.eof:
                    self._finish()
                else:
                    self.loop.add_reader(self.src_fd, self._readable)

    def _writable(self) -> None:
        assert self.pending is not None
        self.conn.last_active = self.loop.time()
        self._send(self.pending, from_reader=False)

    def inject(self, data: bytes) -> None:
        """Send bytes read earlier that the transform held back until the other direction
        told what they are (httphead.RequestStream.release)."""
        if self.conn.closed:
            return
        if self.pending is not None:
            self.pending = memoryview(bytes(self.pending) + data)
            return
        self._send(data, from_reader=True)

    def _finish(self) -> None:
        """The source ended: pass the end on (half-close) once everything is sent."""
        if self.pending is not None:
            return
        with contextlib.suppress(OSError):
            self.dst.shutdown(socket.SHUT_WR)
        self.conn.half_closed()

    @property
    def done(self) -> bool:
        return self.eof and self.pending is None


_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
_F_SETPIPE_SZ = 1031


class SplicePump(_Direction):
    """One direction moved by the kernel (splice(2) socket -> pipe -> socket): the bytes never
    enter this process. What the destination does not take at once stays in the pipe (at most
    PIPE_SIZE; reading stops until it is drained)."""

    PIPE_SIZE = 256 << 10

    __slots__ = ("conn", "dst", "dst_fd", "eof", "in_pipe", "loop", "pipe_r", "pipe_w", "src",
                 "src_fd", "up", "writing")

    def __init__(self, conn: Conn, src: socket.socket, dst: socket.socket, up: bool) -> None:
        self.conn, self.src, self.dst, self.up = conn, src, dst, up
        self.src_fd, self.dst_fd = src.fileno(), dst.fileno()
        self.loop = conn.proxy.loop
        self.pipe_r, self.pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # a smaller pipe only means more wake-ups
            fcntl.fcntl(self.pipe_w, _F_SETPIPE_SZ, self.PIPE_SIZE)
        self.in_pipe = 0
        self.eof = False
        self.writing = False

    def start(self) -> None:
        self.loop.add_reader(self.src_fd, self._readable)

    def stop(self) -> None:
        super().stop()
        if self.pipe_r >= 0:
            os.close(self.pipe_r)
            os.close(self.pipe_w)
            self.pipe_r = self.pipe_w = -1

    @property
    def done(self) -> bool:
        return self.eof and self.in_pipe == 0

    def _recv(self) -> int:
        return os.splice(self.src_fd, self.pipe_w, self.PIPE_SIZE, flags=_SPLICE_FLAGS)

    def _readable(self) -> None:
        n = self._received()
        if not n:
            return
        self.in_pipe = n
        self._drain(from_reader=True)

    def _writable(self) -> None:
        self.conn.last_active = self.loop.time()
        self._drain(from_reader=False)

    def _drain(self, from_reader: bool) -> None:
        moved = 0
        while self.in_pipe:
            try:
                m = os.splice(self.pipe_r, self.dst_fd, self.in_pipe, flags=_SPLICE_FLAGS)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.conn.broken(exc, "destination" if self.up else "guest")
                return
            self.in_pipe -= m
            moved += m
        self._count(moved)
        if self.in_pipe:
            if from_reader:
                self.loop.remove_reader(self.src_fd)
                self.writing = True
                self.loop.add_writer(self.dst_fd, self._writable)
        elif not from_reader:
            self.loop.remove_writer(self.dst_fd)
            self.writing = False
            self.loop.add_reader(self.src_fd, self._readable)

    def _finish(self) -> None:
        with contextlib.suppress(OSError):
            self.dst.shutdown(socket.SHUT_WR)
        self.conn.half_closed()
