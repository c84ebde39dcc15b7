"""Clients of the blockd control socket (JSON lines, rpc.py; the operations are in daemon.py,
their answers in results.py)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any, Protocol

from agentenv.blockd.errors import BlockdError, BlockdUnavailable
from agentenv.blockd.results import DeviceInfo, Released, Sealed
from agentenv.settings import get_settings


def aenv_home() -> Path:
    """The state directory: $AENV_HOME (older name $AENV_STATE_DIR), else /var/lib/aenv."""
    return get_settings().state_home


def default_socket() -> Path:
    """Where `make up` (scripts/up.sh) starts blockd's control socket: <home>/blockd/blockd.sock
    ($AENV_BLOCKD_SOCKET overrides). The one default of every `aenv` blockd command."""
    return get_settings().blockd_socket or aenv_home() / "blockd" / "blockd.sock"


def default_state_dir() -> Path:
    """blockd's state directory as `make up` starts it: <home>/blockd/state."""
    return aenv_home() / "blockd" / "state"


DEFAULT_SOCKET = default_socket()


def _request_line(op: str, args: dict[str, Any]) -> bytes:
    clean = {k: (str(v) if isinstance(v, Path) else v) for k, v in args.items() if v is not None}
    if "lowers" in clean:
        clean["lowers"] = [str(p) for p in clean["lowers"]]
    return (json.dumps({"op": op, **clean}) + "\n").encode()


def _parse_answer(line: bytes, op: str) -> Any:
    if not line:
        raise BlockdError(f"blockd closed the connection during {op!r}")
    answer = json.loads(line)
    if not answer.get("ok"):
        raise BlockdError(f"blockd {op}: {answer.get('error', 'unknown error')}")
    return answer.get("result")


class DiskService(Protocol):
    """What a VM runtime needs of blockd (AsyncBlockdClient is one): its control socket (the
    memory devices' client connects there too) and a device's create, seal and release."""

    socket_path: Path

    async def create(self, image: Path | None = None, lowers: list[Path] | None = None,
                     upper_dir: Path | None = None, size: int | None = None,
                     readonly: bool = False, owner: int | None = None,
                     chain_used: int | None = None) -> DeviceInfo: ...

    async def seal(self, id: str, output: Path | None = None) -> Sealed: ...

    async def release(self, id: str) -> int: ...


