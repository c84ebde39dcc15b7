"""An NBD server (fixed newstyle negotiation, structured replies optional) on asyncio streams.

Written from the public protocol description (NetworkBlockDevice/nbd doc/proto.md).

Negotiation: the server greets with NBDMAGIC/IHAVEOPT and the FIXED_NEWSTYLE and NO_ZEROES
handshake flags, then answers options:

- EXPORT_NAME (1): export size and transmission flags, then transmission; an unknown name
  closes the connection (the protocol leaves no other way to refuse it).
- ABORT (2): ACK, then close.
- LIST (3): one SERVER reply per export, then ACK.
- INFO (6) / GO (7): INFO_EXPORT and INFO_BLOCK_SIZE (and NAME/DESCRIPTION when asked),
  then ACK; GO then enters transmission. Unknown export: REP_ERR_UNKNOWN.
- STRUCTURED_REPLY (8): ACK; READ replies are then one OFFSET_DATA (or ERROR) chunk.
- LIST/SET_META_CONTEXT (9/10): the one context is `base:allocation`, served by
  BLOCK_STATUS (holes and zeroed extents report HOLE|ZERO, so qemu-img/nbdcopy copy sparsely).
- STARTTLS, EXTENDED_HEADERS and anything else: REP_ERR_UNSUP. Malformed option payloads:
  REP_ERR_INVALID.

Transmission: READ, WRITE (FUA), DISC, FLUSH, TRIM, WRITE_ZEROES (FUA; NO_HOLE and
FAST_ZERO accepted: zeroing only records a zeroed extent, it is never slow), CACHE (a no-op
success), BLOCK_STATUS (base:allocation). Requests are handled concurrently (replies may come out of order, as the protocol allows), so several
clients and in-flight requests per client work at once. Range errors get EINVAL (reads) or
ENOSPC (writes past the end), writes to a read-only export EPERM, a backend's ENOSPC/EDQUOT
(an upper at its cap, a full host disk) ENOSPC, other backend failures EIO;
none of them drops the connection. Large READ replies may be a list of buffers (slices of the
layers' mmaps, from Image.read_pieces): they leave in one scatter-gather sendmsg, so the data is
copied once, by the kernel. An export with a native core (storage/native.py) gets its
connections' transmission phase run by that core on a thread of its own, GIL released
(`_transmit_native`): negotiation stays here. A request with a bad magic, an unknown command with a
payload, or a write larger than MAX_REQUEST cannot be skipped safely: the server answers
what it can and closes that connection only.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

log = logging.getLogger("agentenv.blockd.nbd")

NBD_MAGIC = 0x4E42444D41474943  # "NBDMAGIC"
IHAVEOPT = 0x49484156454F5054  # "IHAVEOPT"
OPT_REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
STRUCTURED_REPLY_MAGIC = 0x668E33EF

FLAG_FIXED_NEWSTYLE = 1 << 0
FLAG_NO_ZEROES = 1 << 1
CLIENT_FLAG_FIXED_NEWSTYLE = 1 << 0
CLIENT_FLAG_NO_ZEROES = 1 << 1

OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_STARTTLS = 5
OPT_INFO = 6
OPT_GO = 7
OPT_STRUCTURED_REPLY = 8
OPT_LIST_META_CONTEXT = 9
OPT_SET_META_CONTEXT = 10

REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_META_CONTEXT = 4
REP_ERR = 1 << 31
REP_ERR_UNSUP = REP_ERR | 1
REP_ERR_POLICY = REP_ERR | 2
REP_ERR_INVALID = REP_ERR | 3
REP_ERR_UNKNOWN = REP_ERR | 6

INFO_EXPORT = 0
INFO_NAME = 1
INFO_DESCRIPTION = 2
INFO_BLOCK_SIZE = 3

TFLAG_HAS_FLAGS = 1 << 0
TFLAG_READ_ONLY = 1 << 1
TFLAG_SEND_FLUSH = 1 << 2
TFLAG_SEND_FUA = 1 << 3
TFLAG_SEND_TRIM = 1 << 5
TFLAG_SEND_WRITE_ZEROES = 1 << 6
TFLAG_CAN_MULTI_CONN = 1 << 8
TFLAG_SEND_CACHE = 1 << 10
TFLAG_SEND_FAST_ZERO = 1 << 11

CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3
CMD_TRIM = 4
CMD_CACHE = 5
CMD_WRITE_ZEROES = 6
CMD_BLOCK_STATUS = 7

CMD_FLAG_FUA = 1 << 0
CMD_FLAG_NO_HOLE = 1 << 1
CMD_FLAG_REQ_ONE = 1 << 3
CMD_FLAG_FAST_ZERO = 1 << 4

REPLY_FLAG_DONE = 1 << 0
REPLY_TYPE_NONE = 0
REPLY_TYPE_OFFSET_DATA = 1
REPLY_TYPE_BLOCK_STATUS = 5
REPLY_TYPE_ERROR = (1 << 15) + 1

BASE_ALLOCATION = "base:allocation"
BASE_ALLOCATION_ID = 1
STATE_HOLE = 1 << 0
STATE_ZERO = 1 << 1

EPERM = 1
EIO = 5
ENOMEM = 12
EINVAL = 22
ENOSPC = 28
EOVERFLOW = 75
ENOTSUP = 95
ESHUTDOWN = 108

MAX_OPTION_LENGTH = 64 * 1024
MAX_REQUEST = 32 * 1024 * 1024
PREFERRED_BLOCK = 4096
SOCKET_BUFFER = 4 * 1024 * 1024
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
CORK_JOIN_MAX = 256 * 1024
try:
    IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
except (ValueError, OSError):
    IOV_MAX = 16

Buffer = bytes | bytearray | memoryview

_REQUEST = struct.Struct(">IHHQQI")
_REPLY = struct.Struct(">IIQ")
_CHUNK = struct.Struct(">IHHQI")
_OPT_HEADER = struct.Struct(">QII")
_OPT_REPLY = struct.Struct(">QIII")


class Export(Protocol):
    """What the server needs from a disk. The async methods raise OSError or an
    AgentEnvError on failure; the server turns that into an NBD error reply."""

    @property
    def size(self) -> int: ...

    @property
    def readonly(self) -> bool: ...

    @property
    def description(self) -> str: ...

    async def read(self, offset: int, length: int) -> bytes: ...

    def read_now(self, offset: int, length: int) -> bytes | list[Buffer] | None:
        """The bytes right away (or buffers to send one after the other, e.g. slices of
        mmaps), or None when the read must go through `read` (off-loop)."""
        ...

    def write_now(self, offset: int, data: bytes) -> bool:
        """Write right away (no FUA); False when the write must go through `write`."""
        ...

    async def write(self, offset: int, data: bytes, fua: bool) -> None: ...

    async def flush(self) -> None: ...

    async def block_status(self, offset: int, length: int) -> list[tuple[int, bool]]:
        """(length, has_data) runs covering [offset, offset+length), in order."""
        ...

    async def trim(self, offset: int, length: int, fua: bool) -> None: ...

    async def write_zeroes(self, offset: int, length: int, fua: bool) -> None: ...

    def connection_opened(self) -> None: ...

    def connection_closed(self) -> None: ...

    def count_error(self) -> None: ...


class ExportTable(Protocol):
    def lookup(self, name: str) -> Export | None: ...

    def names(self) -> Iterable[str]: ...


class NbdProtocolError(Exception):
    """The peer broke the protocol in a way that leaves the stream unusable."""


def errno_for(exc: BaseException) -> int:
    """The NBD error code for an exception raised by a backend."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ENOSPC
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return ENOMEM
    if isinstance(exc, MemoryError):
        return ENOMEM
    return EIO


