"""blockd: one daemon per host that owns every sandbox disk and serves it over NBD and FUSE.

Layout of the state directory (default $AENV_HOME/blockd/state, as `make up` starts it):

    devices/<id>.json   one record per device (what to reopen after a restart)
    nbd/<id>.sock       the device's NBD socket; export name = <id> (the empty name works too)
    uppers/<id>/        writable uppers the daemon made itself (no upper_dir given)
    fuse/<id>           the device as a regular file (one FUSE mount at fuse/)

QEMU attaches a device as `nbd+unix:///<id>?socket=STATE/nbd/<id>.sock`.

Control RPC (unix socket, default $AENV_HOME/blockd/blockd.sock): JSON lines. Each request is one line
`{"op": NAME, ...arguments}`; each answer one line, `{"ok": true, "result": ...}` or
`{"ok": false, "error": MESSAGE, "type": "invalid"|"not_found"|"failed"}`. A connection may
carry any number of requests, answered in order. Operations:

    ping                                       -> {"pid", "devices"}
    create {image?, lowers?, upper_dir?, size?, readonly?, upper_limit?}   -> device
        readonly: image (config JSON or layer) exported read-only, shared by refcount
        (creating it again returns the same device with refcount+1);
        else a new writable upper (in upper_dir, or one the daemon owns) over the image's
        layers (or `lowers`), grown to `size` if given. upper_limit: cap in bytes on the
        upper's growth (default: the daemon's --upper-limit, env AENV_DISK_UPPER_LIMIT; 0 or
        null: none); a write past it gets NBD ENOSPC, the device keeps serving, and the
        refusal is counted (stats.enospc, aenv_blockd_enospc) and logged.
    create_blank {size, upper_dir?}            -> device (a new empty disk)
    snapshot {id, output?}                     -> {"layer": PATH} sealed layer; the device keeps
                                                  serving, on a new empty upper
    resize {id, size}                          -> device
    release {id}                               -> {"released": id, "refcount": N}
    list                                       -> [device, ...] with per-device stats
    pool_take {image?, lowers?, upper_dir?, size?, upper_limit?} -> device (a pooled device, image swapped in)
    pool_fill {count, size?, image?, lowers?}  -> {"idle": N, "prepared": M}
    memory_open {key, layers, size}            -> device: a snapshot's memory layers as one
                                                  shared read-only file (blockd/memdev.py)
    memory_trace {id}                          -> {"chunk_size", "chunks"}: first-read order

Warm pool: idle devices serve a placeholder (zeros, writes refused, looks writable) of the pool
size, so a VMM may connect early. A take swaps the requested image in under the device's gate
(same id, socket and open connections). The daemon prepares, off the take path, an upper over
the image last taken (or named by pool_fill) for each idle device; a take for that image with
no upper_dir (the daemon owns the upper; its path is in the answer) is then only a swap.
Released pool devices go back to the pool.
    shutdown                                   -> {} (the daemon stops after answering)

A device is {"id", "nbd", "export", "file", "size", "readonly", "kind", "source", "upper_dir",
"refcount", "taken", "upper_limit", "upper_used", "stats": {reads, writes, bytes_read,
bytes_written, flushes, trims, zeroes, errors, connections, enospc}}.

Devices outlive their clients: an NBD client that misbehaves or dies loses only its own
connection. Every device is flushed when its last connection goes, on release and on
shutdown; after a crash the records in devices/ bring every device back with its upper.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentenv.blockd import images, memdev, nbd
from agentenv.blockd.client import default_socket, default_state_dir
from agentenv.blockd.device import (
    INLINE_MAX,
    Device,
    DeviceRecord,
    ImageLike,
    PlaceholderImage,
    tune_allocator,
)
from agentenv.blockd.errors import BlockdError
from agentenv.errors import AgentEnvError
from agentenv.fsutil import atomic_write_json, private_dir

log = logging.getLogger("agentenv.blockd")

# As `make up` starts it (the same defaults as the `aenv blockd` and `aenv disk` commands).
DEFAULT_STATE_DIR = default_state_dir()
DEFAULT_SOCKET = default_socket()
MAX_RPC_LINE = 1024 * 1024


class NotFound(BlockdError):
    pass


class Metrics:
    """Prometheus counters per device, registered only when a metrics port is asked for."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.counters = {
            name: Counter(
                f"aenv_blockd_{name}", f"NBD {name.replace('_', ' ')} per device", ["device"],
                registry=self.registry,
            )
            for name in ("reads", "writes", "bytes_read", "bytes_written", "errors")
        }
        self.counters["enospc"] = Counter(
            "aenv_blockd_enospc", "writes refused with ENOSPC: the upper reached its cap",
            ["device"], registry=self.registry,
        )
        self.devices = Gauge("aenv_blockd_devices", "devices served", registry=self.registry)
        self.pool_idle = Gauge("aenv_blockd_pool_idle", "idle pooled devices", registry=self.registry)

    def count(self, device: Device, what: str, amount: int) -> None:
        counter = self.counters.get(what)
        if counter is not None:
            counter.labels(device.id).inc(amount)

    def forget(self, device_id: str) -> None:
        for counter in self.counters.values():
            with contextlib.suppress(KeyError):
                counter.remove(device_id)


