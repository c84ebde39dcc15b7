"""File-system helpers for state that must stay private and survive a crash.

`private_dir` makes a directory unreadable to other users: mode 0700, except that group
search is kept on a directory handed to another group (the privilege setup,
runtime/privilege.py, gives the VM user's group search on the directories QEMU reaches by
path, such as blockd's NBD sockets).
`write_private` replaces a file atomically and durably with mode 0600: temp file, fsync,
rename, fsync of the directory. `require_free_space` refuses a pull or an upload up front
when it would leave less than the reserve free.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from agentenv.errors import AgentEnvError


def private_dir(path: Path) -> Path:
    """Create `path` (and missing parents, 0700) and take every permission from others."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    handed_over = st.st_gid != os.getegid()
    wanted = 0o700 | (mode & stat.S_IXGRP if handed_over else 0)
    if mode != wanted:
        os.chmod(path, wanted)
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_private(path: Path, data: bytes, *, exclusive: bool = False) -> bool:
    """Write `data` to `path` with mode 0600: temp file, fsync, rename (or, with `exclusive`,
    link: a file already there wins and False is returned), fsync of the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        else:
            os.replace(tmp, path)
        fsync_dir(path.parent)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


DEFAULT_RESERVE = 256 << 20


class InsufficientSpace(AgentEnvError):
    """Not enough free disk space for an operation (checked before it writes anything)."""


def disk_reserve() -> int:
    """Bytes that must stay free on the state filesystem after a pull or an upload
    (AENV_DISK_RESERVE, default 256 MiB): running sandboxes' uppers and records need room."""
    raw = os.environ.get("AENV_DISK_RESERVE", "")
    try:
        return int(raw) if raw else DEFAULT_RESERVE
    except ValueError:
        raise AgentEnvError(f"AENV_DISK_RESERVE must be a number of bytes, got {raw!r}") from None


def free_bytes(path: Path) -> int:
    """Free bytes (for an unprivileged writer) on the filesystem of `path` or of its nearest
    existing parent."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def require_free_space(path: Path, need: int, what: str) -> None:
    """Raise InsufficientSpace unless `need` bytes fit under `path` with the reserve left
    (nothing to write, nothing to refuse)."""
    if need <= 0:
        return
    reserve = disk_reserve()
    free = free_bytes(path)
    if free < need + reserve:
        raise InsufficientSpace(
            f"not enough free disk space for {what}: it needs about {_mib(need)}, "
            f"{_mib(reserve)} must stay free (AENV_DISK_RESERVE), and {path} has "
            f"{_mib(free)} free")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
