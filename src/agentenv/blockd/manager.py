"""blockd's device manager: the devices, their records on disk, and the uppers the daemon owns.

    <state>/devices/<id>.json   one record per device (what to reopen after a restart)
    <state>/nbd/<id>.sock       the device's NBD socket; export name = <id> (the empty name works too)
    <state>/uppers/<id>/        writable uppers the daemon made itself (no upper_dir given)
    <state>/fuse/<id>           the device as a regular file (one FUSE mount at fuse/, run by the daemon)

Kinds of device (DeviceRecord.kind):
- "disk": writable, its own upper (in the caller's upper_dir, or one the daemon owns) over an
  image's layers; flushed when its last connection goes, on release and on shutdown.
- "shared": read-only, one per source, refcounted (creating it again returns the same device
  with refcount+1; each release drops one).

A new kind is: a create method here (built on `_start_device`, `_share` for refcounted ones),
its reopen entry in `DeviceManager.reopen` (how a restarted daemon brings it back from its
record) and its operation in daemon.py's table. Operations return typed records (results.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.blockd import images, nbd
from agentenv.blockd.access import grant_nbd_socket
from agentenv.blockd.device import INLINE_MAX, Device, DeviceRecord, ImageLike
from agentenv.blockd.errors import BlockdError, NotFound
from agentenv.blockd.metrics import Metrics
from agentenv.blockd.results import DeviceInfo, Released, Sealed
from agentenv.fsutil import atomic_write_json

log = logging.getLogger("agentenv.blockd")

Reopen = Callable[[DeviceRecord], Awaitable[ImageLike]]


@dataclass(frozen=True)
class StateLayout:
    """Where the manager keeps what it owns under the daemon's state directory."""

    root: Path

    @property
    def records(self) -> Path:
        return self.root / "devices"

    @property
    def nbd(self) -> Path:
        return self.root / "nbd"

    @property
    def uppers(self) -> Path:
        return self.root / "uppers"

    @property
    def fuse(self) -> Path:
        return self.root / "fuse"


