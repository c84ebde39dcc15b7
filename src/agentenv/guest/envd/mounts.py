"""Volume disks mounted at `/init` (our extension, not in E2B's envd; docs/volumes.md §6).

The host gives every machine empty volume disks (virtio-blk, serial `aenv-vol<N>`); a create
or resume that mounts volumes puts a volume's ext4 in a slot and lists it in /init's
`volumeMounts`: `[{"serial", "path", "readOnly"}]`. envd mounts each before it answers, so a
sandbox is handed over with its volumes in place. A mount already in place (a resumed or forked
guest kept it in memory) is left as it is.

The guest's kernel read the slot as an empty disk when it booted (the template's snapshot):
its cached blocks are dropped (BLKFLSBUF) before the file system is read. A read-only volume
is mounted `ro,noload` (its journal is clean and never replayed: the disk is shared), a
copy-on-write one read-write (its writes go to the sandbox's own upper on the host). Both get
`nosuid,nodev`: a volume is data, not a way to root or to devices.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
from dataclasses import dataclass
from typing import Any

BLKFLSBUF = 0x1261
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MAX_MOUNTS = 16


class MountError(Exception):
    pass


@dataclass(frozen=True)
class VolumeMount:
    serial: str
    path: str
    read_only: bool


def parse(raw: Any) -> list[VolumeMount]:
    """/init's `volumeMounts`; ValueError names what is wrong."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_MOUNTS:
        raise ValueError(f"volumeMounts must be a list of at most {MAX_MOUNTS} objects")
    found = []
    for item in raw:
        if not isinstance(item, dict):
            raise ValueError("volumeMounts must be a list of objects")
        serial, path, read_only = item.get("serial"), item.get("path"), item.get("readOnly")
        if not isinstance(serial, str) or not serial or "/" in serial:
            raise ValueError("a volume mount's serial must be a device serial")
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
            raise ValueError("a volume mount's path must be an absolute path")
        if not isinstance(read_only, bool):
            raise ValueError("a volume mount's readOnly must be a boolean")
        found.append(VolumeMount(serial, os.path.normpath(path), read_only))
    return found


def _device(serial: str) -> str:
    """/dev/<name> of the disk whose serial is `serial`."""
    for name in sorted(os.listdir("/sys/block")):
        try:
            with open(f"/sys/block/{name}/serial") as f:
                if f.read().strip() == serial:
                    return f"/dev/{name}"
        except OSError:
            continue  # a disk without a serial (the root disk on SCSI, loop devices)
    raise MountError(f"no disk with serial {serial!r}")


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _mounted(path: str, device: str) -> bool:
    """Whether `device` is mounted at `path`; MountError when something else is."""
    rdev = os.stat(device).st_rdev
    wanted = f"{os.major(rdev)}:{os.minor(rdev)}"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and _unescape(fields[4]) == path:
                if fields[2] == wanted:
                    return True
                raise MountError(f"{path} has another file system mounted on it")
    return False


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def mount_all(mounts: list[VolumeMount]) -> None:
    """Mount every volume that is not mounted yet; MountError names the first that fails."""
    for mount in mounts:
        try:
            device = _device(mount.serial)
            if _mounted(mount.path, device):
                continue
            os.makedirs(mount.path, mode=0o755, exist_ok=True)
            fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, BLKFLSBUF)  # what the kernel cached of the empty slot
            finally:
                os.close(fd)
            flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if mount.read_only else 0)
            options = b"noload" if mount.read_only else b""
            if _libc().mount(device.encode(), mount.path.encode(), b"ext4", flags,
                             options) != 0:
                err = ctypes.get_errno()
                raise MountError(os.strerror(err))
        except (OSError, MountError) as exc:
            raise MountError(f"mounting the volume disk {mount.serial} at {mount.path}: "
                             f"{exc}") from None
