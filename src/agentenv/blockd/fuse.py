"""Every blockd device as a regular file: one FUSE mount (STATE/fuse), a file per device id.

libfuse runs its own worker threads (mfusepy, libfuse 3); each call is handed to the daemon's
event loop and goes through the device exactly like an NBD request (same gate, same counters),
so a snapshot or pool swap never races a FUSE write. A write runs on the loop itself when the
gate admits it at once (`Device.write_now`): one thread hop per request rather than three,
which is what a loop-mounted ext4 flushing hundreds of MiB (template conversion) waits on.
Files are opened with direct_io: the kernel keeps no page cache for them, so what a loop mount
reads is always what the device holds, even after a swap or restack. fallocate(PUNCH_HOLE) maps to discard and
fallocate(ZERO_RANGE) to write-zeroes, so `mkfs`/loop discards reach the image.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import stat
import subprocess
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import mfusepy

if TYPE_CHECKING:
    from agentenv.blockd.device import Device

log = logging.getLogger("agentenv.blockd.fuse")

T = TypeVar("T")

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
CALL_TIMEOUT = 300.0


async def _write(device: Device, offset: int, data: bytes) -> None:
    # On the loop itself when the gate is open and no flush runs (one thread hop per FUSE
    # write instead of three: loop, I/O thread, loop); else through the I/O threads.
    if not device.write_now(offset, data):
        await device.write(offset, data, False)


class _DeviceFiles(mfusepy.Operations):
    use_ns = True

    def __init__(self, loop: asyncio.AbstractEventLoop, devices: dict[str, Device]) -> None:
        self.loop = loop
        self.devices = devices
        self.started = time.time_ns()
        self.uid, self.gid = os.geteuid(), os.getegid()

    def _device(self, path: str) -> Device:
        device = self.devices.get(path.lstrip("/"))
        if device is None or "/" in path.lstrip("/"):
            raise mfusepy.FuseOSError(errno.ENOENT)
        return device

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_TIMEOUT)
        except mfusepy.FuseOSError:
            raise
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno or errno.EIO) from exc
        except Exception as exc:
            log.warning("FUSE request failed", extra={"error": str(exc)})
            raise mfusepy.FuseOSError(errno.EIO) from exc

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        times = {"st_atime": self.started, "st_mtime": self.started, "st_ctime": self.started}
        owner = {"st_uid": self.uid, "st_gid": self.gid}
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2, **owner, **times}
        device = self._device(path)
        # The mount allows other users in (VMMs may run as one); the kernel checks these
        # modes (default_permissions), so a disk is the daemon owner's alone.
        mode = 0o400 if device.readonly else 0o600
        return {
            "st_mode": stat.S_IFREG | mode,
            **owner,
            "st_nlink": 1,
            "st_size": device.size,
            "st_blocks": (device.size + 511) // 512,
            "st_blksize": 4096,
            **times,
        }

    def readdir(self, path: str, fh: Any) -> list[str]:
        if path != "/":
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        return [".", "..", *sorted(self.devices)]

    def open(self, path: str, fi: Any) -> int:
        device = self._device(path)
        if device.readonly and (fi.flags & os.O_ACCMODE) != os.O_RDONLY:
            raise mfusepy.FuseOSError(errno.EROFS)
        fi.direct_io = 1
        fi.keep_cache = 0
        return 0

    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        device = self._device(path)
        end = min(offset + size, device.size)
        if end <= offset:
            return b""
        data = self._run(device.read(offset, end - offset))
        # mfusepy hands the result to ctypes.memmove, which takes bytes but not bytearray.
        return data if isinstance(data, bytes) else bytes(data)

    def write(self, path: str, data: bytes, offset: int, fh: Any) -> int:
        device = self._device(path)
        if device.readonly:
            raise mfusepy.FuseOSError(errno.EROFS)
        if offset + len(data) > device.size:
            raise mfusepy.FuseOSError(errno.ENOSPC)
        self._run(_write(device, offset, data))
        return len(data)

    def truncate(self, path: str, length: int, fh: Any = None) -> int:
        device = self._device(path)
        if length != device.size:
            # The size of a disk changes through `resize`, not by truncating its file.
            raise mfusepy.FuseOSError(errno.EPERM)
        return 0

    def fallocate(self, path: str, mode: int, offset: int, size: int, fh: Any) -> int:
        device = self._device(path)
        if device.readonly:
            raise mfusepy.FuseOSError(errno.EROFS)
        if offset + size > device.size:
            raise mfusepy.FuseOSError(errno.EINVAL)
        if mode & FALLOC_FL_PUNCH_HOLE:
            self._run(device.trim(offset, size, False))
        elif mode & FALLOC_FL_ZERO_RANGE:
            self._run(device.write_zeroes(offset, size, False))
        elif mode & ~FALLOC_FL_KEEP_SIZE:
            raise mfusepy.FuseOSError(errno.EOPNOTSUPP)
        return 0  # plain allocation within the size: every byte already exists

    def flush(self, path: str, fh: Any) -> int:
        return 0

    def fsync(self, path: str, datasync: int, fh: Any) -> int:
        device = self._device(path)
        if not device.readonly:
            self._run(device.flush())
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_namemax": 255}


class FuseFiles:
    """The FUSE mount of a daemon, run in a thread of its own."""

    def __init__(
        self, mountpoint: Path, loop: asyncio.AbstractEventLoop, devices: dict[str, Device]
    ) -> None:
        self.mountpoint = Path(mountpoint)
        self.loop = loop
        self.devices = devices
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @staticmethod
    def _unmount(mountpoint: Path) -> None:
        subprocess.run(
            ["fusermount3", "-u", "-z", "-q", str(mountpoint)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
        )

    def _main(self) -> None:
        try:
            mfusepy.FUSE(
                _DeviceFiles(self.loop, self.devices),
                str(self.mountpoint),
                foreground=True,
                raw_fi=True,
                fsname="aenv-blockd",
                # VMMs may run as other users; only root may allow them without fuse.conf.
                allow_other=os.geteuid() == 0,
                default_permissions=True,
                attr_timeout=0,
                entry_timeout=0,
            )
        except BaseException as exc:
            self._error = exc

    async def start(self, timeout: float = 10.0) -> None:
        # A previous run killed with -9 leaves a dead mount behind ("transport endpoint is
        # not connected"): detach it before mounting again.
        await asyncio.to_thread(self._unmount, self.mountpoint)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._main, name="blockd-fuse", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if not self._thread.is_alive():
                raise RuntimeError(f"FUSE mount at {self.mountpoint} failed: {self._error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"FUSE mount at {self.mountpoint} did not appear in {timeout} s")
            await asyncio.sleep(0.01)
        log.info("FUSE mounted", extra={"mountpoint": str(self.mountpoint)})

    async def stop(self) -> None:
        if self._thread is None:
            return
        await asyncio.to_thread(self._unmount, self.mountpoint)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._thread.join, 5.0)
        self._thread = None
