"""A tiny synchronous NBD client for tests that need to send exact (or broken) traffic.

Real clients (qemu-io, nbdinfo, nbdcopy) cover the normal paths; this one exists to drive
ordering checks and malformed requests that no real client sends.
"""

from __future__ import annotations

import contextlib
import socket
import struct

NBD_MAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
OPT_REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
OPT_GO = 7
CMD_READ, CMD_WRITE, CMD_DISC, CMD_FLUSH, CMD_TRIM = 0, 1, 2, 3, 4
CMD_WRITE_ZEROES = 6
FLAG_FUA = 1


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"server closed the connection ({len(buf)}/{n} bytes read)")
        buf += chunk
    return bytes(buf)


class NbdClient:
    def __init__(self, path: str, export: str | None = "", timeout: float = 20.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self._handle = 0
        magic, opt, _hflags = struct.unpack(">QQH", recv_exact(self.sock, 18))
        assert (magic, opt) == (NBD_MAGIC, IHAVEOPT), "bad greeting"
        self.sock.sendall(struct.pack(">I", 3))  # FIXED_NEWSTYLE | NO_ZEROES
        self.size = 0
        self.tflags = 0
        if export is not None:
            self.go(export)

    def send_option(self, option: int, data: bytes) -> None:
        self.sock.sendall(struct.pack(">QII", IHAVEOPT, option, len(data)) + data)

    def recv_option_reply(self) -> tuple[int, int, bytes]:
        magic, option, reply, length = struct.unpack(">QIII", recv_exact(self.sock, 20))
        assert magic == OPT_REPLY_MAGIC, f"bad option reply magic {magic:#x}"
        return option, reply, recv_exact(self.sock, length)

    def go(self, export: str) -> None:
        name = export.encode()
        self.send_option(OPT_GO, struct.pack(">I", len(name)) + name + struct.pack(">H", 0))
        while True:
            _, reply, data = self.recv_option_reply()
            if reply == 3 and struct.unpack_from(">H", data)[0] == 0:
                _, self.size, self.tflags = struct.unpack(">HQH", data)
            elif reply == 1:
                return
            elif reply & (1 << 31):
                raise ConnectionError(f"GO refused: {reply:#x} {data!r}")

    def request(self, command: int, offset: int, length: int, data: bytes = b"", flags: int = 0) -> tuple[int, bytes]:
        self._handle += 1
        handle = self._handle
        self.sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, flags, command, handle, offset, length) + data)
        magic, error, got = struct.unpack(">IIQ", recv_exact(self.sock, 16))
        assert magic == SIMPLE_REPLY_MAGIC and got == handle, (magic, got, handle)
        payload = recv_exact(self.sock, length) if command == CMD_READ and error == 0 else b""
        return error, payload

    def read(self, offset: int, length: int) -> bytes:
        error, data = self.request(CMD_READ, offset, length)
        if error:
            raise OSError(error, f"NBD read error {error}")
        return data

    def write(self, offset: int, data: bytes, fua: bool = False) -> None:
        error, _ = self.request(CMD_WRITE, offset, len(data), data, FLAG_FUA if fua else 0)
        if error:
            raise OSError(error, f"NBD write error {error}")

    def flush(self) -> None:
        error, _ = self.request(CMD_FLUSH, 0, 0)
        if error:
            raise OSError(error, f"NBD flush error {error}")

    def structured(self) -> None:
        """Ask for structured replies (before go())."""
        self.send_option(8, b"")
        _, reply, _ = self.recv_option_reply()
        assert reply == 1, reply

    def read_chunk(self, offset: int, length: int) -> tuple[int, int, bytes]:
        """A READ under structured replies: (chunk type, error, data)."""
        self._handle += 1
        self.sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_READ, self._handle, offset, length))
        magic, flags, ctype, handle, clen = struct.unpack(">IHHQI", recv_exact(self.sock, 20))
        assert magic == 0x668E33EF and handle == self._handle and flags & 1, (magic, flags, handle)
        payload = recv_exact(self.sock, clen)
        if ctype == 1:
            assert struct.unpack_from(">Q", payload)[0] == offset
            return ctype, 0, payload[8:]
        if ctype == (1 << 15) + 1:
            return ctype, struct.unpack_from(">I", payload)[0], b""
        return ctype, 0, b""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_DISC, 0, 0, 0))
        self.sock.close()
