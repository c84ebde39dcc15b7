"""memfs's reads (blockd/memfs.py) on the native core: the libfuse read callback
(`_native.memfs_read`) against the reference `Image`, byte for byte, called directly and
through a real FUSE mount of the memfs process (native and Python reads)."""

from __future__ import annotations

import ctypes
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv.blockd import memfs
from agentenv.storage import native
from agentenv.storage.builder import LayerBuilder
from agentenv.storage.config import ImageConfig
from agentenv.storage.image import Image

if not native.available():  # the project's build compiles it: not built is a failure
    pytest.fail(f"native core not built: {native.unavailable_reason()}", pytrace=False)

from agentenv.storage import _native

MiB = 1 << 20
PAGE = 4096
SIZE = 5 * MiB + 64 * 1024  # a last chunk shorter than memfs.CHUNK

# libfuse 3's high-level read: (path, buf, size, offset, struct fuse_file_info *).
READ = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                        ctypes.c_int64, ctypes.c_void_p)


def memory_stack(folder: Path, seed: int) -> list[Path]:
    """Three layers shaped like pause captures (4 KiB pages in runs, zeroed runs hiding older
    data), the middle one a zstd ZFile."""
    rng = random.Random(seed)
    paths = []
    for n, compress in enumerate((None, "zstd", None)):
        path = folder / f"memory{n}.layer"
        with LayerBuilder(path, SIZE, compress=compress) as builder:  # type: ignore[arg-type]
            page = rng.randrange(0, 16)
            while (page + 64) * PAGE < SIZE:
                run = rng.randrange(1, 48) * PAGE
                if n and rng.random() < 0.25:
                    builder.add_zero(page * PAGE, run)
                else:
                    builder.add(page * PAGE, rng.randbytes(run))
                page += run // PAGE + rng.randrange(0, 40)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def stack() -> Iterator[list[Path]]:
    folder = Path(tempfile.mkdtemp(prefix="memfsnat"))
    try:
        yield memory_stack(folder, 7)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(stack: list[Path]) -> Iterator[bytes]:
    image = Image.create(stack, None, SIZE)
    try:
        yield image.read(0, SIZE)
    finally:
        image.close()


def _trace(path: Path) -> list[int]:
    raw = path.read_bytes()
    return [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(reads=st.lists(st.tuples(st.integers(0, SIZE + 2 * PAGE), st.integers(0, 1100 * 1024)),
                      min_size=1, max_size=40))
def test_native_read_callback_matches_the_reference(stack: list[Path], reference: bytes,
                                                    tmp_path: Path, reads: list[tuple[int, int]]) -> None:
    """Any offset and size (past the end too): the bytes Image.read gives, and each touched
    1 MiB chunk traced once, in first-touch order."""
    image = native.NativeImage.create(stack, None, SIZE)
    trace = tmp_path / f"{uuid.uuid4().hex}.trace"  # one per example
    fd = os.open(trace, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    read = READ(_native.memfs_read_address())
    _native.memfs_register("/k", image.reading_core, SIZE, fd)
    try:
        expected_chunks: list[int] = []
        for offset, size in reads:
            buf = ctypes.create_string_buffer(max(size, 1))
            got = read(b"/k", buf, size, offset, None)
            want = reference[offset:offset + size]
            assert got == len(want)
            assert buf.raw[:got] == want
            if want:
                for chunk in range(offset // memfs.CHUNK, (offset + len(want) - 1) // memfs.CHUNK + 1):
                    if chunk not in expected_chunks:
                        expected_chunks.append(chunk)
        assert read(b"/other", ctypes.create_string_buffer(PAGE), PAGE, 0, None) == -2  # ENOENT
    finally:
        served = _native.memfs_unregister("/k")
        os.close(fd)
        image.close()
    assert _native.memfs_unregister("/k") is None
    assert served is not None and served[2] == 0
    assert served[0] == sum(1 for offset, size in reads if size and offset < SIZE)
    assert _trace(trace) == expected_chunks


def test_register_refuses_bad_input(stack: list[Path]) -> None:
    image = native.NativeImage.create(stack, None, SIZE)
    try:
        with pytest.raises(ValueError, match="outside"):
            _native.memfs_register("/k", image.reading_core, SIZE + 1, -1)
        with pytest.raises(TypeError):
            _native.memfs_register("/k", object(), SIZE, -1)
        _native.memfs_register("/k", image.reading_core, SIZE, -1)
        with pytest.raises(ValueError, match="registered already"):
            _native.memfs_register("/k", image.reading_core, SIZE, -1)
    finally:
        _native.memfs_unregister("/k")
        image.close()


@pytest.mark.root
@pytest.mark.parametrize("switch", ["1", "0"])
def test_memfs_mount_serves_the_stack(stack: list[Path], reference: bytes, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    """The memfs process, native reads (1) and Python reads (0): cold sequential and random
    4 KiB reads and an mmap of the file give the reference bytes, the trace lists the touched
    chunks, and (native) the reads were served by the native callback."""
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.skip("no FUSE on this host")
    monkeypatch.setenv(native.ENV_SWITCH, switch)
    state = tmp_path / "state"
    state.mkdir()
    (state / "memdev").mkdir(mode=0o700)
    ImageConfig(state / "memdev" / f"k{memfs.MEMORY_SUFFIX}", stack).save()
    mount = memfs.ensure_running(state)
    try:
        path = mount / "k"
        assert path.stat().st_size == SIZE
        fd = os.open(path, os.O_RDONLY)
        try:
            pages = list(range(SIZE // PAGE))
            random.Random(3).shuffle(pages)
            for page in pages[: len(pages) // 2]:
                assert os.pread(fd, PAGE, page * PAGE) == reference[page * PAGE:(page + 1) * PAGE]
            got = bytearray()
            while len(got) < SIZE:
                got += os.pread(fd, 256 * 1024, len(got))
            assert bytes(got) == reference
        finally:
            os.close(fd)
        assert sorted(_trace(state / "memdev" / f"k{memfs.TRACE_SUFFIX}")) == list(
            range((SIZE + memfs.CHUNK - 1) // memfs.CHUNK))
        (state / "memdev" / f"k{memfs.MEMORY_SUFFIX}").unlink()  # released: memfs closes it
        log = state / "memfs.log"
        deadline = time.monotonic() + 60
        closed = None
        while time.monotonic() < deadline and switch == "1":
            closed = re.search(r"memory stack k closed: (\d+) native reads, (\d+) bytes, (\d+) errors",
                               log.read_text())
            if closed:
                break
            time.sleep(0.1)
        # mfusepy took MemoryFiles' old `lock` attribute (a threading.Lock) for the FUSE lock
        # operation, which libfuse calls at every close: an exception each time.
        assert "Uncaught exception" not in log.read_text(), log.read_text()[-2000:]
        if switch == "1":
            assert closed, log.read_text()[-2000:]
            reads, nbytes, errors = (int(x) for x in closed.groups())
            assert reads > 0 and nbytes >= SIZE // 2 and errors == 0
        else:
            assert "memfs reads in Python" in log.read_text()
    finally:
        memfs.stop(state)
