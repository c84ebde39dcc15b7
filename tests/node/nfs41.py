"""A minimal NFSv4.1 client for the tests of the node's NFS server (node/nfs.py): the host
kernel here has no NFS client and libnfs (nfs-ls, nfs-cat) speaks NFSv4.0 only, which the
server refuses. Written from RFC 5661 (COMPOUND, EXCHANGE_ID, CREATE_SESSION, SEQUENCE) and
RFC 5531 (ONC RPC, AUTH_SYS): one TCP connection, one session, slot 0; list, read, write
and remove files under a path.

    with Nfs41Client("127.0.0.1", port) as nfs:
        nfs.write("/volumes/v/a.txt", b"data")
        nfs.read("/volumes/v/a.txt")
        nfs.listdir("/volumes/v")
"""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
from pathlib import Path
from typing import Any

PROGRAM, VERSION, COMPOUND = 100003, 4, 1
OP_CLOSE, OP_LOOKUP, OP_OPEN, OP_PUTROOTFH, OP_READ, OP_READDIR = 4, 15, 18, 24, 25, 26
OP_SETATTR = 34
OP_REMOVE, OP_WRITE, OP_EXCHANGE_ID, OP_CREATE_SESSION, OP_SEQUENCE = 28, 38, 42, 43, 53
OP_RECLAIM_COMPLETE = 58
NAMES = {10066: "NFS4ERR_REP_TOO_BIG", 10018: "NFS4ERR_RESOURCE", 1: "NFS4ERR_PERM", 2: "NFS4ERR_NOENT", 13: "NFS4ERR_ACCESS", 17: "NFS4ERR_EXIST",
         30: "NFS4ERR_ROFS", 10016: "NFS4ERR_WRONGSEC", 10021: "NFS4ERR_MINOR_VERS_MISMATCH"}


class Nfs4Error(Exception):
    def __init__(self, status: int, op: int) -> None:
        super().__init__(f"{NAMES.get(status, status)} (op {op})")
        self.status = status
        self.name = NAMES.get(status, str(status))


class _Packer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u32(self, v: int) -> _Packer:
        self.parts.append(struct.pack(">I", v))
        return self

    def u64(self, v: int) -> _Packer:
        self.parts.append(struct.pack(">Q", v))
        return self

    def fixed(self, b: bytes) -> _Packer:
        self.parts.append(b + b"\0" * (-len(b) % 4))
        return self

    def opaque(self, b: bytes) -> _Packer:
        return self.u32(len(b)).fixed(b)

    def bytes(self) -> bytes:
        return b"".join(self.parts)


class _Unpacker:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def u32(self) -> int:
        (v,) = struct.unpack_from(">I", self.data, self.pos)
        self.pos += 4
        return int(v)

    def u64(self) -> int:
        (v,) = struct.unpack_from(">Q", self.data, self.pos)
        self.pos += 8
        return int(v)

    def fixed(self, n: int) -> bytes:
        b = self.data[self.pos:self.pos + n]
        self.pos += n + (-n % 4)
        return b

    def opaque(self) -> bytes:
        return self.fixed(self.u32())


def _channel_attrs(p: _Packer) -> None:
    # headerpad, maxrequest, maxresponse, maxresponse_cached, maxoperations, maxrequests, rdma
    for v in (0, 1 << 20, 1 << 20, 8192, 16, 1):
        p.u32(v)
    p.u32(0)


