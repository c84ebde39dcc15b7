"""`filesystem.Filesystem`: entry info, listing, directories, moves, removal and watches."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import shutil
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from agentenv.guest.envd.rootfs import RootFs, User
from agentenv.guest.envd.rpc import RpcError

MAX_BUFFERED_WATCH_EVENTS = 10_000
MAX_WATCHERS = 1024  # each holds an inotify descriptor until RemoveWatcher
NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "ceph", "glusterfs",
     "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "9p", "virtiofs", "lustre"}
)


def rfc3339(timestamp_ns: int) -> str:
    seconds, nanos = divmod(timestamp_ns, 1_000_000_000)
    text = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{nanos:09d}Z" if nanos else f"{text}Z"


def permission_string(mode: int) -> str:
    """Go's os.FileMode.String() for the common types: `-rw-r--r--`, `drwxr-xr-x`, `Lrwxrwxrwx`."""
    if stat.S_ISDIR(mode):
        kind = "d"
    elif stat.S_ISLNK(mode):
        kind = "L"
    elif stat.S_ISFIFO(mode):
        kind = "p"
    elif stat.S_ISSOCK(mode):
        kind = "S"
    elif stat.S_ISCHR(mode):
        kind = "c"
    elif stat.S_ISBLK(mode):
        kind = "D"
    else:
        kind = "-"
    return kind + stat.filemode(mode)[1:]