class NbdConnection:
    """One client connection: negotiation, then the transmission loop."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        exports: ExportTable,
        peer: str = "",
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.exports = exports
        self.peer = peer
        self.export: Export | None = None
        self.export_name = ""
        self._no_zeroes = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._structured = False
        self._base_allocation = False
        # Our own handle on the connection's socket (a dup: asyncio's TransportSocket offers
        # no sendmsg) for scatter-gather sends of large replies; see _flush_out.
        self._sock: socket.socket | None = None
        transport_sock = writer.get_extra_info("socket")
        if transport_sock is not None and transport_sock.type == socket.SOCK_STREAM:
            with contextlib.suppress(OSError):
                self._sock = socket.socket(fileno=os.dup(transport_sock.fileno()))
                self._sock.setblocking(False)

    # -- negotiation -------------------------------------------------------------------------

    async def _send_opt_reply(self, option: int, reply: int, data: bytes = b"") -> None:
        self.writer.write(_OPT_REPLY.pack(OPT_REPLY_MAGIC, option, reply, len(data)) + data)
        await self.writer.drain()

    def _tflags(self, export: Export) -> int:
        flags = (
            TFLAG_HAS_FLAGS
            | TFLAG_SEND_FLUSH
            | TFLAG_SEND_FUA
            | TFLAG_SEND_CACHE
            | TFLAG_CAN_MULTI_CONN
        )
        if export.readonly:
            flags |= TFLAG_READ_ONLY
        else:
            flags |= TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO
        return flags

    async def negotiate(self) -> bool:
        """Run option haggling; True when transmission should begin."""
        self.writer.write(struct.pack(">QQH", NBD_MAGIC, IHAVEOPT, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))
        await self.writer.drain()
        (client_flags,) = struct.unpack(">I", await self.reader.readexactly(4))
        if client_flags & ~(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES):
            raise NbdProtocolError(f"unknown client flags {client_flags:#x}")
        self._no_zeroes = bool(client_flags & CLIENT_FLAG_NO_ZEROES)
        while True:
            magic, option, length = _OPT_HEADER.unpack(await self.reader.readexactly(16))
            if magic != IHAVEOPT:
                raise NbdProtocolError(f"bad option magic {magic:#x}")
            if length > MAX_OPTION_LENGTH:
                raise NbdProtocolError(f"option {option} payload of {length} bytes is too long")
            data = await self.reader.readexactly(length)
            if option == OPT_EXPORT_NAME:
                name = data.decode("utf-8", "replace")
                export = self.exports.lookup(name)
                if export is None:
                    raise NbdProtocolError(f"unknown export {name!r} requested by EXPORT_NAME")
                self.export, self.export_name = export, name
                reply = struct.pack(">QH", export.size, self._tflags(export))
                if not self._no_zeroes:
                    reply += bytes(124)
                self.writer.write(reply)
                await self.writer.drain()
                return True
            if option == OPT_ABORT:
                await self._send_opt_reply(option, REP_ACK)
                return False
            if option == OPT_LIST:
                if data:
                    await self._send_opt_reply(option, REP_ERR_INVALID, b"LIST takes no data")
                    continue
                for name in self.exports.names():
                    raw = name.encode()
                    await self._send_opt_reply(option, REP_SERVER, struct.pack(">I", len(raw)) + raw)
                await self._send_opt_reply(option, REP_ACK)
                continue
            if option in (OPT_INFO, OPT_GO):
                if await self._info_or_go(option, data):
                    return True
                continue
            if option == OPT_STRUCTURED_REPLY:
                if data:
                    await self._send_opt_reply(option, REP_ERR_INVALID, b"STRUCTURED_REPLY takes no data")
                    continue
                self._structured = True
                await self._send_opt_reply(option, REP_ACK)
                continue
            if option in (OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT):
                await self._meta_context(option, data)
                continue
            await self._send_opt_reply(option, REP_ERR_UNSUP, f"option {option} is not supported".encode())

    async def _meta_context(self, option: int, data: bytes) -> None:
        """LIST/SET_META_CONTEXT: the one context served is base:allocation."""
        if not self._structured:
            await self._send_opt_reply(option, REP_ERR_INVALID, b"negotiate STRUCTURED_REPLY first")
            return
        try:
            (name_length,) = struct.unpack_from(">I", data, 0)
            pos = 4 + name_length
            name = data[4:pos].decode("utf-8", "replace")
            (count,) = struct.unpack_from(">I", data, pos)
            pos += 4
            queries = []
            for _ in range(count):
                (qlen,) = struct.unpack_from(">I", data, pos)
                queries.append(data[pos + 4 : pos + 4 + qlen].decode("utf-8", "replace"))
                pos += 4 + qlen
            if pos != len(data):
                raise ValueError("trailing bytes")
        except (struct.error, ValueError):
            await self._send_opt_reply(option, REP_ERR_INVALID, b"malformed meta context request")
            return
        if self.exports.lookup(name) is None:
            await self._send_opt_reply(option, REP_ERR_UNKNOWN, f"no export named {name!r}".encode())
            return
        wanted = any(q in (BASE_ALLOCATION, "base:") for q in queries) or (
            option == OPT_LIST_META_CONTEXT and not queries
        )
        if wanted:
            await self._send_opt_reply(
                option, REP_META_CONTEXT,
                struct.pack(">I", BASE_ALLOCATION_ID) + BASE_ALLOCATION.encode(),
            )
        if option == OPT_SET_META_CONTEXT:
            self._base_allocation = wanted
        await self._send_opt_reply(option, REP_ACK)

    async def _info_or_go(self, option: int, data: bytes) -> bool:
        if len(data) < 6:
            await self._send_opt_reply(option, REP_ERR_INVALID, b"truncated INFO/GO request")
            return False
        (name_length,) = struct.unpack_from(">I", data, 0)
        if 4 + name_length + 2 > len(data):
            await self._send_opt_reply(option, REP_ERR_INVALID, b"export name overruns the option")
            return False
        name = data[4 : 4 + name_length].decode("utf-8", "replace")
        (n_requests,) = struct.unpack_from(">H", data, 4 + name_length)
        if 4 + name_length + 2 + 2 * n_requests != len(data):
            await self._send_opt_reply(option, REP_ERR_INVALID, b"bad information request list")
            return False
        requested = set(struct.unpack_from(f">{n_requests}H", data, 6 + name_length))
        export = self.exports.lookup(name)
        if export is None:
            await self._send_opt_reply(option, REP_ERR_UNKNOWN, f"no export named {name!r}".encode())
            return False
        await self._send_opt_reply(
            option, REP_INFO, struct.pack(">HQH", INFO_EXPORT, export.size, self._tflags(export))
        )
        await self._send_opt_reply(
            option, REP_INFO, struct.pack(">HIII", INFO_BLOCK_SIZE, 1, PREFERRED_BLOCK, MAX_REQUEST)
        )
        if INFO_NAME in requested:
            await self._send_opt_reply(option, REP_INFO, struct.pack(">H", INFO_NAME) + name.encode())
        if INFO_DESCRIPTION in requested and export.description:
            await self._send_opt_reply(
                option, REP_INFO, struct.pack(">H", INFO_DESCRIPTION) + export.description.encode()
            )
        await self._send_opt_reply(option, REP_ACK)
        if option == OPT_GO:
            self.export, self.export_name = export, name
            return True
        return False

    # -- transmission ------------------------------------------------------------------------

    def _reply(self, handle: int, error: int, data: bytes | list[Buffer] | None = None,
               read_at: int | None = None) -> None:
        # Replies are corked: queued here, and sent by _flush_out once no further request
        # is already buffered, so a burst of queued requests costs one send() rather than
        # one per reply (send was the largest cost per request). Header and payload are
        # queued together, so replies never interleave.
        if self._structured and read_at is not None:
            self._read_chunk(handle, error, data, read_at)
            return
        self._out.append(_REPLY.pack(SIMPLE_REPLY_MAGIC, error, handle))
        if data:
            self._queue_data(data)

    def _queue_data(self, data: bytes | list[Buffer], length: int | None = None) -> None:
        if isinstance(data, list):
            self._out.extend(data)
            self._out_bytes += sum(map(len, data)) if length is None else length
        else:
            self._out.append(data)
            self._out_bytes += len(data)

    def _read_chunk(self, handle: int, error: int, data: bytes | list[Buffer] | None,
                    offset: int) -> None:
        """A READ reply once structured replies are on: one final data (or error) chunk."""
        if error:
            message = b"request failed"
            payload = struct.pack(">IH", error, len(message)) + message
            self._out.append(_CHUNK.pack(STRUCTURED_REPLY_MAGIC, REPLY_FLAG_DONE, REPLY_TYPE_ERROR,
                                         handle, len(payload)) + payload)
        elif not data:
            self._out.append(_CHUNK.pack(STRUCTURED_REPLY_MAGIC, REPLY_FLAG_DONE, REPLY_TYPE_NONE,
                                         handle, 0))
        else:
            length = sum(map(len, data)) if isinstance(data, list) else len(data)
            self._out.append(_CHUNK.pack(STRUCTURED_REPLY_MAGIC, REPLY_FLAG_DONE,
                                         REPLY_TYPE_OFFSET_DATA, handle, 8 + length)
                             + struct.pack(">Q", offset))
            self._queue_data(data, length)

    def _status_chunk(self, handle: int, runs: list[tuple[int, bool]], one: bool) -> None:
        descriptors = []
        for length, has_data in runs[:1] if one else runs:
            state = 0 if has_data else STATE_HOLE | STATE_ZERO
            descriptors.append(struct.pack(">II", length, state))
        payload = struct.pack(">I", BASE_ALLOCATION_ID) + b"".join(descriptors)
        self._out.append(_CHUNK.pack(STRUCTURED_REPLY_MAGIC, REPLY_FLAG_DONE,
                                     REPLY_TYPE_BLOCK_STATUS, handle, len(payload)) + payload)

    def _flush_out(self) -> None:
        out, self._out = self._out, []
        size, self._out_bytes = self._out_bytes, 0
        if not out or self.writer.is_closing():
            return
        if size <= CORK_JOIN_MAX:
            self.writer.write(b"".join(out))
            return
        start = 0
        if self._sock is not None and not self.writer.transport.get_write_buffer_size():
            start = self._send_direct(out)
        for piece in out[start:]:  # what the socket did not take: the transport buffers it
            self.writer.write(piece)

    def _send_direct(self, out: list[Buffer]) -> int:
        """Big replies go out with sendmsg, headers and payload pieces (mmap slices) in one
        scatter-gather call, so the payload is copied once, by the kernel. Only while the
        transport has nothing buffered (order). Returns the index in `out` of the first piece
        not fully sent; a partly sent one is replaced in `out` by its unsent tail."""
        assert self._sock is not None
        i = 0
        while i < len(out):
            batch = out[i : i + IOV_MAX]
            try:
                sent = self._sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                return i
            except OSError:
                return i  # the transport's own write meets the error and closes the connection
            for piece in batch:
                n = len(piece)
                if sent < n:
                    if sent:
                        out[i] = memoryview(piece)[sent:]
                    return i
                sent -= n
                i += 1
        return i

    async def _run(self, coro_fn: Callable[[], object], handle: int, export: Export,
                   read_at: int | None = None, status_one: bool | None = None) -> None:
        try:
            result = await coro_fn()  # type: ignore[misc]
        except Exception as exc:
            self._backend_failed(export, exc)
            if status_one is not None:
                # A BLOCK_STATUS error goes back as a structured error chunk too.
                self._read_chunk(handle, errno_for(exc), None, 0)
            else:
                self._reply(handle, errno_for(exc), read_at=read_at)
        else:
            if status_one is not None:
                self._status_chunk(handle, result, status_one)  # type: ignore[arg-type]
            else:
                self._reply(handle, 0, result if isinstance(result, (bytes, bytearray)) else None,
                            read_at=read_at)
        self._flush_out()
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()

    def _spawn(self, coro_fn: Callable[[], object], handle: int, export: Export,
               read_at: int | None = None, status_one: bool | None = None) -> None:
        task = asyncio.get_running_loop().create_task(
            self._run(coro_fn, handle, export, read_at, status_one)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _transmit_native(self, export: Export, core: Any) -> None:
        """Hand the connection to the native core: a thread runs the transmission loop with
        the GIL released until the client leaves or the socket is shut down (cut())."""
        # The thread owns our duplicate of the socket from here and closes it when done, so
        # its descriptor number cannot be reused under it.
        sock, self._sock = self._sock, None
        assert sock is not None
        self.writer.transport.pause_reading()
        # Requests the client sent right after negotiating may already sit in the reader.
        buffered = bytes(getattr(self.reader, "_buffer", b""))
        if buffered:
            self.reader._buffer.clear()  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()
        done: asyncio.Future[str] = loop.create_future()
        fd = sock.fileno()

        def finish(outcome: str | BaseException) -> None:
            if done.done():
                return
            if isinstance(outcome, BaseException):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)

        def run() -> None:
            try:
                outcome: str | BaseException = core.serve(
                    fd, buffered, self._structured, self._base_allocation, export.readonly,
                    f"nbd:{self.export_name}")
            except BaseException as exc:
                outcome = exc
            finally:
                sock.close()
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(finish, outcome)

        threading.Thread(target=run, name=f"nbd:{self.export_name}", daemon=True).start()
        collect = getattr(export, "collect_native_stats", None)
        try:
            while not done.done():
                await asyncio.wait({done}, timeout=1.0)
                if collect is not None:
                    collect()
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):  # ends the thread (closed already: EBADF)
                sock.shutdown(socket.SHUT_RDWR)
            raise
        reason = done.result()
        if reason.startswith("protocol"):
            raise NbdProtocolError(reason)
        if reason.startswith("error"):
            raise ConnectionError(reason)

    async def transmit(self) -> None:
        export = self.export
        assert export is not None
        core = getattr(export, "native_core", None)
        if core is not None and self._sock is not None:
            await self._transmit_native(export, core)
            return
        reader = self.reader
        while True:
            header = await reader.readexactly(28)
            magic, flags, command, handle, offset, length = _REQUEST.unpack(header)
            if magic != REQUEST_MAGIC:
                raise NbdProtocolError(f"bad request magic {magic:#x}")
            size = export.size
            if command == CMD_WRITE:
                if length > MAX_REQUEST:
                    export.count_error()
                    self._reply(handle, EINVAL)
                    self._flush_out()
                    await self.writer.drain()
                    raise NbdProtocolError(f"write of {length} bytes exceeds {MAX_REQUEST}")
                data = await reader.readexactly(length)
                if export.readonly:
                    self._error(export, handle, EPERM)
                elif offset + length > size:
                    self._error(export, handle, ENOSPC)
                elif not flags & CMD_FLAG_FUA and self._now(export.write_now, handle, export, offset, data):
                    pass
                else:
                    fua = bool(flags & CMD_FLAG_FUA)
                    self._spawn(lambda o=offset, d=data, f=fua: export.write(o, d, f), handle, export)
            elif command == CMD_READ:
                if length > MAX_REQUEST:
                    self._error(export, handle, EOVERFLOW, read_at=offset)
                elif offset + length > size:
                    self._error(export, handle, EINVAL, read_at=offset)
                elif length == 0:
                    self._reply(handle, 0, read_at=offset)
                elif not self._now(export.read_now, handle, export, offset, length, read_at=offset):
                    self._spawn(lambda o=offset, n=length: export.read(o, n), handle, export,
                                read_at=offset)
            elif command == CMD_BLOCK_STATUS and self._base_allocation:
                if offset + length > size or length == 0:
                    self._status_error(export, handle, EINVAL)
                else:
                    self._spawn(lambda o=offset, n=length: export.block_status(o, n), handle,
                                export, status_one=bool(flags & CMD_FLAG_REQ_ONE))
            elif command == CMD_FLUSH:
                self._spawn(export.flush, handle, export)
            elif command in (CMD_TRIM, CMD_WRITE_ZEROES):
                if export.readonly:
                    self._error(export, handle, EPERM)
                elif offset + length > size:
                    self._error(export, handle, ENOSPC)
                else:
                    fua = bool(flags & CMD_FLAG_FUA)
                    method = export.trim if command == CMD_TRIM else export.write_zeroes
                    self._spawn(lambda m=method, o=offset, n=length, f=fua: m(o, n, f), handle, export)
            elif command == CMD_CACHE:
                if offset + length > size:
                    self._error(export, handle, EINVAL)
                else:
                    self._reply(handle, 0)
            elif command == CMD_DISC:
                return
            else:
                # Unknown commands carry no payload we could know the size of; refuse and go on.
                self._error(export, handle, EINVAL)
            # StreamReader keeps unread input in `_buffer` (CPython); when the next request
            # is not already there, send what is queued before waiting for it.
            if len(getattr(reader, "_buffer", b"")) < _REQUEST.size:
                self._flush_out()
                if self.writer.transport.get_write_buffer_size() > 4 * MAX_REQUEST:
                    await self.writer.drain()

    def _now(self, fn: Callable[[int, object], object], handle: int, export: Export,
             offset: int, arg: object, read_at: int | None = None) -> bool:
        """Try the request on the spot (small I/O against the page cache costs less than a
        thread hop); False when the export wants it done off the event loop."""
        try:
            result = fn(offset, arg)
        except Exception as exc:
            self._backend_failed(export, exc)
            self._reply(handle, errno_for(exc), read_at=read_at)
            return True
        if result is None or result is False:
            return False
        self._reply(handle, 0, result if isinstance(result, (bytes, bytearray, list)) else None,
                    read_at=read_at)
        return True

    def _backend_failed(self, export: Export, exc: Exception) -> None:
        export.count_error()
        # A full disk is the guest's doing and comes in floods; the export counts and logs
        # it (rate-limited). Anything else is worth a line each.
        level = logging.DEBUG if errno_for(exc) == ENOSPC else logging.WARNING
        log.log(level, "backend request failed",
                extra={"export": self.export_name, "error": str(exc), "peer": self.peer})

    def _error(self, export: Export, handle: int, error: int, read_at: int | None = None) -> None:
        export.count_error()
        self._reply(handle, error, read_at=read_at)

    def _status_error(self, export: Export, handle: int, error: int) -> None:
        export.count_error()
        self._read_chunk(handle, error, None, 0)

    async def serve(self) -> None:
        try:
            if not await self.negotiate():
                return
            assert self.export is not None
            self.export.connection_opened()
            try:
                await self.transmit()
            finally:
                # Finish in-flight requests before closing, as DISC requires.
                if self._tasks:
                    await asyncio.gather(*self._tasks, return_exceptions=True)
                if not self.export.readonly:
                    with contextlib.suppress(Exception):
                        await self.export.flush()
                self.export.connection_closed()
        except asyncio.IncompleteReadError:
            log.debug("client went away", extra={"peer": self.peer, "export": self.export_name})
        except (ConnectionError, BrokenPipeError):
            log.debug("connection reset", extra={"peer": self.peer, "export": self.export_name})
        except NbdProtocolError as exc:
            log.warning(
                "protocol error, closing connection",
                extra={"peer": self.peer, "export": self.export_name, "error": str(exc)},
            )
        finally:
            with contextlib.suppress(Exception):
                self._flush_out()
                self.writer.close()
                await self.writer.wait_closed()
            if self._sock is not None:
                self._sock.close()


def cut(writer: asyncio.StreamWriter) -> None:
    """Close a client connection now, also when a native thread serves it (the shutdown
    wakes that thread; closing our descriptor alone would not)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    writer.transport.abort()


