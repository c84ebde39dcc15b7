"""File-system helpers for state that must stay private and survive a crash.

`atomic_write` leaves either the old file or the complete new one, never a torn or empty file:
the data goes to a temporary file in the same directory, is fsynced, renamed over the target,
and the directory is fsynced so that the rename itself survives a power loss. Every record the
node and blockd read back after a crash is written this way.
`private_dir` makes a directory unreadable to other users: mode 0700, except that group
search is kept on a directory handed to another group (the privilege setup,
runtime/privilege.py, gives the VM user's group search on the directories QEMU reaches by
path, such as blockd's NBD sockets).
`write_private` is `atomic_write` with mode 0600 (or first-writer-wins with `exclusive`).
`require_free_space` refuses a pull or an upload up front when it would leave less than the
reserve free; `SpaceGuard` checks again while it writes (every few MiB), so that writers that
each found room before they started (concurrent pulls, uploads, a body longer than announced)
cannot together take the reserve: the writer stops with an error naming the reserve and
removes what it wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from agentenv.errors import AgentEnvError
from agentenv.settings import setting_text


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


def _write_temp(path: Path, raw: bytes, mode: int) -> Path:
    """`raw` in a fsynced temporary file beside `path` (the pid in its name: two processes
    saving the same record never share a temporary file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return tmp


def atomic_write(path: Path | str, data: bytes | str, *, mode: int = 0o600) -> None:
    """Replace `path` with `data` atomically and durably (temp file, fsync, rename, fsync dir)."""
    path = Path(path)
    tmp = _write_temp(path, data.encode() if isinstance(data, str) else data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path | str, obj: Any, *, indent: int | None = None,
                      mode: int = 0o600) -> None:
    atomic_write(path, json.dumps(obj, indent=indent), mode=mode)


def write_private(path: Path, data: bytes, *, exclusive: bool = False) -> bool:
    """Write `data` to `path` with mode 0600, atomically and durably; with `exclusive` a file
    already there wins (the new one is linked, not renamed) and False is returned."""
    path = Path(path)
    if not exclusive:
        atomic_write(path, data, mode=0o600)
        return True
    tmp = _write_temp(path, data, 0o600)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_dir(path.parent)
    return True


DEFAULT_RESERVE = 256 << 20


class InsufficientSpace(AgentEnvError):
    """Not enough free disk space for an operation (checked before it writes anything, and
    while it writes: SpaceGuard)."""


def disk_reserve() -> int:
    """Bytes that must stay free on the state filesystem after a pull or an upload
    (AENV_DISK_RESERVE, default 256 MiB): running sandboxes' uppers and records need room."""
    raw = setting_text("AENV_DISK_RESERVE")
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


def require_free_space(path: Path, need: int, what: str, *, reserve: int | None = None,
                       setting: str = "AENV_DISK_RESERVE") -> None:
    """Raise InsufficientSpace unless `need` bytes fit under `path` with the reserve left
    (nothing to write, nothing to refuse). A caller with a higher floor than
    AENV_DISK_RESERVE passes it as `reserve`, with the `setting` that names it."""
    if need <= 0:
        return
    reserve = disk_reserve() if reserve is None else reserve
    free = free_bytes(path)
    if free < need + reserve:
        raise InsufficientSpace(
            f"not enough free disk space for {what}: it needs about {_mib(need)}, "
            f"{_mib(reserve)} must stay free ({setting}), and {path} has "
            f"{_mib(free)} free")


#: bytes a SpaceGuard lets be written between two looks at the free space
SPACE_CHECK_BYTES = 16 << 20


class SpaceGuard:
    """The reserve kept while a writer writes under `path`: `wrote(n)` after each write looks
    at the free space every `every` bytes and raises InsufficientSpace (naming `what` and the
    `setting` of the reserve) once less than `reserve` is free. The writer then removes what
    it wrote: nothing half-written stays (its temporary file is never renamed into place)."""

    def __init__(self, path: Path, what: str, *, reserve: int | None = None,
                 setting: str = "AENV_DISK_RESERVE", every: int = SPACE_CHECK_BYTES) -> None:
        self.path = Path(path)
        self.what = what
        self.reserve = disk_reserve() if reserve is None else reserve
        self.setting = setting
        self.every = every
        self.written = 0
        self._checked = 0

    def wrote(self, n: int) -> None:
        self.written += n
        if self.written - self._checked >= self.every:
            self._checked = self.written
            self.check()

    def check(self) -> None:
        free = free_bytes(self.path)
        if free < self.reserve:
            raise InsufficientSpace(
                f"not enough free disk space for {self.what}: {self.path} has {_mib(free)} "
                f"free after {_mib(self.written)} written, under the {_mib(self.reserve)} "
                f"that must stay free ({self.setting}); stopped, nothing of it kept")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def read_pem(path: str | Path, setting: str) -> bytes:
    """A PEM file named by `setting` (a certificate, key or CA), read and checked at start: a
    bad file stops the component with the setting named, not a later connection."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise AgentEnvError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise AgentEnvError(f"{setting}: {path} holds no PEM")
    return data
