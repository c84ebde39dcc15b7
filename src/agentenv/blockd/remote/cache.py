"""The node-wide chunk cache: blob bytes on local disk, content-addressed by (blob digest,
chunk index), bounded in bytes (docs/remote-layers.md §2).

Layout under the cache root:

    blobs/<hex>.data   a sparse file as large as the blob; chunk i at i * chunk_size
    blobs/<hex>.map    one byte per chunk: 0 absent, 1 verified, 2 stored unverified (a blob
                       without per-chunk checksums, taken from its registry)
    blobs/<hex>.ok     the blob is complete and its sha256 matched its digest
    meta/<hex>.json    the blob's layout (wrappers, ZFile jump table position) and the small
                       metadata ranges read to open it (kept outside the byte budget)

The byte budget counts stored chunks. Inserting a chunk that would take the cache above the
high watermark first evicts chunks down to the low watermark (holes punched), so the cache
never holds more than its capacity. A chunk being read is pinned and never evicted under the
reader. Which chunks go is the eviction policy's choice: "lru" (least recently used) or "2q"
(scan resistant, below).

With the native core built, a blob's marks are a `ChunkMap` (storage/_native.cpp) the cores
read without the GIL: they serve present chunks from the data file themselves, never return
the bytes of a chunk evicted under them (a mark cleared bumps the chunk's generation, which a
native reader checks after its pread), and report their hits, which are folded into the
policy before it picks victims (`_fold_native_hits`). Python readers pin as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.storage.native import chunk_map

log = logging.getLogger("agentenv.blockd.remote")

ABSENT, VERIFIED, UNVERIFIED = 0, 1, 2
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _punch(fd: int, offset: int, length: int) -> None:
    """Give the chunk's blocks back to the file system (the file keeps its size)."""
    import ctypes

    rc = _libc().fallocate(ctypes.c_int(fd),
                           ctypes.c_int(_FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE),
                           ctypes.c_long(offset), ctypes.c_long(length))
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS):
            # The budget counts the chunk as gone; the file system keeps its blocks.
            log.warning("cannot punch holes in the chunk cache", extra={"error": os.strerror(err)})
            return
        raise OSError(err, f"punching a hole in the chunk cache: {os.strerror(err)}")


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return _LIBC


Key = tuple[str, int]  # (blob hex, chunk index)
POLICIES = ("lru", "2q")


class LruPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, int] = OrderedDict()

    def add(self, key: Key, n: int) -> None:
        self._order[key] = n

    def hit(self, key: Key, offset: int, end: int) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> int | None:
        return self._order.pop(key, None)

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def evict(self, amount: int, pinned: dict[Key, int]) -> list[tuple[Key, int]]:
        """Take chunks out, least recently used first, until `amount` bytes are freed or
        only pinned ones are left."""
        out: list[tuple[Key, int]] = []
        freed = 0
        for key in list(self._order):
            if freed >= amount:
                break
            if key in pinned:
                continue
            n = self._order.pop(key)
            out.append((key, n))
            freed += n
        return out