class SingleExportTable:
    """The table of a socket that serves one disk: the empty name and `name` both select it."""

    def __init__(self, name: str, export: Export) -> None:
        self.name = name
        self.export = export

    def lookup(self, name: str) -> Export | None:
        return self.export if name in ("", self.name) else None

    def names(self) -> list[str]:
        return [self.name]


async def start_unix_server(
    path: str, exports: ExportTable, connections: set[asyncio.StreamWriter] | None = None
) -> asyncio.AbstractServer:
    """Listen on a unix socket; every connection gets its own NbdConnection. Open
    connections are kept in `connections` (when given) so their owner can cut them."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if connections is not None:
            connections.add(writer)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # Room for several large replies in the kernel, so a 1 MiB read goes out in one
            # send() instead of being copied into the transport's buffer. SO_SNDBUF is capped
            # by net.core.wmem_max; root may force past it.
            for force, plain in ((SO_SNDBUFFORCE, socket.SO_SNDBUF), (SO_RCVBUFFORCE, socket.SO_RCVBUF)):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, force, SOCKET_BUFFER)
                except OSError:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, plain, SOCKET_BUFFER)
        try:
            await NbdConnection(reader, writer, exports, peer=path).serve()
        finally:
            if connections is not None:
                connections.discard(writer)

    return await asyncio.start_unix_server(on_connect, path=path, limit=MAX_REQUEST * 2)
