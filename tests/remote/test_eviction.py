"""The chunk cache's eviction policies in process (docs/remote-layers.md §2): the default 2Q
keeps a working set that is read again and again through a one-off scan larger than the
cache, where LRU loses it; both keep the capacity bound and count their evictions."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv.blockd.remote.cache import VERIFIED, BlobState, ChunkCache
from agentenv.blockd.remote.service import config_from_env

CHUNK = 4096
READS = 8  # small reads per chunk access, forward through the chunk (as a guest reads)
DATA = bytes(range(256)) * (CHUNK // 256)


class Reader:
    """Reads chunks the way the remote store does: a miss fetches and inserts the chunk."""

    def __init__(self, cache: ChunkCache) -> None:
        self.cache = cache
        self.buf = memoryview(bytearray(CHUNK // READS))
        self.fetched = 0
        self.peak_blocks = 0

    def access(self, state: BlobState, idx: int) -> bool:
        """One access: READS reads at increasing offsets; True when the first one hit."""
        cache = self.cache
        step = CHUNK // READS
        hit = cache.read(state, idx, 0, self.buf)
        if not hit:
            cache.insert(state, idx, DATA, VERIFIED)
            self.fetched += 1
            assert cache.size <= cache.capacity
            blocks = os.stat(cache.root / "blobs" / f"{state.hex}.data").st_blocks * 512
            self.peak_blocks = max(self.peak_blocks, blocks)
        for j in range(1, READS):
            assert cache.read(state, idx, j * step, self.buf)
            assert bytes(self.buf) == DATA[j * step : (j + 1) * step]
        return hit


def scan_through_hot_set(cache: ChunkCache, hot: int, scan: int, every: int) -> tuple[int, int]:
    """Read `hot` chunks of one blob three times, then stream `scan` chunks of another blob,
    reading the hot ones again after every `every` scan chunks and at the end. Returns (hot
    re-reads that missed, hot re-reads)."""
    reader = Reader(cache)
    work = cache.blob("a1" * 32, hot * CHUNK)
    image = cache.blob("b2" * 32, scan * CHUNK)
    for _ in range(3):
        for h in range(hot):
            reader.access(work, h)
    missed = rereads = 0
    for i in range(scan):
        reader.access(image, i)
        if (i + 1) % every == 0 or i == scan - 1:
            for h in range(hot):
                rereads += 1
                missed += not reader.access(work, h)
    # The invariants of every policy: never above capacity (the data file can hold one chunk
    # more while a victim's hole is punched), every chunk gone counted as an eviction, the
    # policy's bookkeeping matching the present maps.
    assert reader.peak_blocks <= cache.capacity + CHUNK
    present = sum(1 for s in (work, image) for m in s.present if m)
    assert present == work.count + image.count == len(cache._order)
    assert cache.stats.evictions == reader.fetched - present
    assert present * CHUNK == cache.size <= cache.capacity
    return missed, rereads


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(8, 48), hot_share=st.floats(0.05, 0.4), scan_factor=st.integers(2, 5),
       every_factor=st.floats(0.1, 3.0))
def test_2q_keeps_the_hot_set_through_a_scan(tmp_path_factory: pytest.TempPathFactory, cap: int,
                                             hot_share: float, scan_factor: int,
                                             every_factor: float) -> None:
    hot = max(1, int(cap * hot_share))
    cache = ChunkCache(tmp_path_factory.mktemp("c"), cap * CHUNK, chunk_size=CHUNK)
    try:
        assert cache.policy == "2q"  # the default
        missed, rereads = scan_through_hot_set(cache, hot, scan_factor * cap,
                                               max(1, int(cap * every_factor)))
        assert rereads and missed == 0, f"{missed} of {rereads} hot re-reads missed"
        assert cache.stats.evictions > 0
    finally:
        cache.close()


def test_lru_loses_the_hot_set_when_a_scan_outruns_the_cache(tmp_path: Path) -> None:
    """The same trace under LRU: the hot chunks are re-read after more than the cache's worth
    of scan chunks, so every re-read misses (what 2Q is for)."""
    cache = ChunkCache(tmp_path / "c", 32 * CHUNK, chunk_size=CHUNK, policy="lru")
    try:
        missed, rereads = scan_through_hot_set(cache, 4, 160, 40)
        assert missed == rereads > 0
    finally:
        cache.close()


def test_2q_fifo_hits_in_order_do_not_promote(tmp_path: Path) -> None:
    """A chunk read once, in many forward reads, stays in the FIFO and is evicted before a
    chunk whose bytes were read twice."""
    cache = ChunkCache(tmp_path / "c", 8 * CHUNK, chunk_size=CHUNK)
    try:
        reader = Reader(cache)
        state = cache.blob("c3" * 32, 64 * CHUNK)
        reader.access(state, 0)
        reader.access(state, 0)  # the same bytes again: promoted
        for i in range(1, 64):
            reader.access(state, i)  # a scan, each chunk read forward once
        assert state.present[0]
        assert not any(state.present[1:32])
    finally:
        cache.close()


def test_policy_choice_and_bad_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown chunk cache eviction policy 'mru'"):
        ChunkCache(tmp_path / "c", 8 * CHUNK, chunk_size=CHUNK, policy="mru")
    monkeypatch.setenv("AENV_CHUNK_CACHE_EVICTION", "lru")
    assert config_from_env(tmp_path).eviction == "lru"
    monkeypatch.setenv("AENV_CHUNK_CACHE_EVICTION", "arc")
    with pytest.raises(ValueError, match="AENV_CHUNK_CACHE_EVICTION: one of lru, 2q"):
        config_from_env(tmp_path)
    monkeypatch.delenv("AENV_CHUNK_CACHE_EVICTION")
    assert config_from_env(tmp_path).eviction == "2q"


def test_concurrent_inserts_wait_for_holes_being_punched(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicted chunks keep their blocks until their holes are punched; inserts of other
    threads meanwhile wait instead of writing past the capacity on disk. (Punching is made
    slow here, the one fault injected: on an idle disk the window is too short to hit.)"""
    from agentenv.blockd.remote import cache as cachemod

    real_punch = cachemod._punch

    def slow_punch(fd: int, offset: int, length: int) -> None:
        time.sleep(0.02)
        real_punch(fd, offset, length)

    monkeypatch.setattr(cachemod, "_punch", slow_punch)
    chunk = 64 * 1024
    cap = 40  # a batch of victims: from 95 % down to 85 %, 4 chunks
    cache = ChunkCache(tmp_path / "c", cap * chunk, chunk_size=chunk)
    state = cache.blob("d4" * 32, 160 * chunk)
    data = os.urandom(chunk)
    path = cache.root / "blobs" / f"{state.hex}.data"
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, os.stat(path).st_blocks * 512)

    def fill(first: int) -> None:
        for idx in range(first, 160, 4):
            cache.insert(state, idx, data, VERIFIED)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        workers = [threading.Thread(target=fill, args=(k,)) for k in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        stop.set()
        watcher.join()
        cache.close()
    assert cache.stats.evictions > 0
    assert peak <= (cap + 1) * chunk, f"the data file held {peak} bytes"
    assert sum(1 for m in state.present if m) * chunk == cache.size <= cap * chunk


def test_a_chunk_stored_again_before_its_hole_is_punched_keeps_its_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An insert's victims are unmarked under the lock and punched after it: a reader that
    misses the victim then (a native read whose generation moved) fetches it again at once.
    Its bytes must not be stored before the punch, or the punch leaves the chunk marked
    present as zeros (a guest's EIO: "ZFile block N CRC mismatch"). The interleaving is
    forced: the evicting insert is held inside its punch while the victim is stored again."""
    from agentenv.blockd.remote import cache as cachemod

    real_punch = cachemod._punch
    punching, release = threading.Event(), threading.Event()

    def held_punch(fd: int, offset: int, length: int) -> None:
        punching.set()
        assert release.wait(30)
        real_punch(fd, offset, length)

    chunk = 4096
    cache = ChunkCache(tmp_path / "c", 4 * chunk, chunk_size=chunk, policy="lru")
    state = cache.blob("e5" * 32, 8 * chunk)

    def data(i: int) -> bytes:
        return bytes([i + 1]) * chunk

    for i in range(3):
        cache.insert(state, i, data(i), VERIFIED)
    monkeypatch.setattr(cachemod, "_punch", held_punch)
    evicting = threading.Thread(target=cache.insert, args=(state, 3, data(3), VERIFIED))
    evicting.start()
    try:
        assert punching.wait(30)
        assert not state.present[0]  # chunk 0 is the victim, its hole not punched yet
        cache.insert(state, 0, data(0), VERIFIED)  # the reader's fetch of it, stored
    finally:
        release.set()
        evicting.join()
    buf = memoryview(bytearray(chunk))
    if cache.read(state, 0, 0, buf):
        assert bytes(buf) == data(0), "chunk 0 is marked present but holds other bytes"
    marks = os.pread(state.map_fd, 8, 0)
    assert list(marks) == [state.present[i] for i in range(8)], "the map file disagrees"
    assert sum(1 for m in state.present if m) * chunk == cache.size <= cache.capacity
    cache.close()


def test_inserts_deciding_together_stay_within_the_capacity(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each insert decides under the lock whether victims are needed; one deciding while
    others have decided but not written yet must count their chunks. Forced: three inserts
    all decide before any goes on (a barrier where they punch their victims)."""
    chunk = 4096
    cache = ChunkCache(tmp_path / "c", 8 * chunk, chunk_size=chunk)  # high 7.6 chunks
    state = cache.blob("f6" * 32, 16 * chunk)
    data = os.urandom(chunk)
    for i in range(6):
        cache.insert(state, i, data, VERIFIED)
    together = threading.Barrier(3, timeout=30)
    real_drop = cache._drop

    def drop_together(victims: list[tuple[BlobState, int, int]]) -> None:
        together.wait()
        real_drop(victims)

    monkeypatch.setattr(cache, "_drop", drop_together)
    inserts = [threading.Thread(target=cache.insert, args=(state, i, data, VERIFIED))
               for i in (6, 7, 8)]
    for t in inserts:
        t.start()
    for t in inserts:
        t.join()
    assert all(state.present[i] for i in (6, 7, 8))
    assert sum(1 for m in state.present if m) * chunk == cache.size <= cache.capacity
    blocks = os.stat(cache.root / "blobs" / f"{state.hex}.data").st_blocks * 512
    assert blocks <= cache.capacity, f"the data file holds {blocks} bytes"
    cache.close()


def test_concurrent_readers_of_a_tiny_cache_read_their_bytes(tmp_path: Path) -> None:
    """Readers that insert on a miss, over a working set larger than the cache: every hit
    reads the chunk's own bytes and the data file stays within the capacity. (Before the
    fixes the two tests above force, this found a zeroed chunk or an overfull file at once.)"""
    chunk = 4096
    cache = ChunkCache(tmp_path / "c", 8 * chunk, chunk_size=chunk)
    nchunks = 12
    state = cache.blob("a7" * 32, nchunks * chunk)
    data_file = cache.root / "blobs" / f"{state.hex}.data"
    wrong: list[str] = []

    def reader(seed: int) -> None:
        import random

        rnd = random.Random(seed)
        buf = memoryview(bytearray(chunk))
        for _ in range(3000):
            i = rnd.randrange(nchunks)
            if not cache.read(state, i, 0, buf):
                cache.insert(state, i, bytes([i + 1]) * chunk, VERIFIED)
            elif bytes(buf) != bytes([i + 1]) * chunk:
                wrong.append(f"chunk {i} read {bytes(buf[:1])!r}...")
            held = os.stat(data_file).st_blocks * 512
            if held > cache.capacity:
                wrong.append(f"the data file holds {held} bytes")

    readers = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert not wrong, wrong[:5]
    assert cache.stats.evictions > 0
    assert sum(1 for m in state.present if m) * chunk == cache.size <= cache.capacity
    cache.close()