class DeviceManager:
    def __init__(
        self,
        layout: StateLayout,
        executor: Executor,
        *,
        inline_max: int = INLINE_MAX,
        upper_limit: int | None = None,
    ) -> None:
        self.layout = layout
        self.executor = executor
        self.inline_max = inline_max
        self.upper_limit = check_limit(upper_limit)
        self.devices: dict[str, Device] = {}
        self.metrics: Metrics | None = None  # set by the daemon before the first device
        self.fuse = False  # the daemon serves devices as files under layout.fuse
        self._shared: dict[tuple[str, str], str] = {}  # (kind, source) -> refcounted device
        self._lock = asyncio.Lock()  # creates and releases, one at a time
        # How a restarted daemon reopens each kind of device from its record.
        self.reopen: dict[str, Reopen] = {"disk": self._reopen_image, "shared": self._reopen_image}
        #: called with the source of each refcounted read-only device that goes away (memory
        #: devices drop their image config then: blockd/memdev.py)
        self.on_unshared: list[Callable[[str], None]] = []

    # -- records ------------------------------------------------------------------------------

    def _save(self, record: DeviceRecord) -> None:
        # A restarted daemon reopens exactly what these records say: they must never be torn.
        atomic_write_json(self.layout.records / f"{record.id}.json", record.to_json(), indent=1)

    def _forget(self, device_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.layout.records / f"{device_id}.json").unlink()

    def _new_id(self) -> str:
        while True:
            device_id = "d" + secrets.token_hex(5)
            if device_id not in self.devices:
                return device_id

    def _socket_for(self, device_id: str) -> str:
        return str(self.layout.nbd / f"{device_id}.sock")

    async def _in_thread(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    # -- recovery -----------------------------------------------------------------------------

    async def recover(self) -> None:
        """Bring back the devices of the previous run from their records."""
        for path in sorted(self.layout.records.glob("*.json")):
            try:
                record = _load_record(path)
            except (ValueError, TypeError) as exc:
                log.error("unreadable device record, skipped", extra={"path": str(path), "error": str(exc)})
                continue
            if record is None:
                continue
            reopen = self.reopen.get(record.kind)
            try:
                if reopen is None:
                    raise BlockdError(f"unknown device kind {record.kind!r}")
                image = await reopen(record)
            except Exception as exc:
                log.error(
                    "cannot reopen device, record kept",
                    extra={"device": record.id, "source": record.source, "error": str(exc)},
                )
                continue
            device = await self._start_device(record, image)
            if record.readonly and record.source:  # a refcounted read-only device
                self._shared[(record.kind, record.source)] = device.id
            log.info("device recovered", extra={"device": record.id, "kind": record.kind})
        # Uppers the daemon made that no device holds any more (a run killed between making
        # an upper and saving its record) are garbage.
        in_use = {Path(r.record.upper_dir) for r in self.devices.values() if r.record.upper_dir}
        kept = {Path(p.stem) for p in self.layout.records.glob("*.json")}
        for upper in self.layout.uppers.iterdir():
            if upper not in in_use and Path(upper.name) not in kept:
                shutil.rmtree(upper, ignore_errors=True)

    async def _reopen_image(self, record: DeviceRecord) -> ImageLike:
        if record.source is None:
            raise BlockdError("the record names no source")
        image: ImageLike = await self._in_thread(
            images.open_image, Path(record.source), writable=not record.readonly)
        return image

    # -- devices ------------------------------------------------------------------------------

    async def _start_device(self, record: DeviceRecord, image: ImageLike) -> Device:
        """Serve `image` as the device `record` (NBD socket, FUSE file) and save the record."""
        device = Device(record, image, self.executor, self.metrics.count if self.metrics else None,
                        inline_max=self.inline_max)
        sock = Path(record.socket)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        device.server = await nbd.start_unix_server(
            str(sock), nbd.SingleExportTable(record.id, device), device.clients
        )
        grant_nbd_socket(sock, record.owner)
        self.devices[record.id] = device
        if self.fuse:
            device.fuse_path = self.layout.fuse / record.id
        self._save(record)
        if self.metrics:
            self.metrics.devices.set(len(self.devices))
        return device

    async def _stop_device(self, device: Device) -> None:
        if device.server is not None:
            device.server.close()
            device.server = None
        # Cut the clients still connected: their disk is going away.
        for writer in list(device.clients):
            nbd.cut(writer)
        await device.close_image()
        with contextlib.suppress(FileNotFoundError):
            Path(device.record.socket).unlink()

    async def close(self) -> None:
        """Flush and close every device (shutdown); their records stay for the next run."""
        for device in list(self.devices.values()):
            await self._stop_device(device)
        self.devices.clear()

    def shared_id(self, source: Path, kind: str = "shared") -> str | None:
        """The id of the live refcounted read-only device of `kind` over `source`, if any."""
        existing = self._shared.get((kind, str(source)))
        return existing if existing is not None and existing in self.devices else None

    def get(self, device_id: str) -> Device:
        device = self.devices.get(str(device_id))
        if device is None:
            raise NotFound(f"no device with id {device_id!r}")
        return device

    def _limit_for(self, upper_limit: int | None) -> int | None:
        """A create's cap: -1 (not given) means the daemon's default, 0 or None none."""
        if upper_limit == -1:
            return self.upper_limit
        return check_limit(upper_limit)

    async def _build_writable(
        self,
        image: str | None,
        lowers: list[str] | None,
        upper_dir: str | None,
        size: int | None,
        device_id: str,
    ) -> tuple[ImageLike, Path, bool]:
        """A new upper over an image's layers (or `lowers`): the image, its upper, and
        whether the daemon owns the upper (made under uppers/, removed on release)."""
        if image is not None and lowers:
            raise BlockdError("give either image or lowers, not both")
        if image is not None:
            source = Path(image)
            if not source.exists():
                raise BlockdError(f"image {source} does not exist")
            layer_paths = await self._in_thread(images.lowers_of, source)
        else:
            layer_paths = [Path(p) for p in lowers or []]
            for layer in layer_paths:
                if not layer.exists():
                    raise BlockdError(f"layer {layer} does not exist")
        if not layer_paths and size is None:
            raise BlockdError("a disk with no layers needs a size")
        if size is not None and (not isinstance(size, int) or size <= 0):
            raise BlockdError(f"size must be a positive number of bytes, got {size!r}")
        owns_upper = upper_dir is None
        upper = self.layout.uppers / device_id if upper_dir is None else Path(upper_dir)
        if (upper / "image.json").exists():
            raise BlockdError(f"{upper} already holds an image; give an empty upper_dir")
        created = await self._in_thread(images.create_image, layer_paths, upper, None if layer_paths else size)
        if layer_paths and size is not None and size != created.virtual_size:
            if size < created.virtual_size:
                created.close()
                raise BlockdError(
                    f"size {size} is smaller than the image ({created.virtual_size} bytes)"
                )
            await self._in_thread(created.resize, size)
        return created, upper, owns_upper

    async def _share(self, kind: str, source: Path, open_it: Callable[[], Awaitable[ImageLike]],
                     check: Callable[[ImageLike], None] | None = None) -> DeviceInfo:
        """The refcounted read-only device of `kind` for `source`: the existing one with
        refcount+1, else a new one over `open_it()` (`check` may refuse it; it is closed)."""
        existing = self._shared.get((kind, str(source)))
        if existing is not None and existing in self.devices:
            device = self.devices[existing]
            device.record.refcount += 1
            self._save(device.record)
            return device.info()
        opened = await open_it()
        if check is not None:
            try:
                check(opened)
            except BaseException:
                opened.close()
                raise
        device_id = self._new_id()
        record = DeviceRecord(
            id=device_id, kind=kind, socket=self._socket_for(device_id), source=str(source),
            upper_dir=None, owns_upper=False, readonly=True, size=opened.virtual_size,
        )
        device = await self._start_device(record, opened)
        self._shared[(kind, str(source))] = device_id
        return device.info()

    # -- operations ---------------------------------------------------------------------------

    async def create(
        self,
        image: str | None = None,
        lowers: list[str] | None = None,
        upper_dir: str | None = None,
        size: int | None = None,
        readonly: bool = False,
        upper_limit: int | None = -1,
        owner: int | None = None,
        chain_used: int = 0,
    ) -> DeviceInfo:
        """`owner`: the uid (= gid) whose client alone may connect to a writable device's socket
        (a jailed QEMU's); a read-only device is shared by design and has none. `chain_used`:
        bytes of the disk's own earlier sealed uppers among `lowers` (its pauses: a resume
        passes what the pause's `snapshot` answered), counted against the cap."""
        if owner is not None and (readonly or isinstance(owner, bool) or not isinstance(owner, int)
                                  or owner <= 0):
            raise BlockdError(f"owner {owner!r}: a uid > 0, and only for a writable device")
        if isinstance(chain_used, bool) or not isinstance(chain_used, int) or chain_used < 0 \
                or (readonly and chain_used):
            raise BlockdError(f"chain_used {chain_used!r}: bytes >= 0, and only for a writable "
                              "device")
        async with self._lock:
            if readonly:
                return await self._create_shared(image, lowers, size)
            limit = self._limit_for(upper_limit)
            device_id = self._new_id()
            built, upper, owns = await self._build_writable(image, lowers, upper_dir, size, device_id)
            record = DeviceRecord(
                id=device_id, kind="disk", socket=self._socket_for(device_id),
                source=str(images.config_path(upper)), upper_dir=str(upper), owns_upper=owns,
                readonly=False, size=built.virtual_size, upper_limit=limit, owner=owner,
                chain_used=chain_used,
            )
            device = await self._start_device(record, built)
            log.info("device created", extra={"device": device_id, "image": image, "size": device.size})
            return device.info()

    async def _create_shared(
        self, image: str | None, lowers: list[str] | None, size: int | None
    ) -> DeviceInfo:
        if image is None or lowers:
            raise BlockdError("a read-only device is made from one image (config or layer), not lowers")
        source = Path(image).resolve()
        if not source.exists():
            raise BlockdError(f"image {source} does not exist")

        async def open_it() -> ImageLike:
            opened: ImageLike = await self._in_thread(images.open_image, source, writable=False)
            return opened

        def check(opened: ImageLike) -> None:
            if size is not None and size != opened.virtual_size:
                raise BlockdError(f"read-only image is {opened.virtual_size} bytes, not {size}")

        return await self._share("shared", source, open_it, check)

    async def create_blank(self, size: int, upper_dir: str | None = None) -> DeviceInfo:
        return await self.create(image=None, lowers=[], upper_dir=upper_dir, size=size)

    async def snapshot(self, id: str, output: str | None = None) -> Sealed:
        device = self.get(id)
        if device.record.readonly:
            raise BlockdError(f"device {id} is read-only: nothing to snapshot")
        assert device.record.upper_dir is not None
        if output is None:
            n = len(device.record.snapshots) + 1
            output = str(Path(device.record.upper_dir) / f"sealed-{n:04d}-{int(time.time())}.lsmt")
        out = Path(output)
        if out.exists():
            raise BlockdError(f"{out} already exists")
        started = time.perf_counter()
        layer = await device.snapshot(out)
        device.record.snapshots.append(str(layer))
        self._save(device.record)
        log.info(
            "device snapshotted",
            extra={"device": id, "layer": str(layer), "ms": round((time.perf_counter() - started) * 1e3, 2)},
        )
        return Sealed(layer=str(layer), chain_used=device.record.chain_used)

    async def resize(self, id: str, size: int) -> DeviceInfo:
        device = self.get(id)
        if device.record.readonly:
            raise BlockdError(f"device {id} is read-only and cannot be resized")
        if not isinstance(size, int) or size <= 0:
            raise BlockdError(f"size must be a positive number of bytes, got {size!r}")
        await device.resize(size)
        self._save(device.record)
        return device.info()

    async def release(self, id: str) -> Released:
        async with self._lock:
            device = self.get(id)
            record = device.record
            if record.refcount > 1:
                record.refcount -= 1
                self._save(record)
                return Released(released=id, refcount=record.refcount)
            await self._stop_device(device)
            del self.devices[id]
            self._forget(id)
            if record.source and self._shared.get((record.kind, record.source)) == id:
                del self._shared[(record.kind, record.source)]
                for forget in self.on_unshared:
                    forget(record.source)
            if record.owns_upper and record.upper_dir:
                shutil.rmtree(record.upper_dir, ignore_errors=True)
            if self.metrics:
                self.metrics.forget(id)
                self.metrics.devices.set(len(self.devices))
            log.info("device released", extra={"device": id})
            return Released(released=id, refcount=0)

    def list(self) -> list[DeviceInfo]:
        return [device.info() for device in self.devices.values()]


def check_limit(limit: Any) -> int | None:
    if limit is None or limit == 0:
        return None
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise BlockdError(f"upper_limit must be a non-negative number of bytes, got {limit!r}")
    return limit


def _load_record(path: Path) -> DeviceRecord | None:
    """A device record; None (and the record removed) for what a restart does not bring back.

    Records of the warm device pool of older versions: an idle one held nothing; a taken one
    is an ordinary disk."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError("a device record is a JSON object")
    if data.get("kind") == "pool":
        if not data.pop("taken", False):
            path.unlink()
            with contextlib.suppress(FileNotFoundError, TypeError):
                Path(data["socket"]).unlink()
            return None
        data["kind"] = "disk"
    data.pop("taken", None)
    return DeviceRecord(**data)