class Blockd:
    def __init__(
        self,
        state_dir: Path = DEFAULT_STATE_DIR,
        socket_path: Path = DEFAULT_SOCKET,
        *,
        fuse: bool = True,
        metrics_port: int | None = None,
        pool_size: int = 0,
        pool_disk_size: int = 1 << 30,
        io_threads: int = 8,
        inline_max: int = INLINE_MAX,
        upper_limit: int | None = None,
    ) -> None:
        self.inline_max = inline_max
        self.upper_limit = _check_limit(upper_limit)
        self.state_dir = Path(state_dir)
        self.socket_path = Path(socket_path)
        self.use_fuse = fuse
        self.metrics_port = metrics_port
        self.pool_target = pool_size
        self.pool_disk_size = pool_disk_size
        self.devices: dict[str, Device] = {}
        self.pool_idle: list[str] = []
        self.executor = ThreadPoolExecutor(io_threads, thread_name_prefix="blockd-io")
        self.metrics: Metrics | None = None
        self.fuse: Any = None
        self._lock = asyncio.Lock()
        self._stopped = asyncio.Event()
        self._rpc_server: asyncio.AbstractServer | None = None
        self._refill_task: asyncio.Task[None] | None = None
        self._shared_by_source: dict[str, str] = {}
        # Warm pool: an upper built ahead for the image last asked for, per idle device.
        self._prepare_for: tuple[str | None, list[str], int | None] | None = None
        self._prepared: dict[str, tuple[Any, ImageLike, Path]] = {}
        self._prepare_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock_fd = -1

    # -- paths -------------------------------------------------------------------------------

    @property
    def records_dir(self) -> Path:
        return self.state_dir / "devices"

    @property
    def nbd_dir(self) -> Path:
        return self.state_dir / "nbd"

    @property
    def uppers_dir(self) -> Path:
        return self.state_dir / "uppers"

    @property
    def fuse_dir(self) -> Path:
        return self.state_dir / "fuse"

    def _save(self, record: DeviceRecord) -> None:
        # A restarted daemon reopens exactly what these records say: they must never be torn.
        atomic_write_json(self.records_dir / f"{record.id}.json", record.to_json(), indent=1)

    def _forget(self, device_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.records_dir / f"{device_id}.json").unlink()

    def _new_id(self) -> str:
        while True:
            device_id = "d" + secrets.token_hex(5)
            if device_id not in self.devices:
                return device_id

    # -- lifecycle ---------------------------------------------------------------------------

    def _take_state_lock(self) -> None:
        """One daemon per state directory: a second one would fight over every device."""
        self._lock_fd = os.open(self.state_dir / "blockd.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise BlockdError(
                f"another blockd already runs on {self.state_dir} (it holds blockd.lock)"
            ) from None
        os.ftruncate(self._lock_fd, 0)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())

    async def start(self) -> None:
        # Uppers and records are the sandboxes' disks: nobody else's to read.
        private_dir(self.state_dir)
        self._take_state_lock()
        tune_allocator()
        # Every acknowledged write's index entry goes to upper.index at once (no fsync): a
        # killed daemon loses nothing its clients were told is written, and the restarted one
        # replays the log (NBD clients reconnect and their next flush makes it durable).
        from agentenv.storage.upper import Upper

        Upper.log_buffer = 0
        for folder in (self.records_dir, self.nbd_dir, self.uppers_dir):
            private_dir(folder)
        # QEMU (an unprivileged user) connects to the NBD sockets by path: it needs search
        # permission down to them, and nothing more.
        for folder in (self.state_dir, self.nbd_dir):
            _grant_vm_group_search(folder)
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.metrics_port is not None:
            from prometheus_client import start_http_server

            self.metrics = Metrics()
            start_http_server(self.metrics_port, registry=self.metrics.registry)
        if self.use_fuse:
            from agentenv.blockd.fuse import FuseFiles

            self.fuse = FuseFiles(self.fuse_dir, asyncio.get_running_loop(), self.devices)
            await self.fuse.start()
        await self._recover()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self._rpc_server = await asyncio.start_unix_server(
            self._serve_rpc, path=str(self.socket_path), limit=MAX_RPC_LINE
        )
        os.chmod(self.socket_path, 0o600)
        if self.pool_target:
            self._schedule_refill()
        log.info(
            "blockd started",
            extra={"socket": str(self.socket_path), "state_dir": str(self.state_dir),
                   "devices": len(self.devices), "fuse": bool(self.fuse)},
        )

    async def run(self) -> None:
        # Our handlers go in before FUSE starts: libfuse only installs its own on signals
        # still at their default, so SIGTERM/SIGINT stay ours and stop the daemon cleanly.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._stopped.set)
        try:
            await self.start()
            await self._stopped.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        if self._rpc_server is not None:
            self._rpc_server.close()
        for task in (self._refill_task, self._prepare_task, *self._tasks):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        for prepared in list(self._prepared.values()):
            await self._discard_prepared(prepared)
        self._prepared.clear()
        for device in list(self.devices.values()):
            await self._stop_device(device)
            if device.record.kind == "pool" and not device.record.taken:
                self._forget(device.id)
        self.devices.clear()
        await asyncio.to_thread(memdev.stop, self)  # the memory devices' mount (blockd/memfs.py)
        if self.fuse is not None:
            await self.fuse.stop()
        if self._rpc_server is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self.executor.shutdown(wait=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        log.info("blockd stopped")

    async def _recover(self) -> None:
        """Bring back the devices of the previous run from their records."""
        for path in sorted(self.records_dir.glob("*.json")):
            try:
                record = DeviceRecord(**json.loads(path.read_text()))
            except (ValueError, TypeError) as exc:
                log.error("unreadable device record, skipped", extra={"path": str(path), "error": str(exc)})
                continue
            if record.kind == "pool" and not record.taken:
                # Idle pool devices hold nothing; the pool is refilled fresh.
                path.unlink()
                with contextlib.suppress(FileNotFoundError):
                    Path(record.socket).unlink()
                continue
            try:
                assert record.source is not None
                image = await self._in_thread(
                    images.open_image, Path(record.source), writable=not record.readonly
                )
            except Exception as exc:
                log.error(
                    "cannot reopen device, record kept",
                    extra={"device": record.id, "source": record.source, "error": str(exc)},
                )
                continue
            device = await self._start_device(record, image)
            if record.kind == "shared" and record.source:
                self._shared_by_source[record.source] = device.id
            log.info("device recovered", extra={"device": record.id, "kind": record.kind})
        # Uppers the daemon made that no device holds any more (prepared for idle pool
        # devices of a run that was killed) are garbage.
        in_use = {Path(r.record.upper_dir) for r in self.devices.values() if r.record.upper_dir}
        kept = {Path(p.stem) for p in self.records_dir.glob("*.json")}
        for upper in self.uppers_dir.iterdir():
            if upper not in in_use and Path(upper.name) not in kept:
                shutil.rmtree(upper, ignore_errors=True)

    async def _in_thread(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    async def _start_device(self, record: DeviceRecord, image: ImageLike) -> Device:
        device = Device(record, image, self.executor, self.metrics.count if self.metrics else None,
                        inline_max=self.inline_max)
        sock = Path(record.socket)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        device.server = await nbd.start_unix_server(
            str(sock), nbd.SingleExportTable(record.id, device), device.clients
        )
        _grant_nbd_socket(sock)
        self.devices[record.id] = device
        if self.fuse is not None:
            device.fuse_path = self.fuse_dir / record.id
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
            writer.transport.abort()
        await device.close_image()
        with contextlib.suppress(FileNotFoundError):
            Path(device.record.socket).unlink()

    # -- operations --------------------------------------------------------------------------

    def _limit_for(self, upper_limit: int | None) -> int | None:
        """A create's cap: -1 (not given) means the daemon's default, 0 or None none."""
        if upper_limit == -1:
            return self.upper_limit
        return _check_limit(upper_limit)

    def _get(self, device_id: str) -> Device:
        device = self.devices.get(str(device_id))
        if device is None:
            raise NotFound(f"no device with id {device_id!r}")
        return device

    async def _build_writable(
        self,
        image: str | None,
        lowers: list[str] | None,
        upper_dir: str | None,
        size: int | None,
        device_id: str,
    ) -> tuple[ImageLike, Path, bool]:
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
        upper = self.uppers_dir / device_id if upper_dir is None else Path(upper_dir)
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

    async def create(
        self,
        image: str | None = None,
        lowers: list[str] | None = None,
        upper_dir: str | None = None,
        size: int | None = None,
        readonly: bool = False,
        upper_limit: int | None = -1,
    ) -> dict[str, Any]:
        async with self._lock:
            if readonly:
                return await self._create_shared(image, lowers, size)
            limit = self._limit_for(upper_limit)
            device_id = self._new_id()
            built, upper, owns = await self._build_writable(image, lowers, upper_dir, size, device_id)
            record = DeviceRecord(
                id=device_id, kind="disk", socket=str(self.nbd_dir / f"{device_id}.sock"),
                source=str(images.config_path(upper)), upper_dir=str(upper), owns_upper=owns,
                readonly=False, size=built.virtual_size, upper_limit=limit,
            )
            device = await self._start_device(record, built)
            log.info("device created", extra={"device": device_id, "image": image, "size": device.size})
            return device.info()

    async def _create_shared(
        self, image: str | None, lowers: list[str] | None, size: int | None
    ) -> dict[str, Any]:
        if image is None or lowers:
            raise BlockdError("a read-only device is made from one image (config or layer), not lowers")
        source = Path(image).resolve()
        if not source.exists():
            raise BlockdError(f"image {source} does not exist")
        existing = self._shared_by_source.get(str(source))
        if existing is not None and existing in self.devices:
            device = self.devices[existing]
            device.record.refcount += 1
            self._save(device.record)
            return device.info()
        opened = await self._in_thread(images.open_image, source, writable=False)
        if size is not None and size != opened.virtual_size:
            opened.close()
            raise BlockdError(f"read-only image is {opened.virtual_size} bytes, not {size}")
        device_id = self._new_id()
        record = DeviceRecord(
            id=device_id, kind="shared", socket=str(self.nbd_dir / f"{device_id}.sock"),
            source=str(source), upper_dir=None, owns_upper=False, readonly=True,
            size=opened.virtual_size,
        )
        device = await self._start_device(record, opened)
        self._shared_by_source[str(source)] = device_id
        return device.info()

    async def create_blank(self, size: int, upper_dir: str | None = None) -> dict[str, Any]:
        return await self.create(image=None, lowers=[], upper_dir=upper_dir, size=size)

    async def snapshot(self, id: str, output: str | None = None) -> dict[str, Any]:
        device = self._get(id)
        if device.record.readonly:
            raise BlockdError(f"device {id} is read-only: nothing to snapshot")
        if device.record.kind == "pool" and not device.record.taken:
            raise BlockdError(f"device {id} is an idle pool device: nothing to snapshot")
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
        return {"layer": str(layer)}

    async def resize(self, id: str, size: int) -> dict[str, Any]:
        device = self._get(id)
        if device.record.readonly:
            raise BlockdError(f"device {id} is read-only and cannot be resized")
        if not isinstance(size, int) or size <= 0:
            raise BlockdError(f"size must be a positive number of bytes, got {size!r}")
        await device.resize(size)
        self._save(device.record)
        return device.info()

    async def release(self, id: str) -> dict[str, Any]:
        async with self._lock:
            device = self._get(id)
            record = device.record
            if record.kind == "shared" and record.refcount > 1:
                record.refcount -= 1
                self._save(record)
                return {"released": id, "refcount": record.refcount}
            if record.kind == "pool":
                if not record.taken:
                    raise BlockdError(f"device {id} is idle in the pool, not in use")
                old = await device.swap(PlaceholderImage(record.size))
                await self._in_thread(_close_quietly, old)
                if record.owns_upper and record.upper_dir:
                    shutil.rmtree(record.upper_dir, ignore_errors=True)
                record.taken, record.source, record.upper_dir, record.owns_upper = False, None, None, False
                record.snapshots = []
                record.upper_limit = None
                device.stats.__init__()  # type: ignore[misc]
                self._save(record)
                self.pool_idle.append(id)
                self._update_pool_gauge()
                self._schedule_prepare()
                return {"released": id, "refcount": 0}
            await self._stop_device(device)
            del self.devices[id]
            self._forget(id)
            if record.kind == "shared" and record.source:
                self._shared_by_source.pop(record.source, None)
                memdev.forget_config(record.source)
            if record.owns_upper and record.upper_dir:
                shutil.rmtree(record.upper_dir, ignore_errors=True)
            if self.metrics:
                self.metrics.forget(id)
                self.metrics.devices.set(len(self.devices))
            log.info("device released", extra={"device": id})
            return {"released": id, "refcount": 0}

    def list(self) -> list[dict[str, Any]]:
        return [device.info() for device in self.devices.values()]

    # -- warm pool ---------------------------------------------------------------------------

    async def _add_pool_device(self, size: int) -> str:
        device_id = self._new_id()
        record = DeviceRecord(
            id=device_id, kind="pool", socket=str(self.nbd_dir / f"{device_id}.sock"),
            source=None, upper_dir=None, owns_upper=False, readonly=False, size=size,
        )
        await self._start_device(record, PlaceholderImage(size))
        self.pool_idle.append(device_id)
        self._update_pool_gauge()
        return device_id

    def _update_pool_gauge(self) -> None:
        if self.metrics:
            self.metrics.pool_idle.set(len(self.pool_idle))

    async def pool_fill(
        self,
        count: int,
        size: int | None = None,
        image: str | None = None,
        lowers: list[str] | None = None,
    ) -> dict[str, Any]:
        """Keep `count` idle devices of `size`; with an image (or lowers), also prepare an
        upper over it on each idle device, so that taking one for that image is a swap."""
        if not isinstance(count, int) or count < 0:
            raise BlockdError(f"count must be a non-negative integer, got {count!r}")
        size = self.pool_disk_size if size is None else size
        if image is not None or lowers:
            self._prepare_for = (image, list(lowers or []), size)
        async with self._lock:
            self.pool_target = count
            self.pool_disk_size = size
            while len(self.pool_idle) < count:
                await self._add_pool_device(size)
        await self._prepare_idle()
        return {"idle": len(self.pool_idle), "prepared": len(self._prepared)}

    def _schedule_refill(self) -> None:
        if self._refill_task is None or self._refill_task.done():
            self._refill_task = asyncio.get_running_loop().create_task(self._refill())

    async def _refill(self) -> None:
        while len(self.pool_idle) < self.pool_target:
            async with self._lock:
                await self._add_pool_device(self.pool_disk_size)
        await self._prepare_idle()

    @staticmethod
    def _pool_key(image: str | None, lowers: list[str] | None, size: int | None) -> tuple[Any, ...]:
        return (str(image) if image is not None else None, tuple(str(p) for p in lowers or []), size)

    async def _prepare_idle(self) -> None:
        """Build, off the take path, an upper over the last requested image for every idle
        device that has none (Image.create opens and merges every layer's index: most of
        a cold take's time)."""
        if self._prepare_for is None:
            return
        image, lowers, size = self._prepare_for
        key = self._pool_key(image, lowers, size)
        for device_id in list(self.pool_idle):
            current = self._prepared.get(device_id)
            if current is not None and current[0] == key:
                continue
            if self._prepare_for is None or self._pool_key(*self._prepare_for) != key:
                return  # a newer image is wanted; its own pass prepares it
            name = "p" + secrets.token_hex(5)
            try:
                built, upper, _owns = await self._build_writable(image, lowers, None, size, name)
            except Exception as exc:
                log.warning("cannot prepare pooled image", extra={"error": str(exc)})
                self._prepare_for = None
                return
            if device_id in self.pool_idle and self._prepared.get(device_id, (None,))[0] != key:
                stale = self._prepared.pop(device_id, None)
                self._prepared[device_id] = (key, built, upper)
                if stale is not None:
                    await self._discard_prepared(stale)
            else:
                await self._discard_prepared((key, built, upper))

    async def _discard_prepared(self, prepared: tuple[Any, ImageLike, Path]) -> None:
        _key, image, upper = prepared
        await self._in_thread(_close_quietly, image)
        await self._in_thread(shutil.rmtree, upper, True)

    async def pool_take(
        self,
        image: str | None = None,
        lowers: list[str] | None = None,
        upper_dir: str | None = None,
        size: int | None = None,
        upper_limit: int | None = -1,
    ) -> dict[str, Any]:
        started = time.perf_counter()
        limit = self._limit_for(upper_limit)
        key = self._pool_key(image, lowers, size)
        stale: tuple[Any, ImageLike, Path] | None = None
        async with self._lock:
            device_id: str | None = None
            # Best: an idle device with an upper already prepared for this image (only when
            # the daemon owns the upper: a prepared one cannot move to the caller's folder).
            if upper_dir is None:
                for candidate in self.pool_idle:
                    prepared = self._prepared.get(candidate)
                    if prepared is not None and prepared[0] == key:
                        device_id = candidate
                        break
            # Next: an idle device of the final size (a client that already negotiated the
            # placeholder's size then sees the right one).
            if device_id is None:
                for candidate in self.pool_idle:
                    if size is not None and self.devices[candidate].size == size:
                        device_id = candidate
                        break
            if device_id is None and self.pool_idle:
                device_id = self.pool_idle[0]
            if device_id is None:
                log.info("pool empty, creating a device cold")
                device_id = await self._add_pool_device(size or self.pool_disk_size)
            device = self.devices[device_id]
            prepared = self._prepared.pop(device_id, None)
            if prepared is not None and prepared[0] == key and upper_dir is None:
                built, upper, owns = prepared[1], prepared[2], True
                how = "prepared"
            else:
                stale = prepared
                built, upper, owns = await self._build_writable(
                    image, lowers, upper_dir, size, device_id
                )
                how = "built"
            device.record.upper_limit = limit
            old = await device.swap(built)
            self.pool_idle.remove(device_id)
            record = device.record
            record.taken, record.source = True, str(images.config_path(upper))
            record.upper_dir, record.owns_upper = str(upper), owns
            self._save(record)
            self._update_pool_gauge()
        log.info("pool device taken", extra={"device": device_id, "how": how,
                                             "ms": round((time.perf_counter() - started) * 1e3, 3)})
        self._prepare_for = (image, list(lowers or []), size)
        self._background(self._after_take(old, stale))
        return device.info()

    async def _after_take(self, old: ImageLike, stale: tuple[Any, ImageLike, Path] | None) -> None:
        """Clean-up and re-preparation, off the take's path."""
        await self._in_thread(_close_quietly, old)
        if stale is not None:
            await self._discard_prepared(stale)
        if self.pool_target:
            self._schedule_refill()
        else:
            self._schedule_prepare()

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _schedule_prepare(self) -> None:
        if self._prepare_task is None or self._prepare_task.done():
            self._prepare_task = asyncio.get_running_loop().create_task(self._prepare_idle())

    # -- RPC ---------------------------------------------------------------------------------

    async def _serve_rpc(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:
                    writer.write(_answer_error("invalid", "request line too long"))
                    break
                if not line:
                    break
                answer = await self._dispatch(line)
                writer.write(answer)
                await writer.drain()
                if self._stopped.is_set():
                    break
        except ConnectionError:
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _dispatch(self, line: bytes) -> bytes:
        try:
            request = json.loads(line)
            if not isinstance(request, dict) or not isinstance(request.get("op"), str):
                raise BlockdError('a request is a JSON object with an "op" string')
        except (ValueError, BlockdError) as exc:
            return _answer_error("invalid", f"bad request: {exc}")
        op = request.pop("op")
        handlers = {
            "ping": self._op_ping,
            "create": self.create,
            "create_blank": self.create_blank,
            "snapshot": self.snapshot,
            "resize": self.resize,
            "release": self.release,
            "list": self._op_list,
            "pool_take": self.pool_take,
            "pool_fill": self.pool_fill,
            "shutdown": self._op_shutdown,
            # Memory devices (blockd/memdev.py): a snapshot's memory stack as one FUSE file.
            "memory_open": lambda **kw: memdev.memory_open(self, **kw),
            "memory_trace": lambda **kw: memdev.memory_trace(self, **kw),
        }
        handler = handlers.get(op)
        if handler is None:
            return _answer_error("invalid", f"unknown op {op!r}; known: {', '.join(handlers)}")
        try:
            result = await handler(**request)
        except TypeError as exc:
            return _answer_error("invalid", f"{op}: {exc}")
        except NotFound as exc:
            return _answer_error("not_found", str(exc))
        except BlockdError as exc:
            return _answer_error("invalid", str(exc))
        except (AgentEnvError, OSError) as exc:
            log.warning("operation failed", extra={"op": op, "error": str(exc)})
            return _answer_error("failed", f"{op}: {exc}")
        except Exception as exc:
            log.exception("operation crashed", extra={"op": op})
            return _answer_error("failed", f"{op}: internal error: {exc!r}")
        return (json.dumps({"ok": True, "result": result}) + "\n").encode()

    async def _op_ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "devices": len(self.devices), "pool_idle": len(self.pool_idle),
                "pool_prepared": len(self._prepared)}

    async def _op_list(self) -> list[dict[str, Any]]:
        return self.list()

    async def _op_shutdown(self) -> dict[str, Any]:
        self._stopped.set()
        return {}


def _check_limit(limit: Any) -> int | None:
    if limit is None or limit == 0:
        return None
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise BlockdError(f"upper_limit must be a non-negative number of bytes, got {limit!r}")
    return limit


def _close_quietly(image: ImageLike) -> None:
    try:
        if not image.readonly:
            image.flush()
        image.close()
    except Exception as exc:
        log.warning("closing an image failed", extra={"error": str(exc)})


def _answer_error(kind: str, message: str) -> bytes:
    return (json.dumps({"ok": False, "type": kind, "error": message}) + "\n").encode()


def _vm_gid() -> int | None:
    """The group of the user QEMU runs as (AENV_QEMU_USER, default aenv-vm), if it exists."""
    import grp

    name = os.environ.get("AENV_QEMU_USER", "aenv-vm")
    try:
        return grp.getgrnam(name).gr_gid if name and name != "root" else None
    except KeyError:
        return None


def _grant_vm_group_search(folder: Path) -> None:
    """Group = the VM user's group, group may search (not list); others get nothing."""
    gid = _vm_gid()
    if gid is None:
        return
    os.chown(folder, -1, gid)
    os.chmod(folder, 0o710)


def _grant_nbd_socket(sock: Path) -> None:
    """QEMU runs as an unprivileged user (runtime/privilege.py) and connects to a device's NBD
    socket by path (also to reconnect): the socket is 0660 with that user's group, nobody
    else's. The group is AENV_QEMU_USER's (default aenv-vm); without it the socket stays 0600
    (root's QEMU only)."""
    gid = _vm_gid()
    if gid is None:
        os.chmod(sock, 0o600)
        return
    os.chown(sock, -1, gid)
    os.chmod(sock, 0o660)

