"""blockd: one daemon per host that owns every sandbox disk and serves it over NBD and FUSE.

The daemon is a shell around three parts:
- rpc.py: the control transport (unix socket, JSON lines, dispatch, errors as JSON);
- manager.py: the devices, their records and uppers (the state layout is in its docstring);
- results.py: the typed records the operations return and the clients read.
This module holds the state directory's lock, start and stop, FUSE and metrics, and the
operation table below: a new RPC operation is one entry there (plus its method).

Control RPC (unix socket, default $AENV_HOME/blockd/blockd.sock; framing and error kinds in
rpc.py). Operations:

    ping                                       -> {"pid", "devices"}
    create {image?, lowers?, upper_dir?, size?, readonly?, upper_limit?, chain_used?} -> device
        readonly: image (config JSON or layer) exported read-only, shared by refcount
        (creating it again returns the same device with refcount+1);
        else a new writable upper (in upper_dir, or one the daemon owns) over the image's
        layers (or `lowers`), grown to `size` if given. upper_limit: cap in bytes on the
        upper's growth (default: the daemon's --upper-limit, env AENV_DISK_UPPER_LIMIT; 0 or
        null: none); it bounds the disk's own writes in all: its current upper plus
        `chain_used?`, what its earlier sealed uppers among `lowers` hold (a resume passes
        the `chain_used` its pause's snapshot answered). A write past it, or one that would
        take the uppers' filesystem below the daemon's --disk-reserve (the node's disk budget),
        gets NBD ENOSPC, the device keeps serving, and the refusal is counted (stats.enospc,
        aenv_blockd_enospc) and logged.
    create_blank {size, upper_dir?}            -> device (a new empty disk)
    snapshot {id, output?}                     -> {"layer": PATH, "chain_used": N} sealed layer
                                                  and what the disk's own sealed uppers now
                                                  hold; the device keeps serving, on a new
                                                  empty upper (with what is left of its cap)
    resize {id, size}                          -> device
    release {id}                               -> {"released": id, "refcount": N}
    list                                       -> [device, ...] with per-device stats
    shutdown                                   -> {} (the daemon stops after answering)
    memory_open {key, layers, size}            -> device: a snapshot's memory layers as one
                                                  shared read-only file (blockd/memdev.py)
    memory_trace {id}                          -> {"chunk_size", "chunks"}: first-read order

A device is results.DeviceInfo: {"id", "nbd", "export", "file", "size", "readonly", "kind",
"source", "upper_dir", "refcount", "upper_limit", "chain_used", "upper_used", "stats": {reads, writes,
bytes_read, bytes_written, flushes, trims, zeroes, errors, connections, enospc}}.
QEMU attaches a device as `nbd+unix:///<id>?socket=STATE/nbd/<id>.sock`.

Devices outlive their clients: an NBD client that misbehaves or dies loses only its own
connection. Every device is flushed when its last connection goes, on release and on
shutdown; after a crash the records in devices/ bring every device back with its upper.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentenv.blockd import memdev
from agentenv.blockd.access import grant_vm_group_search
from agentenv.blockd.client import default_socket, default_state_dir
from agentenv.blockd.device import INLINE_MAX, Device, tune_allocator
from agentenv.blockd.errors import BlockdError, NotFound
from agentenv.blockd.manager import DeviceManager, StateLayout
from agentenv.blockd.metrics import LOOPBACK, Metrics
from agentenv.blockd.results import Pong
from agentenv.blockd.rpc import MAX_RPC_LINE, Handler, RpcServer
from agentenv.fsutil import private_dir
from agentenv.storage import native
from agentenv.storage.upper import Upper

__all__ = ["DEFAULT_SOCKET", "DEFAULT_STATE_DIR", "MAX_RPC_LINE", "Blockd", "Metrics", "NotFound"]

log = logging.getLogger("agentenv.blockd")

# As `make up` starts it (the same defaults as the `aenv blockd` and `aenv disk` commands).
DEFAULT_STATE_DIR = default_state_dir()
DEFAULT_SOCKET = default_socket()


class Blockd:
    def __init__(
        self,
        state_dir: Path = DEFAULT_STATE_DIR,
        socket_path: Path = DEFAULT_SOCKET,
        *,
        fuse: bool = True,
        metrics_port: int | None = None,
        metrics_bind: str = LOOPBACK,
        io_threads: int = 8,
        inline_max: int = INLINE_MAX,
        upper_limit: int | None = None,
        disk_reserve: int | None = None,
        remote: Any = None,
    ) -> None:
        """disk_reserve: bytes every upper's filesystem keeps free (the node's disk budget,
        storage/budget.py; None: off)."""
        # Remote layers and the chunk cache (blockd/remote/service.py): a RemoteConfig, else
        # settings from the environment.
        self.remote_config = remote
        self.remote: Any = None
        self.state_dir = Path(state_dir)
        self.socket_path = Path(socket_path)
        self.use_fuse = fuse
        self.metrics_port = metrics_port
        self.metrics_bind = metrics_bind
        self.disk_reserve = disk_reserve
        self.executor = ThreadPoolExecutor(io_threads, thread_name_prefix="blockd-io")
        self.layout = StateLayout(self.state_dir)
        self.manager = DeviceManager(self.layout, self.executor, inline_max=inline_max,
                                     upper_limit=upper_limit)
        self.metrics: Metrics | None = None
        self.fuse: Any = None
        self._stopped = asyncio.Event()
        self.manager.on_unshared.append(memdev.forget_config)
        self.rpc = RpcServer(self.socket_path, self.operations(), self._stopped.is_set)
        self._lock_fd = -1

    def operations(self) -> dict[str, Handler]:
        """The control RPC's operations (documented in this module's docstring)."""
        m = self.manager
        return {
            "ping": self._op_ping,
            "create": m.create,
            "create_blank": m.create_blank,
            "snapshot": m.snapshot,
            "resize": m.resize,
            "release": m.release,
            "list": self._op_list,
            "shutdown": self._op_shutdown,
            # Memory devices (blockd/memdev.py): a snapshot's memory stack as one FUSE file.
            "memory_open": lambda **kw: memdev.memory_open(self.manager, **kw),
            "memory_trace": lambda **kw: memdev.memory_trace(self.manager, **kw),
            **(self.remote.handlers() if self.remote is not None else {}),
        }

    @property
    def devices(self) -> dict[str, Device]:
        return self.manager.devices

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
        Upper.log_buffer = 0
        # The data path: the native core unless switched off (AENV_BLOCKD_NATIVE=0) or not
        # built; a bad value of the switch stops the daemon here, not at the first device.
        log.info("data path", extra={"native": native.enabled(),
                                     "native_unavailable": native.unavailable_reason()})
        native.configure_disk_budget(self.disk_reserve)
        for folder in (self.layout.records, self.layout.nbd, self.layout.uppers):
            private_dir(folder)
        # QEMU (an unprivileged user) connects to the NBD sockets by path: it needs search
        # permission down to them, and nothing more.
        for folder in (self.state_dir, self.layout.nbd):
            grant_vm_group_search(folder)
        if self.metrics_port is not None:
            self.metrics = Metrics()
            self.metrics.serve(self.metrics_port, self.metrics_bind)
            self.manager.metrics = self.metrics
        from agentenv.blockd.remote import service as remote_service

        self.remote = remote_service.start(
            self.remote_config or remote_service.config_from_env(self.state_dir),
            self.metrics.registry if self.metrics else None, self.state_dir)
        self.rpc.handlers = self.operations()
        if self.use_fuse:
            from agentenv.blockd.fuse import FuseFiles

            self.fuse = FuseFiles(self.layout.fuse, asyncio.get_running_loop(), self.devices)
            await self.fuse.start()
            self.manager.fuse = True
        await self.manager.recover()
        await self.rpc.start()
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
        self.rpc.stop_accepting()
        await self.manager.close()
        if self._lock_fd >= 0:
            # The memory devices' mount (blockd/memfs.py), only by the daemon that owns the
            # state: a second blockd refused the lock must not end the first one's memfs.
            await asyncio.to_thread(memdev.stop, self.state_dir)
        if self.fuse is not None:
            await self.fuse.stop()
        self.rpc.close()
        self.executor.shutdown(wait=True)
        if self.remote is not None:
            self.remote.stop()
            self.remote = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        log.info("blockd stopped")

    # -- operations of the daemon itself ------------------------------------------------------

    async def _op_ping(self) -> Pong:
        return Pong(pid=os.getpid(), devices=len(self.devices))

    async def _op_list(self) -> list[Any]:
        return self.manager.list()

    async def _op_shutdown(self) -> None:
        self._stopped.set()