class BlockdClient:
    """Synchronous client; one connection, reopened when lost. Not thread-safe."""

    def __init__(self, socket_path: Path | str = DEFAULT_SOCKET, timeout: float = 60.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._file: Any = None

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.socket_path))
        except OSError as exc:
            sock.close()
            raise BlockdUnavailable(
                f"cannot reach blockd at {self.socket_path}: {exc.strerror or exc} "
                "(is `aenv blockd` running?)"
            ) from exc
        self._sock, self._file = sock, sock.makefile("rb")

    def close(self) -> None:
        if self._sock is not None:
            self._file.close()
            self._sock.close()
            self._sock = self._file = None

    def __enter__(self) -> BlockdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, op: str, **args: Any) -> Any:
        line = _request_line(op, args)
        for attempt in (0, 1):
            if self._sock is None:
                self._connect()
            assert self._sock is not None
            try:
                self._sock.sendall(line)
                answer = self._file.readline()
            except (BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt:
                    raise
                continue
            if not answer and attempt == 0 and op not in ("shutdown",):
                self.close()
                continue
            return _parse_answer(answer, op)
        raise BlockdError(f"blockd {op}: no answer")

    def ping(self) -> dict[str, Any]:
        return dict(self.call("ping"))

    def create(
        self,
        image: Path | None = None,
        lowers: list[Path] | None = None,
        upper_dir: Path | None = None,
        size: int | None = None,
        readonly: bool = False,
        upper_limit: int | None = None,
        owner: int | None = None,
        chain_used: int | None = None,
    ) -> DeviceInfo:
        """upper_limit: cap on the disk's own writes in bytes, 0 for none; None: the daemon's
        default (--upper-limit). owner: the uid (= gid) alone allowed to connect (a writable
        device of a jailed QEMU). chain_used: bytes of the disk's own sealed uppers among
        `lowers` (Sealed.chain_used of its last seal), counted against the cap (None: none)."""
        return DeviceInfo.from_json(
            self.call("create", image=image, lowers=lowers, upper_dir=upper_dir, size=size,
                      readonly=readonly, upper_limit=upper_limit, owner=owner,
                      chain_used=chain_used)
        )

    def create_blank(self, size: int, upper_dir: Path | None = None) -> DeviceInfo:
        return DeviceInfo.from_json(self.call("create_blank", size=size, upper_dir=upper_dir))

    def snapshot(self, id: str, output: Path | None = None) -> Path:
        return Path(Sealed.from_json(self.call("snapshot", id=id, output=output)).layer)

    def resize(self, id: str, size: int) -> DeviceInfo:
        return DeviceInfo.from_json(self.call("resize", id=id, size=size))

    def release(self, id: str) -> int:
        """Release a device; returns the remaining refcount (0: it is gone or back in the pool)."""
        return Released.from_json(self.call("release", id=id)).refcount

    def list(self) -> list[DeviceInfo]:
        return [DeviceInfo.from_json(d) for d in self.call("list")]

    def shutdown(self) -> None:
        self.call("shutdown")


class AsyncBlockdClient:
    """The same operations for asyncio callers (one connection, requests serialized)."""

    def __init__(self, socket_path: Path | str = DEFAULT_SOCKET) -> None:
        self.socket_path = Path(socket_path)
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()

    async def call(self, op: str, **args: Any) -> Any:
        line = _request_line(op, args)
        async with self._lock:
            # A connection left from before a daemon restart fails on first use: reconnect
            # once and resend.
            for attempt in (0, 1):
                reader, writer = await self._connect()
                try:
                    writer.write(line)
                    await writer.drain()
                    answer = await reader.readline()
                except (ConnectionError, BrokenPipeError):
                    answer = b""
                if answer or attempt or op == "shutdown":
                    if not answer:
                        self._streams = None
                    return _parse_answer(answer, op)
                writer.close()
                self._streams = None
        raise BlockdError(f"blockd {op}: no answer")

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._streams is None:
            try:
                self._streams = await asyncio.open_unix_connection(
                    str(self.socket_path), limit=16 * 1024 * 1024
                )
            except OSError as exc:
                raise BlockdUnavailable(
                    f"cannot reach blockd at {self.socket_path}: {exc.strerror or exc}"
                ) from exc
        return self._streams

    async def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None

    async def create(self, image: Path | None = None, lowers: list[Path] | None = None,
                     upper_dir: Path | None = None, size: int | None = None,
                     readonly: bool = False, owner: int | None = None,
                     chain_used: int | None = None) -> DeviceInfo:
        """owner: as BlockdClient.create. chain_used: bytes of the disk's own sealed uppers
        among `lowers` (Sealed.chain_used of its last seal), counted against its cap (None:
        none)."""
        return DeviceInfo.from_json(await self.call(
            "create", image=image, lowers=lowers, upper_dir=upper_dir, size=size, readonly=readonly,
            owner=owner, chain_used=chain_used))

    async def create_blank(self, size: int, upper_dir: Path | None = None) -> DeviceInfo:
        return DeviceInfo.from_json(await self.call("create_blank", size=size, upper_dir=upper_dir))

    async def snapshot(self, id: str, output: Path | None = None) -> Path:
        return Path((await self.seal(id, output)).layer)

    async def seal(self, id: str, output: Path | None = None) -> Sealed:
        """`snapshot`, with what the disk's own sealed uppers now hold."""
        return Sealed.from_json(await self.call("snapshot", id=id, output=output))

    async def resize(self, id: str, size: int) -> DeviceInfo:
        return DeviceInfo.from_json(await self.call("resize", id=id, size=size))

    async def release(self, id: str) -> int:
        return Released.from_json(await self.call("release", id=id)).refcount

    async def list(self) -> list[DeviceInfo]:
        return [DeviceInfo.from_json(d) for d in await self.call("list")]
