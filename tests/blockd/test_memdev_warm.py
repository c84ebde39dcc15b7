"""The startup pack's load pages (runtime/memdev.py) on a real blockd and memfs: the pages a
process mapped of a memory device's file (QEMU between its device-state load and `cont`) are
read from its page tables (`present_ranges`), kept with the snapshot, and every later acquire of
the device reads exactly those pages back into the page cache (seen by mincore on the FUSE
file). No QEMU: the test maps the file itself and touches the pages a load would."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.runtime import memdev, memory
from agentenv.runtime.memdev import PACK_NAME, SharedMemoryDevices
from agentenv.runtime.memory import MemoryFileCache, present_ranges

from .conftest import Daemon, Stack

PAGE = 4096
MiB = 1 << 20

pytestmark = pytest.mark.root

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def resident(path: Path, size: int) -> set[int]:
    """Offsets of the pages of `path` in the page cache (mincore over a mapping of it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return {i * PAGE for i, b in enumerate(vec.raw) if b & 1}
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_for(predicate: object, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def devices(daemon: Daemon, short_tmp: Path) -> Iterator[SharedMemoryDevices]:
    yield SharedMemoryDevices(daemon.socket, MemoryFileCache(short_tmp / "memfiles"),
                              short_tmp / "runtime")


def test_load_pages_recorded_and_read_back_at_each_acquire(
        daemon: Daemon, devices: SharedMemoryDevices, stack: Stack,
        monkeypatch: pytest.MonkeyPatch) -> None:
    snap_dir = stack.lowers[-1].parent
    pack = snap_dir / PACK_NAME
    # What a restore's start and device-state load fault in: a few pages in a few MiB, one
    # of them written (copied on write, as QEMU's vmgenid page).
    touched = [MiB + 2 * PAGE, 5 * MiB, 5 * MiB + PAGE, 5 * MiB + 2 * PAGE, 11 * MiB + 7 * PAGE]
    written = 11 * MiB + 7 * PAGE
    expected = [(MiB + 2 * PAGE, PAGE), (5 * MiB, 3 * PAGE), (11 * MiB + 7 * PAGE, PAGE)]
    later = 14 * MiB  # read once the guest runs: not the load's

    path = devices.acquire("snap", stack.lowers, stack.size)
    try:
        fd = os.open(path, os.O_RDONLY)  # as QEMU holds it (runtime/qemu.py, _ramopen.c)
        try:
            addr = _libc.mmap(None, stack.size, 3, 2, fd, 0)  # PROT_READ|WRITE, MAP_PRIVATE
            assert addr not in (None, ctypes.c_void_p(-1).value)
        finally:
            os.close(fd)
        try:
            assert _libc.madvise(addr, stack.size, 1) == 0  # MADV_RANDOM: no read-around
            for offset in touched:
                assert ctypes.string_at(addr + offset, 8) == stack.expected[offset:offset + 8]
            ctypes.memset(addr + written, 0x5A, 1)
            assert devices.wants_load_pages("snap")
            assert not devices.wants_load_pages("snap")  # one restore records
            ranges = present_ranges(os.getpid(), addr, stack.size)
            assert ranges == expected
            # Without PAGEMAP_SCAN (before Linux 6.7): the same from the whole pagemap.
            def unsupported(*args: object) -> None:
                raise OSError(errno.ENOTTY, "no PAGEMAP_SCAN")

            monkeypatch.setattr(memory, "_scan_present", unsupported)
            assert present_ranges(os.getpid(), addr, stack.size) == expected
            monkeypatch.undo()
            ctypes.string_at(addr + later, 8)
        finally:
            _libc.munmap(addr, stack.size)
        devices.set_load_pages("snap", snap_dir, ranges)
        doc = json.loads(pack.read_text())
        assert [tuple(r) for r in doc["load"]] == expected
        assert "memory" not in doc  # the chunk order comes PACK_WINDOW after a restore
        assert not devices.wants_load_pages("snap")

        # A second restore of the running device after the host dropped its pages: the
        # acquire reads the load's pages back, exactly, and nothing else.
        drop_cached(path)
        assert not resident(path, stack.size) & set(touched)
        devices.last_warm = None
        assert devices.acquire("snap", stack.lowers, stack.size) == path
        try:
            wait_for(lambda: devices.last_warm is not None, "the warm-up")
            assert devices.last_warm is not None
            assert devices.last_warm["ranges"] == len(expected)
            assert devices.last_warm["bytes"] == sum(n for _, n in expected)
            assert resident(path, stack.size) == set(touched)
        finally:
            devices.release("snap")
    finally:
        devices.release("snap")
    assert devices.refcount("snap") == 0

    # A fresh device of the same snapshot (the pack read at open) warms them too.
    devices.last_warm = None
    path = devices.acquire("snap", stack.lowers, stack.size)
    try:
        assert not devices.wants_load_pages("snap")  # the pack has them
        wait_for(lambda: devices.last_warm is not None, "the warm-up of a fresh device")
        assert devices.last_warm is not None and devices.last_warm["ranges"] == len(expected)
        assert set(touched) <= resident(path, stack.size)
    finally:
        devices.release("snap")


def test_no_load_pages_kept_from_nothing_or_too_much(
        devices: SharedMemoryDevices, stack: Stack) -> None:
    snap_dir = stack.lowers[-1].parent
    devices.acquire("snap", stack.lowers, stack.size)
    try:
        for ranges in ([], [(0, memdev.LOAD_CAP + PAGE)]):
            assert devices.wants_load_pages("snap")
            devices.set_load_pages("snap", snap_dir, ranges)
            assert not (snap_dir / PACK_NAME).exists()
        assert devices.wants_load_pages("snap")  # still to record
    finally:
        devices.release("snap")
