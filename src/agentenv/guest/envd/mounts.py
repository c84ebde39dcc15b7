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

A shared read-write volume (docs/volumes.md §7.1) is not a disk but an export of the node's NFS
server: `{"kind": "nfs", "export": "/volumes/<id>", "path", "readOnly"}`, mounted with mount(2)
as NFSv4.1 from 169.254.169.254:2049 (the same address in every slot: the host redirects it to
its server, runtime/network.py), `hard` (a guest never sees EIO because the server restarted or
its slot is being moved: it waits), `nosuid,nodev`. The kernel's NFSv4 client must be loaded:
stage 1 loads it at boot, or envd loads it from the tools disk before the first NFS mount
(`load_nfs_modules`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import re
from dataclasses import dataclass
from typing import Any

BLKFLSBUF = 0x1261
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MAX_MOUNTS = 16
NFS_SERVER = "169.254.169.254"
#: mount(2)'s data for an NFS volume. vers=4.1: ganesha 4.3's 4.2 read a fresh file as NULs
#: (READ_PLUS); addr= because the kernel resolves nothing itself (mount.nfs would).
NFS_OPTIONS = f"vers=4.1,proto=tcp,port=2049,addr={NFS_SERVER},hard,timeo=50"
_EXPORT = re.compile(r"^/volumes/[A-Za-z0-9_-]{1,128}$")
#: where envd finds the NFS client's modules when stage 1 did not load them: a file listing
#: them in load order, relative to its directory (guest/build/tools.py puts them there)
NFS_MODULES_ORDER = "/agentenv/modules/nfs.order"


class MountError(Exception):
    pass


class NoNfsClient(MountError):
    """The guest kernel has no NFSv4 client and cannot load one (envd's /init: 400)."""


@dataclass(frozen=True)
class VolumeMount:
    serial: str  # a disk's serial ("" for nfs)
    path: str
    read_only: bool
    kind: str = "disk"  # or "nfs"
    export: str = ""  # nfs: the export's path on the server, /volumes/<id>

    @property
    def source(self) -> str:
        return f"{NFS_SERVER}:{self.export}"


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
        kind = item.get("kind", "disk")
        serial, path, read_only = item.get("serial"), item.get("path"), item.get("readOnly")
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
            raise ValueError("a volume mount's path must be an absolute path")
        if not isinstance(read_only, bool):
            raise ValueError("a volume mount's readOnly must be a boolean")
        if kind == "nfs":
            export = item.get("export")
            if not isinstance(export, str) or not _EXPORT.match(export):
                raise ValueError("an nfs volume mount's export must be /volumes/<id>")
            found.append(VolumeMount("", os.path.normpath(path), read_only, "nfs", export))
            continue
        if kind != "disk":
            raise ValueError("a volume mount's kind must be disk or nfs")
        if not isinstance(serial, str) or not serial or "/" in serial:
            raise ValueError("a volume mount's serial must be a device serial")
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


def _nfs_mounted(path: str, source: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether `source` is mounted (nfs4) at `path` (a resumed or forked guest kept it);
    MountError when something else is."""
    with open(mountinfo) as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and _unescape(fields[4]) == path:
                rest = fields[fields.index("-") + 1:] if "-" in fields else []
                if len(rest) >= 2 and rest[0] == "nfs4" and _unescape(rest[1]) == source:
                    return True
                raise MountError(f"{path} has another file system mounted on it")
    return False


def _has_nfs4(module_dir: str) -> bool:
    # Not /proc/filesystems: `nfs` registers "nfs4" there already, and the kernel would then
    # ask for `nfsv4` by request_module, which finds no modprobe in the guest.
    return os.path.isdir(module_dir)


def load_nfs_modules(order_file: str = NFS_MODULES_ORDER,
                     module_dir: str = "/sys/module/nfsv4") -> list[str]:
    """Load the NFSv4 client unless the kernel has it (stage 1 loaded it): the modules
    `order_file` lists, in that order (dependencies first), with finit_module. Returns the
    modules loaded; MountError when the client is missing and cannot be loaded."""
    if _has_nfs4(module_dir):
        return []
    try:
        with open(order_file) as f:
            names = [line.strip() for line in f if line.strip()]
    except OSError:
        raise NoNfsClient("the guest kernel has no NFSv4 client (no nfs4 file system, and no "
                         f"modules at {order_file}): the template was made before shared "
                         "volumes, build it again") from None
    base = os.path.dirname(order_file)
    libc = _libc()
    loaded = []
    for name in names:
        fd = os.open(os.path.join(base, name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.syscall(313, fd, b"", 0) != 0:  # finit_module (x86-64)
                err = ctypes.get_errno()
                if err != 17:  # EEXIST: loaded already
                    raise MountError(f"loading {name}: {os.strerror(err)}")
        finally:
            os.close(fd)
        loaded.append(name)
    if not _has_nfs4(module_dir):
        raise MountError("the NFSv4 client's modules loaded but the kernel has no nfsv4")
    return loaded


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def mount_all(mounts: list[VolumeMount]) -> None:
    """Mount every volume that is not mounted yet; MountError names the first that fails."""
    for mount in mounts:
        if mount.kind == "nfs":
            _mount_nfs(mount)
            continue
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


def _mount_nfs(mount: VolumeMount) -> None:
    try:
        if _nfs_mounted(mount.path, mount.source):
            return
        load_nfs_modules()
        os.makedirs(mount.path, mode=0o755, exist_ok=True)
        flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if mount.read_only else 0)
        if _libc().mount(mount.source.encode(), mount.path.encode(), b"nfs4", flags,
                         NFS_OPTIONS.encode()) != 0:
            err = ctypes.get_errno()
            raise MountError(os.strerror(err))
    except NoNfsClient as exc:
        raise NoNfsClient(f"mounting the shared volume {mount.export} at {mount.path}: "
                          f"{exc}") from None
    except (OSError, MountError) as exc:
        raise MountError(f"mounting the shared volume {mount.export} at {mount.path}: "
                         f"{exc}") from None
