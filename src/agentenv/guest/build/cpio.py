"""A newc ("070701") cpio writer for the initramfs.

Written here rather than driving cpio(1) so that the archive can hold /dev/console (the kernel
opens it for PID 1's stdio before init runs) without mknod on the host, with fixed owners and
timestamps so the same inputs give the same bytes."""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import BinaryIO


@dataclass(frozen=True)
class Entry:
    path: str  # relative, no leading slash
    mode: int  # including the file type bits
    data: bytes = b""
    rdev_major: int = 0
    rdev_minor: int = 0


def directory(path: str, perm: int = 0o755) -> Entry:
    return Entry(path, stat.S_IFDIR | perm)


def regular(path: str, data: bytes, perm: int = 0o644) -> Entry:
    return Entry(path, stat.S_IFREG | perm, data)


def symlink(path: str, target: str) -> Entry:
    return Entry(path, stat.S_IFLNK | 0o777, target.encode())


def chardev(path: str, major: int, minor: int, perm: int = 0o600) -> Entry:
    return Entry(path, stat.S_IFCHR | perm, b"", major, minor)


def _pad(out: BinaryIO, length: int) -> None:
    out.write(b"\0" * (-length % 4))


def _header(ino: int, entry: Entry, nlink: int) -> bytes:
    name = entry.path.encode() + b"\0"
    fields = (ino, entry.mode, 0, 0, nlink, 0, len(entry.data), 0, 0,
              entry.rdev_major, entry.rdev_minor, len(name), 0)
    return b"070701" + b"".join(f"{v:08x}".encode() for v in fields) + name


def write(out: BinaryIO, entries: list[Entry]) -> None:
    """Writes the entries (parents before children) and the trailer."""
    for ino, entry in enumerate(entries, start=1):
        header = _header(ino, entry, 2 if stat.S_ISDIR(entry.mode) else 1)
        out.write(header)
        _pad(out, len(header))
        out.write(entry.data)
        _pad(out, len(entry.data))
    trailer = _header(0, Entry("TRAILER!!!", 0), 1)
    out.write(trailer)
    _pad(out, len(trailer))