def os_error(exc: OSError, what: str) -> RpcError:
    """The Connect error for a failed filesystem call, worded with the guest path."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return RpcError("not_found", f"{what}: {reason}")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return RpcError("permission_denied", f"{what}: {reason}")
    if exc.errno == errno.ENOSPC:
        return RpcError("resource_exhausted", f"{what}: {reason}")
    if exc.errno in (errno.EINVAL, errno.ENAMETOOLONG, errno.ELOOP, errno.EISDIR, errno.ENOTEMPTY, errno.EXDEV):
        return RpcError("invalid_argument", f"{what}: {reason}")
    return RpcError("internal", f"{what}: {reason}")


class FilesystemService:
    def __init__(self, rootfs: RootFs) -> None:
        self.rootfs = rootfs
        self.watchers: dict[str, Watcher] = {}

    # ---- entries ----------------------------------------------------------------------------

    def entry_info(self, guest_path: str, host_path: str | None = None, st: os.stat_result | None = None) -> dict[str, Any]:
        host_path = host_path or self.rootfs.host_path(guest_path, follow_final=False)
        if st is None:
            st = os.lstat(host_path)
        entry: dict[str, Any] = {
            "name": os.path.basename(guest_path) or "/",
            "path": guest_path,
        }
        mode = st.st_mode
        file_type = "FILE_TYPE_FILE"
        if stat.S_ISDIR(mode):
            file_type = "FILE_TYPE_DIRECTORY"
        elif stat.S_ISLNK(mode):
            entry["isSymlink"] = True
            try:
                target_guest = self.rootfs.resolve(guest_path) if not self.rootfs.is_host_root else os.path.realpath(host_path)
                entry["symlinkTarget"] = target_guest
                target_st = os.stat(self.rootfs.host_path(target_guest, follow_final=False))
                file_type = "FILE_TYPE_DIRECTORY" if stat.S_ISDIR(target_st.st_mode) else "FILE_TYPE_FILE"
            except (OSError, RpcError):
                # A dangling link: the link itself is what there is.
                entry.setdefault("symlinkTarget", os.readlink(host_path))
                file_type = "FILE_TYPE_SYMLINK"
        entry["type"] = file_type
        if st.st_size:
            entry["size"] = str(st.st_size)
        if stat.S_IMODE(mode):
            entry["mode"] = stat.S_IMODE(mode)
        entry["permissions"] = permission_string(mode)
        entry["owner"] = self.rootfs.user_name(st.st_uid)
        entry["group"] = self.rootfs.group_name(st.st_gid)
        entry["modifiedTime"] = rfc3339(st.st_mtime_ns)
        metadata = read_metadata(host_path)
        if metadata:
            entry["metadata"] = metadata
        return entry

    def _path(self, request: dict[str, Any], user: User, name: str = "path") -> str:
        raw = request.get(name)
        if raw is None or raw == "":
            raise RpcError("invalid_argument", f"{name} is required")
        if not isinstance(raw, str):
            raise RpcError("invalid_argument", f"{name} must be a string")
        return self.rootfs.expand(raw, user)

    # ---- unary RPCs -------------------------------------------------------------------------

    def stat(self, request: dict[str, Any], user: User) -> dict[str, Any]:
        path = self._path(request, user)
        try:
            return {"entry": self.entry_info(path)}
        except OSError as exc:
            raise os_error(exc, f"path '{path}'") from None

    def make_dir(self, request: dict[str, Any], user: User) -> dict[str, Any]:
        path = self._path(request, user)
        host = self.rootfs.host_path(path)
        try:
            st = os.stat(host)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise os_error(exc, f"path '{path}'") from None
        if st is not None:
            if stat.S_ISDIR(st.st_mode):
                raise RpcError("already_exists", f"directory '{path}' already exists")
            raise RpcError("invalid_argument", f"path '{path}' already exists and is not a directory")
        try:
            ensure_dirs(host, user)
        except OSError as exc:
            raise os_error(exc, f"creating directory '{path}'") from None
        return {"entry": self.entry_info(path)}

    def move(self, request: dict[str, Any], user: User) -> dict[str, Any]:
        source = self._path(request, user, "source")
        destination = self._path(request, user, "destination")
        host_source = self.rootfs.host_path(source, follow_final=False)
        host_destination = self.rootfs.host_path(destination, follow_final=False)
        if not os.path.lexists(host_source):
            raise RpcError("not_found", f"source '{source}' does not exist")
        try:
            ensure_dirs(os.path.dirname(host_destination), user)
            os.rename(host_source, host_destination)
        except OSError as exc:
            raise os_error(exc, f"moving '{source}' to '{destination}'") from None
        return {"entry": self.entry_info(destination)}

    def list_dir(self, request: dict[str, Any], user: User) -> dict[str, Any]:
        path = self._path(request, user)
        depth = request.get("depth") or 1
        if isinstance(depth, str) and depth.isdigit():
            depth = int(depth)
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise RpcError("invalid_argument", "depth must be a non-negative integer")
        resolved = self.rootfs.resolve(path) if not self.rootfs.is_host_root else path
        host = self.rootfs.host_path(path)
        try:
            st = os.stat(host)
        except OSError as exc:
            raise os_error(exc, f"directory '{path}'") from None
        if not stat.S_ISDIR(st.st_mode):
            raise RpcError("invalid_argument", f"path '{path}' is not a directory")
        entries: list[dict[str, Any]] = []
        self._walk(host, resolved, depth, entries)
        return {"entries": entries}

    def _walk(self, host_dir: str, guest_dir: str, depth: int, out: list[dict[str, Any]]) -> None:
        try:
            with os.scandir(host_dir) as it:
                children = sorted(it, key=lambda e: e.name)
        except OSError:
            return
        for child in children:
            guest = f"{guest_dir.rstrip('/')}/{child.name}"
            try:
                st = child.stat(follow_symlinks=False)
                out.append(self.entry_info(guest, child.path, st))
            except OSError:
                continue
            if depth > 1 and stat.S_ISDIR(st.st_mode):
                self._walk(child.path, guest, depth - 1, out)

    def remove(self, request: dict[str, Any], user: User) -> dict[str, Any]:
        path = self._path(request, user)
        if path == "/":
            raise RpcError("invalid_argument", "refusing to remove '/'")
        host = self.rootfs.host_path(path, follow_final=False)
        try:
            if os.path.isdir(host) and not os.path.islink(host):
                shutil.rmtree(host)
            else:
                os.unlink(host)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise os_error(exc, f"removing '{path}'") from None
        return {}

    # ---- watches ----------------------------------------------------------------------------

    def open_watcher(self, request: dict[str, Any], user: User) -> Watcher:
        path = self._path(request, user)
        recursive = bool(request.get("recursive"))
        include_entry = bool(request.get("includeEntry", request.get("include_entry")))
        allow_network = bool(request.get("allowNetworkMounts", request.get("allow_network_mounts")))
        host = self.rootfs.host_path(path)
        try:
            st = os.stat(host)
        except OSError as exc:
            raise os_error(exc, f"path '{path}'") from None
        if not stat.S_ISDIR(st.st_mode):
            raise RpcError("invalid_argument", f"path '{path}' is not a directory")
        if not allow_network and filesystem_type(host) in NETWORK_FILESYSTEMS:
            raise RpcError("invalid_argument", f"path '{path}' is on a network mount; set allow_network_mounts to watch it")
        watcher = Watcher(self, path, host, include_entry)
        try:
            from agentenv.guest.envd.inotify import InotifyWatch  # ctypes: imported on first use
        except ImportError as exc:
            raise RpcError("unimplemented", f"directory watches are unavailable here: {exc}") from None
        try:
            watcher.watch = InotifyWatch(host, recursive, watcher.on_raw_events)
        except OSError as exc:
            raise os_error(exc, f"watching '{path}'") from None
        watcher.watch.start()
        return watcher

    def create_watcher(self, request: dict[str, Any], user: User) -> dict[str, Any]:
        if len(self.watchers) >= MAX_WATCHERS:
            raise RpcError("resource_exhausted", f"too many watchers ({MAX_WATCHERS}); remove some first")
        watcher = self.open_watcher(request, user)
        watcher_id = os.urandom(16).hex()
        self.watchers[watcher_id] = watcher
        return {"watcherId": watcher_id}

    def _watcher(self, request: dict[str, Any]) -> tuple[str, Watcher]:
        watcher_id = request.get("watcherId", request.get("watcher_id"))
        watcher = self.watchers.get(watcher_id) if isinstance(watcher_id, str) else None
        if watcher is None:
            raise RpcError("not_found", f"watcher with id {watcher_id} not found")
        return watcher_id, watcher

    def get_watcher_events(self, request: dict[str, Any]) -> dict[str, Any]:
        _, watcher = self._watcher(request)
        events = list(watcher.buffer)
        watcher.buffer.clear()
        return {"events": events} if events else {}

    def remove_watcher(self, request: dict[str, Any]) -> dict[str, Any]:
        watcher_id, watcher = self._watcher(request)
        del self.watchers[watcher_id]
        watcher.close()
        return {}

    def close(self) -> None:
        for watcher in self.watchers.values():
            watcher.close()
        self.watchers.clear()


@dataclass
class Watcher:
    service: FilesystemService
    guest_dir: str
    host_dir: str
    include_entry: bool
    watch: Any = None
    buffer: list[dict[str, Any]] = field(default_factory=list)
    queue: asyncio.Queue[dict[str, Any]] | None = None

    def on_raw_events(self, raw_events: list[Any]) -> None:
        from agentenv.guest.envd import inotify as ino

        for raw in raw_events:
            mask = raw.mask
            if mask & ino.IN_Q_OVERFLOW:
                continue
            if mask & (ino.IN_CREATE | ino.IN_MOVED_TO):
                kinds = ["EVENT_TYPE_CREATE"]
            elif mask & (ino.IN_MODIFY | ino.IN_CLOSE_WRITE):
                kinds = ["EVENT_TYPE_WRITE"]
            elif mask & (ino.IN_DELETE | ino.IN_DELETE_SELF):
                kinds = ["EVENT_TYPE_REMOVE"]
            elif mask & ino.IN_MOVED_FROM:
                kinds = ["EVENT_TYPE_RENAME"]
            elif mask & ino.IN_ATTRIB:
                kinds = ["EVENT_TYPE_CHMOD"]
            else:
                continue
            for kind in kinds:
                event: dict[str, Any] = {"name": raw.relative_path, "type": kind}
                if self.include_entry and kind in ("EVENT_TYPE_CREATE", "EVENT_TYPE_WRITE", "EVENT_TYPE_CHMOD"):
                    guest = f"{self.guest_dir.rstrip('/')}/{raw.relative_path}"
                    with contextlib.suppress(OSError, RpcError):
                        event["entry"] = self.service.entry_info(guest)
                if self.queue is not None:
                    self.queue.put_nowait(event)
                elif len(self.buffer) < MAX_BUFFERED_WATCH_EVENTS:
                    self.buffer.append(event)

    async def stream(self, keepalive_seconds: float) -> AsyncIterator[dict[str, Any]]:
        self.queue = asyncio.Queue()
        try:
            yield {"start": {}}
            while True:
                try:
                    event = await asyncio.wait_for(self.queue.get(), keepalive_seconds)
                except TimeoutError:
                    yield {"keepalive": {}}
                    continue
                yield {"filesystem": event}
        finally:
            self.close()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None


def ensure_dirs(host_dir: str, user: User) -> None:
    """mkdir -p, giving each directory it creates to the user."""
    missing: list[str] = []
    current = host_dir
    while current and not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        os.mkdir(directory, 0o755)
        if os.geteuid() == 0:
            os.chown(directory, user.uid, user.gid)


XATTR_PREFIX = "user.e2b."


def read_metadata(host_path: str) -> dict[str, str]:
    try:
        names = os.listxattr(host_path, follow_symlinks=False)
    except OSError:
        return {}
    metadata: dict[str, str] = {}
    for name in itertools.islice((n for n in names if n.startswith(XATTR_PREFIX)), 256):
        with contextlib.suppress(OSError):
            metadata[name[len(XATTR_PREFIX) :]] = os.getxattr(host_path, name, follow_symlinks=False).decode(errors="replace")
    return metadata


def replace_metadata(fd: int, metadata: dict[str, str]) -> None:
    """Make `metadata` the file's whole metadata: an overwrite drops what the old content
    carried (as E2B's envd does), then the new keys are set."""
    for name in os.listxattr(fd):
        if name.startswith(XATTR_PREFIX) and name[len(XATTR_PREFIX) :] not in metadata:
            try:
                os.removexattr(fd, name)
            except OSError as exc:
                if exc.errno != errno.ENODATA:  # ENODATA: removed meanwhile
                    raise
    for key, value in metadata.items():
        os.setxattr(fd, XATTR_PREFIX + key, value.encode())


def filesystem_type(host_path: str) -> str:
    """The filesystem type of the mount holding host_path (longest mount-point prefix)."""
    best, best_type = "", ""
    real = os.path.realpath(host_path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount_point = fields[4].replace("\\040", " ")
                if (real == mount_point or real.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) >= len(best):
                    best, best_type = mount_point, right.split()[0]
    except OSError:
        return ""
    return best_type
