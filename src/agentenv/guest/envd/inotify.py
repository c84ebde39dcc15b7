"""Directory watches on Linux inotify (through ctypes: the standard library has no binding)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

WATCH_MASK = (
    IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
)
_HEADER = struct.Struct("iIII")

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc = libc
    return _libc


@dataclass(frozen=True)
class RawEvent:
    relative_path: str  # relative to the watched root directory
    mask: int


class InotifyWatch:
    """Watches one directory (and, when recursive, every directory below it, including new ones)."""

    def __init__(self, host_dir: str, recursive: bool, on_events: Callable[[list[RawEvent]], None]) -> None:
        self.host_dir = host_dir.rstrip("/") or "/"
        self.recursive = recursive
        self.on_events = on_events
        self._dirs: dict[int, str] = {}  # watch descriptor -> directory relative to the root
        fd = _lib().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd = fd
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            self._add(self.host_dir, "")
            if recursive:
                self._add_tree(self.host_dir, "")
        except BaseException:
            os.close(fd)
            raise

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.fd, self._on_readable)

    def close(self) -> None:
        if self.fd < 0:
            return
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
        os.close(self.fd)
        self.fd = -1

    def _add(self, host_path: str, relative: str) -> None:
        wd = _lib().inotify_add_watch(self.fd, os.fsencode(host_path), WATCH_MASK | IN_ONLYDIR | IN_DONT_FOLLOW)
        if wd < 0:
            err = ctypes.get_errno()
            if relative and err in (errno.ENOENT, errno.ENOTDIR):
                return  # gone again before we got to it
            raise OSError(err, os.strerror(err), host_path)
        self._dirs[wd] = relative

    def _add_tree(self, host_path: str, relative: str) -> None:
        with contextlib.suppress(OSError), os.scandir(host_path) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    child_rel = f"{relative}/{entry.name}" if relative else entry.name
                    self._add(entry.path, child_rel)
                    self._add_tree(entry.path, child_rel)

    def _on_readable(self) -> None:
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return
        except OSError:
            return
        events: list[RawEvent] = []
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            raw_name = data[offset + _HEADER.size : offset + _HEADER.size + length]
            offset += _HEADER.size + length
            name = raw_name.split(b"\0", 1)[0].decode(errors="surrogateescape")
            if mask & IN_IGNORED:
                self._dirs.pop(wd, None)
                continue
            base = self._dirs.get(wd)
            if base is None:
                continue
            relative = f"{base}/{name}" if base and name else (base or name)
            if mask & IN_DELETE_SELF and base:
                continue  # reported as IN_DELETE by the parent directory
            events.append(RawEvent(relative, mask))
            if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                host_path = os.path.join(self.host_dir, relative)
                self._add(host_path, relative)
                self._add_tree(host_path, relative)
        if events:
            self.on_events(events)