class TwoQPolicy:
    """2Q (Johnson & Shasha, VLDB 1994), scan resistant. A new chunk enters a FIFO (`new`, a
    quarter of the capacity); chunks read again go to `main`, an LRU; eviction takes from the
    FIFO while it is above its share. So a one-off scan (an image read once, a background
    completion) cycles through the FIFO and never evicts the chunks read again and again.

    What counts as read again: a guest reads a fetched chunk in many small reads in a row, at
    increasing offsets (NBD requests, ZFile 4 KiB blocks), which says nothing about reuse. A
    hit in the FIFO promotes the chunk when it reads bytes of the chunk already read since it
    was fetched (below the furthest offset read so far), and a chunk evicted from the FIFO
    leaves its key in a ghost list: fetched again while its key is there, it goes straight to
    `main`. The ghost list holds keys only and spans twice the capacity in chunks, so a
    working set re-read after a scan twice the cache's size still counts as re-read."""

    def __init__(self, capacity: int, chunk_size: int) -> None:
        self.new_bytes_max = capacity // 4
        self.ghost_max = max(16, 2 * capacity // chunk_size)
        self._frontier: dict[Key, int] = {}  # FIFO chunks: the furthest byte read from each
        self._new: OrderedDict[Key, int] = OrderedDict()
        self._new_bytes = 0
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()

    def add(self, key: Key, n: int) -> None:
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = n
        else:
            self._new[key] = n
            self._new_bytes += n

    def hit(self, key: Key, offset: int, end: int) -> None:
        if key in self._main:
            self._main.move_to_end(key)
            return
        if key not in self._new:
            return
        frontier = self._frontier.get(key, 0)
        if offset < frontier:
            del self._frontier[key]
            n = self._new.pop(key)
            self._new_bytes -= n
            self._main[key] = n
        else:
            self._frontier[key] = end

    def remove(self, key: Key) -> int | None:
        n = self._new.pop(key, None)
        if n is not None:
            self._new_bytes -= n
            self._frontier.pop(key, None)
            return n
        return self._main.pop(key, None)

    def __contains__(self, key: Key) -> bool:
        return key in self._new or key in self._main

    def __len__(self) -> int:
        return len(self._new) + len(self._main)

    def evict(self, amount: int, pinned: dict[Key, int]) -> list[tuple[Key, int]]:
        """From the FIFO while it is above its share (or `main` has nothing to give), else
        from `main`'s least recently used end; pinned chunks are skipped."""
        out: list[tuple[Key, int]] = []
        freed = 0
        new_keys, main_keys = iter(list(self._new)), iter(list(self._main))
        new_done = main_done = False
        while freed < amount and not (new_done and main_done):
            from_new = not new_done and (self._new_bytes > self.new_bytes_max or main_done)
            source = new_keys if from_new else main_keys
            key = next((k for k in source if k not in pinned), None)
            if key is None:
                if from_new:
                    new_done = True
                else:
                    main_done = True
                continue
            if from_new:
                n = self._new.pop(key)
                self._new_bytes -= n
                self._frontier.pop(key, None)
                self._ghost[key] = None
                if len(self._ghost) > self.ghost_max:
                    self._ghost.popitem(last=False)
            else:
                n = self._main.pop(key)
            out.append((key, n))
            freed += n
        return out


def make_policy(name: str, capacity: int, chunk_size: int) -> LruPolicy | TwoQPolicy:
    if name == "lru":
        return LruPolicy()
    if name == "2q":
        return TwoQPolicy(capacity, chunk_size)
    raise ValueError(f"unknown chunk cache eviction policy {name!r} (one of {', '.join(POLICIES)})")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    inserted_bytes: int = 0
    digest_failures: int = 0


@dataclass
class BlobState:
    """One blob's files and which chunks are present."""

    hex: str
    size: int
    chunk_size: int
    fd: int
    map_fd: int
    present: Any  # per chunk ABSENT, VERIFIED or UNVERIFIED: a ChunkMap, else a bytearray
    complete: bool = False
    verifying: bool = False
    count: int = 0  # chunks present
    users: int = 0  # devices reading the blob now
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def nchunks(self) -> int:
        return (self.size + self.chunk_size - 1) // self.chunk_size

    def chunk_len(self, idx: int) -> int:
        return min(self.chunk_size, self.size - idx * self.chunk_size)


class ChunkCache:
    def __init__(self, root: Path, capacity: int, *, chunk_size: int = 1 << 20,
                 high: float = 0.95, low: float = 0.85, policy: str = "2q") -> None:
        if chunk_size < 4096 or chunk_size & (chunk_size - 1):
            raise ValueError(f"chunk size {chunk_size} must be a power of two of at least 4096")
        if capacity < 4 * chunk_size:
            raise ValueError(f"cache capacity {capacity} must hold at least 4 chunks of "
                             f"{chunk_size} bytes")
        if not 0 < low < high <= 1:
            raise ValueError(f"watermarks must satisfy 0 < low ({low}) < high ({high}) <= 1")
        self.root = Path(root)
        self.capacity = capacity
        self.chunk_size = chunk_size
        self.high_bytes = int(capacity * high)
        self.low_bytes = int(capacity * low)
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._blobs: dict[str, BlobState] = {}
        self.policy = policy
        self._order = make_policy(policy, capacity, chunk_size)
        self._pins: dict[tuple[str, int], int] = {}
        # Chunks unmarked whose holes are not punched yet: not stored again until they are
        # (a punch after the new bytes' write would leave the chunk marked present as zeros).
        self._punching: set[Key] = set()
        self._size = 0  # bytes on disk: chunks present, being written, or evicted but not yet punched
        self._freeing = 0  # of which evicted, their holes not punched yet
        self._punched = threading.Condition(self._lock)
        self.on_complete: Callable[[BlobState], None] | None = None
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        (self.root / "meta").mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.root / "cache.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise OSError(errno.EBUSY, f"another process uses the chunk cache {self.root}") from None
        self._load()

    # -- state ---------------------------------------------------------------------------

    def _load(self) -> None:
        """Reopen what a previous run left: every blob with its present map (in map order:
        the eviction order of the previous run is not kept)."""
        for data in sorted((self.root / "blobs").glob("*.data")):
            hex_ = data.stem
            try:
                size = os.stat(data).st_size
                state = self._open_state(hex_, size)
            except OSError as exc:
                log.warning("chunk cache entry unreadable, dropped", extra={"blob": hex_, "error": str(exc)})
                self._remove_files(hex_)
                continue
            for idx, mark in enumerate(state.present):
                if mark:
                    n = state.chunk_len(idx)
                    self._order.add((hex_, idx), n)
                    self._size += n
                    state.count += 1
        if self._size > self.high_bytes:
            with self._lock:
                victims = self._pick_victims(0)
            self._drop(victims)

    def _open_state(self, hex_: str, size: int) -> BlobState:
        base = self.root / "blobs" / hex_
        fd = os.open(f"{base}.data", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        n = (size + self.chunk_size - 1) // self.chunk_size
        map_fd = os.open(f"{base}.map", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        raw = os.pread(map_fd, n, 0)
        present = chunk_map(raw + bytes(n - len(raw)))
        if len(raw) != n:
            os.ftruncate(map_fd, n)
        state = BlobState(hex_, size, self.chunk_size, fd, map_fd, present)
        state.complete = os.path.exists(f"{base}.ok")
        self._blobs[hex_] = state
        return state

    def _remove_files(self, hex_: str) -> None:
        for suffix in (".data", ".map", ".ok"):
            with contextlib.suppress(FileNotFoundError):
                (self.root / "blobs" / f"{hex_}{suffix}").unlink()

    def blob(self, hex_: str, size: int) -> BlobState:
        with self._lock:
            state = self._blobs.get(hex_)
            if state is not None:
                if state.size != size:
                    raise OSError(errno.EINVAL, f"blob {hex_} is {state.size} bytes in the cache, "
                                                f"{size} in its descriptor")
                return state
            return self._open_state(hex_, size)

    def find(self, hex_: str) -> BlobState | None:
        return self._blobs.get(hex_)

    @property
    def size(self) -> int:
        return self._size

    def blobs(self) -> list[BlobState]:
        return list(self._blobs.values())

    def meta_path(self, hex_: str) -> Path:
        return self.root / "meta" / f"{hex_}.json"

    # -- reads ---------------------------------------------------------------------------

    def read(self, state: BlobState, idx: int, offset: int, buf: memoryview) -> bool:
        """Fill `buf` from chunk `idx` at `offset` inside it; False when it is absent."""
        key = (state.hex, idx)
        with self._lock:
            if not state.present[idx]:
                self.stats.misses += 1
                return False
            self.stats.hits += 1
            self._order.hit(key, offset, offset + len(buf))
            self._pins[key] = self._pins.get(key, 0) + 1
        try:
            got = os.preadv(state.fd, [buf], idx * self.chunk_size + offset)
        finally:
            with self._lock:
                left = self._pins[key] - 1
                if left:
                    self._pins[key] = left
                else:
                    del self._pins[key]
        if got != len(buf):
            raise OSError(errno.EIO, f"chunk cache file of {state.hex} is short at chunk {idx}")
        return True

    def pread(self, state: BlobState, idx: int, offset: int, length: int) -> bytes | None:
        """`length` bytes at `offset` inside chunk `idx` as bytes (one pread, no extra copy);
        None when the chunk is absent (not counted: the caller's fallback read counts it)."""
        key = (state.hex, idx)
        pins = self._pins
        with self._lock:
            if not state.present[idx]:
                return None
            self.stats.hits += 1
            self._order.hit(key, offset, offset + length)
            pins[key] = pins.get(key, 0) + 1
        try:
            data = os.pread(state.fd, length, idx * self.chunk_size + offset)
        finally:
            with self._lock:
                left = pins[key] - 1
                if left:
                    pins[key] = left
                else:
                    del pins[key]
        if len(data) != length:
            raise OSError(errno.EIO, f"chunk cache file of {state.hex} is short at chunk {idx}")
        return data

    def pin_servable(self, state: BlobState, start: int, end: int) -> list[tuple[str, int]] | None:
        """Pin the chunks of [start, end) if all are servable (checked and pinned under one
        lock, so none is evicted or being written meanwhile); None otherwise."""
        if start < 0 or end > state.size or start >= end:
            return None
        cs = self.chunk_size
        keys = [(state.hex, i) for i in range(start // cs, (end - 1) // cs + 1)]
        with self._lock:
            for _, idx in keys:
                mark = state.present[idx]
                if mark == ABSENT or (mark == UNVERIFIED and not state.complete):
                    return None
            for key in keys:
                self._pins[key] = self._pins.get(key, 0) + 1
        return keys

    def unpin(self, keys: list[tuple[str, int]]) -> None:
        with self._lock:
            for key in keys:
                left = self._pins[key] - 1
                if left:
                    self._pins[key] = left
                else:
                    del self._pins[key]

    # -- inserts and eviction ------------------------------------------------------------

    def insert(self, state: BlobState, idx: int, data: bytes | memoryview, mark: int) -> None:
        """Store chunk `idx` (its full length). Space is reserved before the write, so the
        stored bytes never pass the capacity."""
        n = state.chunk_len(idx)
        if len(data) != n:
            raise ValueError(f"chunk {idx} of {state.hex} is {n} bytes, got {len(data)}")
        key = (state.hex, idx)
        with self._lock:
            if (state.present[idx] or (key in self._pins and self._pins[key] < 0)
                    or key in self._punching):
                # Present, being written, or its hole still to be punched (the caller has
                # the bytes; a later read fetches the chunk again).
                return
            victims = (self._pick_victims(n) if self._size - self._freeing + n > self.high_bytes
                       else [])
            self._pins[key] = -1  # being written: nobody evicts or writes it meanwhile
            # Reserved in the same step as the choice, so that inserts deciding meanwhile
            # count this chunk (reserved later, each saw room for itself alone).
            self._size += n
        try:
            self._drop(victims)
            with self._lock:
                # Other inserts' victims keep their blocks until punched: wait for those
                # rather than pass the capacity on disk.
                while self._size > self.capacity and self._freeing:
                    self._punched.wait(1.0)
            os.pwrite(state.fd, data, idx * self.chunk_size)
            os.pwrite(state.map_fd, bytes([mark]), idx)
        except BaseException:
            with self._lock:
                self._size -= n
                del self._pins[key]
            raise
        with self._lock:
            del self._pins[key]
            state.present[idx] = mark
            state.count += 1
            self._order.add(key, n)
            self.stats.inserted_bytes += n
            done = state.count == state.nchunks and not state.complete and not state.verifying
            if done:
                state.verifying = True
        if done and self.on_complete is not None:
            self.on_complete(state)

    def _fold_native_hits(self) -> None:
        """Under the lock: count the chunks the native cores read, and tell the policy, as
        one read of the range they spanned, and a second when they read some bytes again."""
        for state in self._blobs.values():
            take = getattr(state.present, "take_hits", None)
            if take is None:
                continue
            hits, touched = take()
            self.stats.hits += hits
            for idx, lo, hi, reread in touched:
                key = (state.hex, idx)
                self._order.hit(key, lo, hi)
                if reread:
                    self._order.hit(key, lo, hi)

    def fold_native_hits(self) -> None:
        with self._lock:
            self._fold_native_hits()

    def _pick_victims(self, incoming: int) -> list[tuple[BlobState, int, int]]:
        """Under the lock: unmark the policy's chunks until the cache plus `incoming` is at
        the low watermark. Pinned chunks are skipped. Their bytes count until `_drop` has
        punched them."""
        victims: list[tuple[BlobState, int, int]] = []
        self._fold_native_hits()
        target = self.low_bytes - incoming
        for key, n in self._order.evict(self._size - self._freeing - target, self._pins):
            state = self._blobs[key[0]]
            state.present[key[1]] = ABSENT
            state.count -= 1
            if state.complete:
                state.complete = False
                with contextlib.suppress(FileNotFoundError):
                    (self.root / "blobs" / f"{state.hex}.ok").unlink()
            self._freeing += n
            self._punching.add(key)
            self.stats.evictions += 1
            self.stats.evicted_bytes += n
            victims.append((state, key[1], n))
        return victims

    def _drop(self, victims: list[tuple[BlobState, int, int]]) -> None:
        """Punch the holes of unmarked chunks, then take them out of the byte count."""
        if not victims:
            return
        try:
            for state, idx, n in victims:
                os.pwrite(state.map_fd, b"\0", idx)
                _punch(state.fd, idx * self.chunk_size, n)
        finally:
            total = sum(n for _, _, n in victims)
            with self._lock:
                self._size -= total
                self._freeing -= total
                self._punching.difference_update((state.hex, idx) for state, idx, _ in victims)
                self._punched.notify_all()

    # -- whole blobs ---------------------------------------------------------------------

    def verify_digest(self, state: BlobState) -> bool:
        """sha256 of the complete blob against its name; a mismatch drops every chunk."""
        hasher = hashlib.sha256()
        pos = 0
        keys = [(state.hex, i) for i in range(state.nchunks)]
        with self._lock:
            # Pinned only when every chunk is present (none is being written then).
            whole = state.count == state.nchunks
            if whole:
                for key in keys:
                    self._pins[key] = self._pins.get(key, 0) + 1
            else:
                keys = []
        try:
            if whole:
                while pos < state.size:
                    block = os.pread(state.fd, min(8 << 20, state.size - pos), pos)
                    if not block:
                        break
                    hasher.update(block)
                    pos += len(block)
        finally:
            self.unpin(keys)
        with self._lock:
            state.verifying = False
            if not whole or state.count != state.nchunks:
                return False  # something was evicted meanwhile: not complete after all
        ok = pos == state.size and hasher.hexdigest() == state.hex
        if ok:
            (self.root / "blobs" / f"{state.hex}.ok").touch()
            with self._lock:
                state.complete = True
            return True
        self.stats.digest_failures += 1
        log.error("remote blob failed its digest check: all its chunks dropped",
                  extra={"blob": "sha256:" + state.hex})
        self.drop_blob(state)
        return False

    def drop_blob(self, state: BlobState) -> None:
        with self._lock:
            victims = []
            for idx, mark in enumerate(state.present):
                key = (state.hex, idx)
                if mark and key not in self._pins:
                    n = self._order.remove(key) or state.chunk_len(idx)
                    state.present[idx] = ABSENT
                    state.count -= 1
                    self._freeing += n
                    self._punching.add(key)
                    victims.append((state, idx, n))
            state.complete = False
        with contextlib.suppress(FileNotFoundError):
            (self.root / "blobs" / f"{state.hex}.ok").unlink()
        self._drop(victims)

    def close(self) -> None:
        with self._lock:
            for state in self._blobs.values():
                for fd in (state.fd, state.map_fd):
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._blobs.clear()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
