"""The FUSE mount of blockd's memory devices, in a process of its own that outlives blockd.

QEMU maps a restored VM's guest RAM from a memory device's file (blockd/memdev.py). A FUSE
connection ends with the process that serves it, and a page QEMU faults in after that gets
SIGBUS, so the files cannot be served by blockd itself, which may be killed and restarted
under running VMs (its disks survive that: NBD reconnects). blockd starts this process in a
session of its own (`ensure_running`); a restarted blockd finds it still mounted and keeps it;
a graceful blockd stop ends it (`stop`).

It serves `STATE/memfs/<key>` for every image config `STATE/memdev/<key>.memory.json` (the
memory layers, read-only), through the page cache (content never changes: no direct_io,
keep_cache), mode 0440 with the VM group. Every open for writing is refused, not only the
writes: the kernel copies a `pwrite` to a FUSE file into its cached page before it sends it
here, so a refused write would still change the page that every VM restored from the snapshot
maps (red team of 2026-12-07). QEMU opens its RAM file read-only (runtime/qemu.py). It opens
a stack at its first lookup and closes it once its config is gone (the device's last reference
released). The order of each device's first reads per CHUNK (page-cache misses: the order in
which the first restore touched memory) is appended to `STATE/memdev/<key>.trace` (uint32
chunk numbers), the startup pack's source.

Reads, the page-fault path, run in the native core (storage/_native.cpp, docs/native.md) on
libfuse's worker threads without the GIL: `read`'s slot in libfuse's operations table is the
core's `memfs_read`, which serves the stacks registered at open. Every other operation stays
here. Without the core (not built, or AENV_BLOCKD_NATIVE=0) `MemoryFiles.read` serves them.

A memory layer may be remote (a snapshot pulled lazily: snapshot/repository.py). memfs reads
it through a chunk store of its own (blockd/remote/store.py; `STATE/memfs-chunk-cache`, the
AENV_CHUNK_CACHE_* and AENV_REMOTE_* settings, AENV_MEMORY_CHUNK_CACHE_SIZE for its capacity),
not through blockd's: a guest page fault must not fail while blockd restarts, which is why memfs
is a process of its own. Its counters are written to `STATE/memfs-remote.json` (blockd's
`remote_stats` shows them as "memory").

    python -m agentenv.blockd.memfs STATE_DIR
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mfusepy

from agentenv.blockd.access import vm_gid
from agentenv.fsutil import atomic_write
from agentenv.settings import get_settings
from agentenv.storage import blob, native

log = logging.getLogger("agentenv.blockd.memfs")

MEMORY_SUFFIX = ".memory.json"
TRACE_SUFFIX = ".trace"
CHUNK = 1 << 20
PIDFILE = "memfs.pid"
SWEEP_SECONDS = 2.0
FUSE_CAP_AUTO_INVAL_DATA = 1 << 12  # libfuse 3's fuse_common.h


class _Open:
    """One memory stack opened for reads, with its first-read trace (appended through
    `trace_fd`, by `note` here or by the native reader)."""

    def __init__(self, image: Any, trace_path: Path) -> None:
        self.image = image
        self.size = int(image.virtual_size)
        self.seen = bytearray((self.size + CHUNK - 1) // CHUNK)
        self.trace_path = trace_path
        self.trace_fd = os.open(trace_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                                0o600)
        self.lock = threading.Lock()
        # The first open of a newly opened stack drops what the kernel may still cache under
        # this name from an earlier device of the same key (keep_cache=0 once).
        self.fresh = True

    def note(self, offset: int, length: int) -> None:
        first, last = offset // CHUNK, (offset + max(length, 1) - 1) // CHUNK
        new = []
        with self.lock:
            for chunk in range(first, min(last + 1, len(self.seen))):
                if not self.seen[chunk]:
                    self.seen[chunk] = 1
                    new.append(chunk)
            if new:
                with contextlib.suppress(OSError):
                    os.write(self.trace_fd, b"".join(c.to_bytes(4, "little") for c in new))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.image.close()
        os.close(self.trace_fd)
        self.trace_path.unlink(missing_ok=True)


class MemoryFiles(mfusepy.Operations):
    use_ns = True

    def __init__(self, config_dir: Path, vm_gid: int | None, *, native: Any = None) -> None:
        self.config_dir = config_dir
        self.vm_gid = vm_gid
        # The native core's module when it serves the reads (module doc): every opened stack
        # is registered with it.
        self.native = native
        self.uid, self.gid = os.geteuid(), os.getegid()
        self.started = time.time_ns()
        self.open_stacks: dict[str, _Open] = {}
        # Not `lock`: mfusepy takes every attribute named like a FUSE operation as that
        # operation (libfuse calls `lock` at every close).
        self.stacks_lock = threading.Lock()

    def _config(self, key: str) -> Path:
        return self.config_dir / f"{key}{MEMORY_SUFFIX}"

    def _stack(self, path: str) -> _Open:
        key = path.lstrip("/")
        if not key or "/" in key:
            raise mfusepy.FuseOSError(errno.ENOENT)
        with self.stacks_lock:
            stack = self.open_stacks.get(key)
            if stack is not None:
                return stack
            config = self._config(key)
            if not config.is_file():
                raise mfusepy.FuseOSError(errno.ENOENT)
            from agentenv.blockd import images

            try:
                image = images.open_image(config, writable=False)
            except Exception as exc:
                log.warning("memory stack cannot be opened", extra={"key": key, "error": str(exc)})
                raise mfusepy.FuseOSError(errno.EIO) from exc
            try:
                stack = _Open(image, self.config_dir / f"{key}{TRACE_SUFFIX}")
            except OSError as exc:
                image.close()
                log.warning("memory trace cannot be opened", extra={"key": key, "error": str(exc)})
                raise mfusepy.FuseOSError(errno.EIO) from exc
            if self.native is not None:
                try:
                    self.native.memfs_register(f"/{key}", image.reading_core, stack.size, stack.trace_fd)
                except Exception as exc:
                    stack.close()
                    log.warning("memory stack cannot be served", extra={"key": key, "error": str(exc)})
                    raise mfusepy.FuseOSError(errno.EIO) from exc
            self.open_stacks[key] = stack
            return stack

    def sweep(self) -> None:
        """Close the stacks whose config is gone (their device was released)."""
        with self.stacks_lock:
            gone = [k for k in self.open_stacks if not self._config(k).exists()]
            closing = [self.open_stacks.pop(k) for k in gone]
        for key, stack in zip(gone, closing, strict=True):
            if self.native is not None:
                served = self.native.memfs_unregister(f"/{key}")  # returns once no read uses it
                if served is not None:  # in the message too: memfs.log prints no extras
                    log.info("memory stack %s closed: %d native reads, %d bytes, %d errors",
                             key, *served, extra={"key": key, "reads": served[0],
                                                  "bytes": served[1], "errors": served[2]})
            stack.close()

    def init_with_config(self, conn: Any, config: Any) -> None:
        """No auto_inval_data (libfuse's default): the files never change, and with it the
        kernel asks for the attributes (a GETATTR here, attr_timeout being 0) at every read(2)."""
        if conn is not None:
            conn.want &= ~FUSE_CAP_AUTO_INVAL_DATA

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        times = {"st_atime": self.started, "st_mtime": self.started, "st_ctime": self.started}
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2, "st_uid": self.uid,
                    "st_gid": self.gid, **times}
        stack = self._stack(path)
        if not self._config(path.lstrip("/")).exists():  # released, not swept yet
            raise mfusepy.FuseOSError(errno.ENOENT)
        gid, mode = (self.vm_gid, 0o440) if self.vm_gid is not None else (self.gid, 0o400)
        return {"st_mode": stat.S_IFREG | mode, "st_nlink": 1, "st_uid": self.uid, "st_gid": gid,
                "st_size": stack.size, "st_blocks": 0, "st_blksize": 4096, **times}

    def readdir(self, path: str, fh: Any) -> list[str]:
        if path != "/":
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        names = [p.name.removesuffix(MEMORY_SUFFIX) for p in self.config_dir.glob(f"*{MEMORY_SUFFIX}")]
        return [".", "..", *sorted(names)]

    def open(self, path: str, fi: Any) -> int:
        if fi.flags & os.O_ACCMODE != os.O_RDONLY:
            # FUSE copies a write into the cached page before it asks us: a refused write
            # would still change the page every VM of this snapshot maps (module doc).
            raise mfusepy.FuseOSError(errno.EACCES)
        stack = self._stack(path)
        fi.direct_io = 0
        with stack.lock:
            fi.keep_cache = 0 if stack.fresh else 1
            stack.fresh = False
        return 0

    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        stack = self._stack(path)
        end = min(offset + size, stack.size)
        if end <= offset:
            return b""
        stack.note(offset, end - offset)
        try:
            data = stack.image.read(offset, end - offset)
        except Exception as exc:
            log.warning("memory read failed", extra={"path": path, "error": str(exc)})
            raise mfusepy.FuseOSError(errno.EIO) from exc
        return data if isinstance(data, bytes) else bytes(data)

    def write(self, path: str, data: bytes, offset: int, fh: Any) -> int:
        raise mfusepy.FuseOSError(errno.EROFS)

    def truncate(self, path: str, length: int, fh: Any = None) -> int:
        raise mfusepy.FuseOSError(errno.EROFS)

    def fallocate(self, path: str, mode: int, offset: int, size: int, fh: Any) -> int:
        raise mfusepy.FuseOSError(errno.EROFS)

    def flush(self, path: str, fh: Any) -> int:
        return 0

    def fsync(self, path: str, datasync: int, fh: Any) -> int:
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_namemax": 255}


def _native_reader() -> Any:
    """The native core's module when it should serve reads (module doc), else None."""
    if not native.enabled():
        log.info("memfs reads in Python", extra={"reason": native.unavailable_reason() or "switched off"})
        return None
    # optional: the extension exists only in a build with it (native.enabled() said so)
    from agentenv.storage import _native

    return _native


def _mount(ops: MemoryFiles, mountpoint: Path) -> None:
    """Mount and serve until unmounted or signalled: libfuse's multi-threaded loop."""
    options: dict[str, Any] = dict(
        foreground=True, raw_fi=True, fsname="aenv-memfs", allow_other=os.geteuid() == 0,
        default_permissions=True, attr_timeout=0, entry_timeout=0)
    if ops.native is None:
        mfusepy.FUSE(ops, str(mountpoint), **options)
        return
    # mfusepy fills libfuse's operations table with Python callbacks and hands it to
    # fuse_main_real; read's slot gets the native reader instead, just before that call.
    read_slot = dict(field[:2] for field in mfusepy.fuse_operations._fields_)["read"]
    native_read = read_slot(ops.native.memfs_read_address())
    fuse_main_real = mfusepy.fuse_main_real

    def main_with_native_read(argc: int, argv: Any, operations: Any, size: int, data: Any) -> int:
        operations.contents.read = native_read
        return fuse_main_real(argc, argv, operations, size, data)  # type: ignore[no-any-return]

    mfusepy.fuse_main_real = main_with_native_read
    try:
        mfusepy.FUSE(ops, str(mountpoint), **options)
    finally:
        mfusepy.fuse_main_real = fuse_main_real


def _unmount(mountpoint: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", "-q", str(mountpoint)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


class _RemoteLayers:
    """memfs's reader of remote memory layers (module doc), made at the first one."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.store: Any = None
        self.lock = threading.Lock()

    def install(self) -> None:
        blob.set_default_remote_opener(self._opener)

    def _opener(self) -> Any:
        from agentenv.blockd.remote.service import config_from_env, parse_size
        from agentenv.blockd.remote.store import RemoteStore

        with self.lock:
            if self.store is None:
                logging.getLogger("httpx").setLevel(logging.WARNING)
                capacity = get_settings().memory_chunk_cache_size
                config = config_from_env(
                    self.state_dir, cache_dir=self.state_dir / "memfs-chunk-cache", peers=[],
                    capacity=parse_size(capacity) if capacity else None)
                config.trust = None  # as peers=[]: memfs asks no static peer
                self.store = RemoteStore(config)
                log.info("memfs chunk store ready", extra={"cache": str(config.cache_dir),
                                                           "capacity": config.capacity})
            return self.store.open_blob

    def write_stats(self) -> None:
        if self.store is None:
            return
        from agentenv.blockd.remote.service import MEMFS_STATS

        with contextlib.suppress(OSError):
            stats = self.store.snapshot_stats()
            atomic_write(self.state_dir / MEMFS_STATS, json.dumps(stats), mode=0o600)

    def close(self) -> None:
        if self.store is not None:
            self.write_stats()
            with contextlib.suppress(Exception):
                self.store.close()


def serve(state_dir: Path) -> None:
    mountpoint = state_dir / "memfs"
    config_dir = state_dir / "memdev"
    config_dir.mkdir(mode=0o700, exist_ok=True)
    _unmount(mountpoint)  # a dead mount of a killed run ("transport endpoint is not connected")
    mountpoint.mkdir(exist_ok=True)
    from agentenv.blockd.remote.service import MEMFS_STATS

    (state_dir / MEMFS_STATS).unlink(missing_ok=True)
    remote = _RemoteLayers(state_dir)
    remote.install()
    ops = MemoryFiles(config_dir, vm_gid(), native=_native_reader())
    stop = threading.Event()

    def sweeper() -> None:
        while not stop.wait(SWEEP_SECONDS):
            ops.sweep()
            remote.write_stats()

    threading.Thread(target=sweeper, name="memfs-sweep", daemon=True).start()
    (state_dir / PIDFILE).write_text(f"{os.getpid()}\n")
    # SIGTERM is left at its default: libfuse then handles it (leaves its loop, unmounts).
    try:
        _mount(ops, mountpoint)
    finally:
        stop.set()
        remote.close()
        # Only our own pid: a newer memfs that took the mount over has written its own.
        with contextlib.suppress(OSError, ValueError):
            if int((state_dir / PIDFILE).read_text().strip()) == os.getpid():
                (state_dir / PIDFILE).unlink()


# --- blockd's side ---------------------------------------------------------------------------


def live_pid(state_dir: Path) -> int | None:
    """The pid of this state directory's memfs process when it runs: the pid file's, else
    (a pid file lost to a race of two memfs starts) the process found by its command line."""
    def ours(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            return False
        return b"agentenv.blockd.memfs" in argv and str(state_dir).encode() in argv

    with contextlib.suppress(OSError, ValueError):
        pid = int((state_dir / PIDFILE).read_text().strip())
        if ours(pid):
            return pid
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and ours(int(entry)):
            return int(entry)
    return None


def ensure_running(state_dir: Path, timeout: float = 15.0) -> Path:
    """The mountpoint, served by a running memfs process (started when there is none)."""
    mountpoint = state_dir / "memfs"
    if live_pid(state_dir) is not None and os.path.ismount(mountpoint):
        return mountpoint
    log_path = state_dir / "memfs.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agentenv.blockd.memfs", str(state_dir)],
                                stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # outlives blockd (module doc)
    deadline = time.monotonic() + timeout
    while not os.path.ismount(mountpoint):
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            tail = log_path.read_text(errors="replace")[-600:]
            raise RuntimeError(f"memory device mount at {mountpoint} did not come up: {tail}")
        time.sleep(0.02)
    return mountpoint


def stop(state_dir: Path, timeout: float = 10.0) -> None:
    """End the memfs process (its mount goes with it)."""
    pid = live_pid(state_dir)
    if pid is None:
        _unmount(state_dir / "memfs")
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while live_pid(state_dir) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    if live_pid(state_dir) is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _unmount(state_dir / "memfs")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m agentenv.blockd.memfs STATE_DIR")
    serve(Path(sys.argv[1]).resolve())