class Nfs41Client:
    def __init__(self, host: str, port: int, *, source: str | None = None,
                 minor_version: int = 1, timeout: float = 10.0) -> None:
        self.host, self.port, self.source = host, port, source
        self.minor = minor_version
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.xid = int.from_bytes(os.urandom(4), "big")
        self.clientid = 0
        self.session = b""
        self.seq = 0

    # -- RPC -----------------------------------------------------------------------------------

    def _call(self, ops: list[tuple[int, bytes]]) -> _Unpacker:
        assert self.sock is not None
        self.xid = (self.xid + 1) & 0xFFFFFFFF
        cred = _Packer().u32(0).opaque(b"aenv-test").u32(0).u32(0).u32(0).bytes()
        p = _Packer().u32(self.xid).u32(0).u32(2).u32(PROGRAM).u32(VERSION).u32(COMPOUND)
        p.u32(1).opaque(cred).u32(0).u32(0)  # AUTH_SYS as root; AUTH_NONE verifier
        p.opaque(b"").u32(self.minor).u32(len(ops))
        for op, args in ops:
            p.u32(op).fixed(args)
        body = p.bytes()
        self.sock.sendall(struct.pack(">I", 0x80000000 | len(body)) + body)
        reply = b""
        while True:
            (mark,) = struct.unpack(">I", self._recv(4))
            reply += self._recv(mark & 0x7FFFFFFF)
            if mark & 0x80000000:
                break
        u = _Unpacker(reply)
        if u.u32() != self.xid or u.u32() != 1 or u.u32() != 0:
            raise ConnectionError("RPC reply not accepted")
        u.u32()
        u.opaque()  # verifier
        if (accept := u.u32()) != 0:
            raise ConnectionError(f"RPC accept status {accept}")
        status = u.u32()
        u.opaque()  # tag
        u.u32()  # results
        if status != 0:
            # the failing op is the last result: walk to it
            failed = ops[-1][0]
            raise Nfs4Error(status, failed)
        return u

    def _recv(self, n: int) -> bytes:
        assert self.sock is not None
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the server closed the connection")
            out += chunk
        return out

    def _sequence(self) -> tuple[int, bytes]:
        self.seq += 1
        return OP_SEQUENCE, (_Packer().fixed(self.session).u32(self.seq).u32(0).u32(0).u32(0)
                             .bytes())

    def _skip_results(self, u: _Unpacker, ops: list[int]) -> None:
        for op in ops:
            assert u.u32() == op
            assert u.u32() == 0
            if op == OP_SEQUENCE:
                u.fixed(36)

    # -- session -------------------------------------------------------------------------------

    def connect(self) -> Nfs41Client:
        self.sock = socket.socket()
        self.sock.settimeout(self.timeout)
        if self.source:
            self.sock.bind((self.source, 0))
        self.sock.connect((self.host, self.port))
        owner = b"aenv-test-" + os.urandom(8).hex().encode()
        args = (_Packer().fixed(os.urandom(8)).opaque(owner).u32(0x00010000).u32(0).u32(0)
                .bytes())
        u = self._call([(OP_EXCHANGE_ID, args)])
        assert u.u32() == OP_EXCHANGE_ID and u.u32() == 0
        self.clientid = u.u64()
        sequence = u.u32()
        p = _Packer().u64(self.clientid).u32(sequence).u32(0)
        _channel_attrs(p)
        _channel_attrs(p)
        p.u32(0x40000000).u32(1).u32(0)  # callback program; one sec parm: AUTH_NONE
        u = self._call([(OP_CREATE_SESSION, p.bytes())])
        assert u.u32() == OP_CREATE_SESSION and u.u32() == 0
        self.session = u.fixed(16)
        self._call([self._sequence(), (OP_RECLAIM_COMPLETE, _Packer().u32(0).bytes())])
        return self

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self) -> Nfs41Client:
        return self.connect() if self.sock is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- files ---------------------------------------------------------------------------------

    def _walk(self, path: str) -> list[tuple[int, bytes]]:
        ops = [(OP_PUTROOTFH, b"")]
        for name in [n for n in path.split("/") if n]:
            ops.append((OP_LOOKUP, _Packer().opaque(name.encode()).bytes()))
        return ops

    def lookup(self, path: str) -> None:
        """Raises Nfs4Error when `path` is not reached (NFS4ERR_NOENT: not exported to us)."""
        self._call([self._sequence(), *self._walk(path)])

    def listdir(self, path: str) -> list[str]:
        walk = self._walk(path)
        args = _Packer().u64(0).fixed(b"\0" * 8).u32(8192).u32(32768).u32(0).bytes()
        u = self._call([self._sequence(), *walk, (OP_READDIR, args)])
        self._skip_results(u, [OP_SEQUENCE] + [op for op, _ in walk])
        assert u.u32() == OP_READDIR and u.u32() == 0
        u.fixed(8)
        names = []
        while u.u32():
            u.u64()
            names.append(u.opaque().decode())
            for _ in range(u.u32()):
                u.u32()
            u.opaque()
        return sorted(names)

    def read(self, path: str, count: int = 1 << 18) -> bytes:
        walk = self._walk(path)
        args = _Packer().u32(0).fixed(b"\0" * 12).u64(0).u32(count).bytes()  # anonymous stateid
        u = self._call([self._sequence(), *walk, (OP_READ, args)])
        self._skip_results(u, [OP_SEQUENCE] + [op for op, _ in walk])
        assert u.u32() == OP_READ and u.u32() == 0
        u.u32()  # eof
        return u.opaque()

    def write(self, path: str, data: bytes) -> None:
        """Create (or open) the file and write `data` at offset 0 (FILE_SYNC), in one compound:
        OPEN, WRITE and CLOSE with the current stateid."""
        parent, _, name = path.rstrip("/").rpartition("/")
        current = _Packer().u32(1).fixed(b"\0" * 12).bytes()
        p = _Packer().u32(0).u32(2).u32(0).u64(self.clientid).opaque(b"owner")
        p.u32(1).u32(0)  # OPEN4_CREATE, UNCHECKED4
        p.u32(2).u32(0).u32(2).opaque(struct.pack(">I", 0o644))  # FATTR4_MODE
        p.u32(0).opaque(name.encode())  # CLAIM_NULL
        write = _Packer().fixed(current).u64(0).u32(2).opaque(data).bytes()
        close = _Packer().u32(0).fixed(current).bytes()
        self._call([self._sequence(), *self._walk(parent), (OP_OPEN, p.bytes()),
                    (OP_WRITE, write), (OP_CLOSE, close)])

    def remove(self, path: str) -> None:
        parent, _, name = path.rstrip("/").rpartition("/")
        self._call([self._sequence(), *self._walk(parent),
                    (OP_REMOVE, _Packer().opaque(name.encode()).bytes())])

    def setattr(self, path: str, *, mode: int | None = None, mtime: int | None = None,
                size: int | None = None, owner: str | None = None,
                group: str | None = None) -> None:
        """SETATTR with the anonymous stateid: mode (chmod), mtime (utime), size (truncate),
        owner and group (chown; numeric strings)."""
        words = [0, 0]
        values = _Packer()
        if size is not None:
            words[0] |= 1 << 4  # FATTR4_SIZE
            values.u64(size)
        if mode is not None:
            words[1] |= 1 << (33 - 32)  # FATTR4_MODE
            values.u32(mode)
        if owner is not None:
            words[1] |= 1 << (36 - 32)  # FATTR4_OWNER
            values.opaque(owner.encode())
        if group is not None:
            words[1] |= 1 << (37 - 32)  # FATTR4_OWNER_GROUP
            values.opaque(group.encode())
        if mtime is not None:
            words[1] |= 1 << (54 - 32)  # FATTR4_TIME_MODIFY_SET: SET_TO_CLIENT_TIME4
            values.u32(1).u64(mtime).u32(0)
        args = _Packer().u32(0).fixed(b"\0" * 12).u32(2).u32(words[0]).u32(words[1])
        args.opaque(values.bytes())
        self._call([self._sequence(), *self._walk(path), (OP_SETATTR, args.bytes())])


def unwalled_port(state_dir: Path) -> int:
    """A port for a test's own ganesha that no VM node on this host walls: a node's host rules
    reset every connection to its NFS port that a slot's redirect did not make (a local one
    too), and a node of another test module (a session's) may have taken the first free port
    below 1024, the default, as this test would."""
    from agentenv.node.nfs import stable_port

    rules = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True,
                           check=False).stdout
    walled = {int(port) for port in re.findall(r"tcp dport (\d+) ct status", rules)}
    first = next(port for port in range(1023, 600, -1) if port not in walled)
    return stable_port(state_dir, first=first)
