"""Remote layers on the native core (docs/native.md, docs/remote-layers.md §2): plain layers
pushed to a real docker-registry on loopback, read lazily through a chunk cache. Present
chunks are served by the core without calling Python; misses go through the Python fetcher
and return the right bytes; the policy still sees native hits; evictions under native
readers never hand out a punched hole. The reference is `Image` over the same layers as
local files."""

from __future__ import annotations

import io
import random
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv.blockd.remote.store import RemoteConfig, RemoteStore
from agentenv.storage import blob as blobmod
from agentenv.storage import native
from agentenv.storage.blob import BlobLocation, RemoteLayerRef
from agentenv.storage.builder import LayerBuilder
from agentenv.storage.image import Image
from tests.blockd.nbdclient import NbdClient
from tests.blockd.test_native_serving import _served
from tests.template import helpers
from tests.template.conftest import Registry

if not native.available():  # the project's build compiles it (make venv): not built is a failure
    pytest.fail(f"native core not built: {native.unavailable_reason()}", pytrace=False)

KiB = 1024
MiB = 1 << 20
SIZE = 4 * MiB
CHUNK = 64 * KiB
REPO = "native-remote"


def _one_file_tar() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("etc/hostname")
        info.size = 7
        tar.addfile(info, io.BytesIO(b"native\n"))
    return out.getvalue()


@dataclass
class Layers:
    local: list[Path]  # the layer files (the reference reads these)
    refs: list[RemoteLayerRef]  # the same blobs in the registry


@pytest.fixture(scope="module")
def layers(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> Layers:
    """Two plain sealed layers with data and zeroed extents, the top one tar-wrapped (its
    stream starts 1536 bytes into the blob, so chunks and extents do not line up), pushed as
    blobs of one repository."""
    folder = tmp_path_factory.mktemp("layers")
    rng = random.Random(25)
    image = helpers.build_image([_one_file_tar()])
    local, refs = [], []
    for n in range(2):
        path = folder / f"layer{n}.lsmt"
        with LayerBuilder(path, SIZE, tar=n == 1) as builder:
            pos = rng.randrange(0, 4) * 4 * KiB
            while pos < SIZE - 128 * KiB:
                length = rng.choice([4, 12, 64, 100]) * KiB
                if n and rng.random() < 0.25:
                    builder.add_zero(pos, length)
                else:
                    builder.add(pos, rng.randbytes(length))
                pos += length + rng.randrange(0, 24) * 4 * KiB
        data = path.read_bytes()
        digest = helpers.digest_of(data)
        image.blobs[digest] = data
        local.append(path)
        refs.append(RemoteLayerRef(digest, len(data), [BlobLocation(registry.host, REPO)]))
    registry.push(REPO, "layers", image)
    return Layers(local, refs)


@pytest.fixture
def remote_store(tmp_path: Path) -> Iterator[RemoteStore]:
    store = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=256 * CHUNK, chunk_size=CHUNK,
                                     background_bw=0, timeout=10))
    blobmod.set_remote_opener(store.open_blob)
    try:
        yield store
    finally:
        blobmod.set_remote_opener(None)
        store.close()


def _descriptors(layers: Layers, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, ref in enumerate(layers.refs):
        path = folder / f"remote{n}" / "layer"
        path.parent.mkdir(exist_ok=True)
        RemoteLayerRef(ref.digest, ref.size, list(ref.sources)).save(path)
        paths.append(path)
    return paths


def _python_reads(image: native.NativeImage) -> int:
    return int(image.native_core.io_counts()[1])


def test_hits_are_served_without_python_and_misses_fetch(layers: Layers, remote_store: RemoteStore,
                                                         tmp_path: Path) -> None:
    ref = Image.create(layers.local, tmp_path / "ref", SIZE)
    nat = native.NativeImage.create(_descriptors(layers, tmp_path / "d"), tmp_path / "nat", SIZE)
    try:
        assert nat.native_core is not None  # blockd serves it on the native loop
        ref.write(100 * KiB, b"\x5a" * 8 * KiB)
        nat.write(100 * KiB, b"\x5a" * 8 * KiB)
        expect = ref.read(0, SIZE)
        # Cold: every chunk is a miss, fetched through Python, the bytes right.
        assert nat.read(0, SIZE) == expect
        cold = _python_reads(nat)
        assert cold > 0
        fetched = remote_store.snapshot_stats()["fetched_bytes"]["registry"]
        # Warm: no call into Python at all, the same bytes, nothing fetched.
        for offset, length in ((0, SIZE), (3 * KiB, 200 * KiB), (SIZE - 70 * KiB, 70 * KiB)):
            assert nat.read(offset, length) == expect[offset : offset + length]
        assert _python_reads(nat) == cold
        stats = remote_store.snapshot_stats()
        assert stats["fetched_bytes"]["registry"] == fetched
        assert stats["hits"] > 0  # the native hits are counted once folded
    finally:
        nat.close()
        ref.close()


def test_nbd_on_the_native_loop_misses_then_hits(layers: Layers, remote_store: RemoteStore,
                                                tmp_path: Path) -> None:
    """Over NBD on the native thread (and its read helpers for 1 MiB requests): cold reads
    fetch through Python and read right; warm reads never call Python."""
    short = Path(tempfile.mkdtemp(prefix="nr", dir="/tmp"))
    ref = Image.create(layers.local, tmp_path / "ref", SIZE)
    nat = native.NativeImage.create(_descriptors(layers, tmp_path / "d"), tmp_path / "nat", SIZE)
    try:
        expect = ref.read(0, SIZE)
        with _served(nat, str(short / "disk.sock")):
            client = NbdClient(str(short / "disk.sock"), "disk")
            try:
                for length in (MiB, 128 * KiB):
                    for offset in range(0, SIZE, length):
                        assert client.read(offset, length) == expect[offset : offset + length]
                    if length == MiB:
                        cold = _python_reads(nat)
                        assert cold > 0
                assert _python_reads(nat) == cold
                client.write(5000, b"\x11" * 3000)
                assert client.read(4096, 8192) == (
                    expect[4096:5000] + b"\x11" * 3000 + expect[8000 : 4096 + 8192])
            finally:
                client.close()
    finally:
        nat.close()
        ref.close()
        shutil.rmtree(short, ignore_errors=True)


def test_native_hits_count_for_the_eviction_policy(layers: Layers, tmp_path: Path) -> None:
    """Chunks re-read only by the core are promoted by 2Q like chunks re-read through Python:
    they survive a scan of another blob (more chunks than the cache of 16 holds)."""
    store = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=16 * CHUNK, chunk_size=CHUNK,
                                     background_bw=0, timeout=10))
    blobmod.set_remote_opener(store.open_blob)
    try:
        bottom = _descriptors(layers, tmp_path / "d")[:1]
        nat = native.NativeImage.create(bottom, None, SIZE)
        ref = Image.create(layers.local[:1], None, SIZE)
        try:
            hot = [(SIZE // 3, 8 * KiB), (SIZE // 2, 20 * KiB)]
            for offset, length in hot:
                assert nat.read(offset, length) == ref.read(offset, length)  # fetched
            before = _python_reads(nat)
            for _ in range(3):  # re-read by the core alone
                for offset, length in hot:
                    assert nat.read(offset, length) == ref.read(offset, length)
            assert _python_reads(nat) == before
            state = store.cache.find(layers.refs[0].digest.split(":")[1])
            assert state is not None
            held = [i for i, mark in enumerate(state.present) if mark]
            assert held
            other = store.open_blob(layers.refs[1])
            try:
                assert other.info.state.nchunks > 16
                for idx in range(other.info.state.nchunks):  # the scan
                    store.get_chunk(other.info, idx)
            finally:
                other.close()
            assert store.cache.stats.evictions > 0
            assert all(state.present[i] for i in held)
        finally:
            nat.close()
            ref.close()
    finally:
        blobmod.set_remote_opener(None)
        store.close()


def test_evictions_under_native_readers_never_give_wrong_bytes(layers: Layers,
                                                               tmp_path: Path) -> None:
    """Readers on several threads in a cache of 6 chunks: chunks are evicted (holes punched)
    while the core reads them; every read still equals the reference."""
    store = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=6 * CHUNK, chunk_size=CHUNK,
                                     background_bw=0, timeout=20))
    blobmod.set_remote_opener(store.open_blob)
    try:
        nat = native.NativeImage.create(_descriptors(layers, tmp_path / "d"), None, SIZE)
        ref = Image.create(layers.local, None, SIZE)
        expect = ref.read(0, SIZE)
        wrong: list[tuple[int, int]] = []
        failed: list[BaseException] = []

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(60):
                    offset = rng.randrange(0, SIZE - 4 * KiB) & ~511
                    length = min(rng.choice([4 * KiB, 60 * KiB, 130 * KiB]), SIZE - offset)
                    if nat.read(offset, length) != expect[offset : offset + length]:
                        wrong.append((offset, length))
            except BaseException as exc:  # reported below
                failed.append(exc)

        threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not failed and not wrong, (failed[:3], wrong[:5])
        assert store.cache.stats.evictions > 0
        nat.close()
        ref.close()
    finally:
        blobmod.set_remote_opener(None)
        store.close()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("read"), st.integers(0, SIZE - 1), st.integers(1, 300 * KiB),
                  st.just(0)),
        st.tuples(st.just("write"), st.integers(0, SIZE - 1), st.integers(1, 40 * KiB),
                  st.integers(0, 255)),
        st.tuples(st.just("zero"), st.integers(0, SIZE - 1), st.integers(1, 100 * KiB),
                  st.just(0)),
        st.tuples(st.just("seal"), st.just(0), st.just(0), st.just(0)),
    ),
    min_size=1, max_size=25,
)

_CACHE: dict[str, RemoteStore] = {}


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sequence=ops)
def test_native_remote_reads_match_the_reference(layers: Layers, tmp_path: Path,
                                                 sequence: list[tuple[str, int, int, int]]) -> None:
    """Random reads, writes, zeroings and seals on a stack of remote layers, native, against
    the reference on the same layers as files; a cache of 8 chunks, kept across examples, so
    reads meet present, missing and just-evicted chunks."""
    store = _CACHE.get("store")
    if store is None:
        store = _CACHE["store"] = RemoteStore(RemoteConfig(
            Path(tempfile.mkdtemp(prefix="nrcache")), capacity=8 * CHUNK, chunk_size=CHUNK,
            background_bw=0, timeout=10))
    root = Path(tempfile.mkdtemp(prefix="nrhyp"))
    blobmod.set_remote_opener(store.open_blob)
    try:
        ref = Image.create(layers.local, root / "ref", SIZE)
        nat = native.NativeImage.create(_descriptors(layers, root / "d"), root / "nat", SIZE)
        seals = 0
        for kind, offset, length, fill in sequence:
            length = min(length, SIZE - offset)
            if kind == "read":
                assert nat.read(offset, length) == ref.read(offset, length), (offset, length)
            elif kind == "write":
                for image in (ref, nat):
                    image.write(offset, bytes([fill]) * length)
            elif kind == "zero":
                for image in (ref, nat):
                    image.write_zeroes(offset, length)
            else:
                seals += 1
                ref.snapshot_and_restack(root / f"ref-{seals}.lsmt")
                nat.snapshot_and_restack(root / f"nat-{seals}.lsmt")
        assert nat.read(0, SIZE) == ref.read(0, SIZE)
        nat.close()
        ref.close()
    finally:
        blobmod.set_remote_opener(None)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def _close_cache() -> Iterator[None]:
    yield
    store = _CACHE.pop("store", None)
    if store is not None:
        store.close()
        shutil.rmtree(store.config.cache_dir, ignore_errors=True)


def test_a_converted_lz4_zfile_layer_hits_without_python(registry: Registry,
                                                         tmp_path: Path) -> None:
    """hello-world converted by containerd's overlaybd converter (an LZ4 ZFile with CRCs,
    tar-wrapped): its extents read natively, cold through the Python fetcher, warm without
    any call into Python; the bytes are the reference's over the whole blob as a file."""
    image = helpers.fixture_image("amd64-converted")
    registry.push("hello-world", "amd64-converted", image)
    digest = next(d for d in image.blobs if d.startswith("sha256:0222"))
    local = tmp_path / "hello.layer"
    local.write_bytes(image.blobs[digest])
    desc = tmp_path / "remote" / "layer"
    desc.parent.mkdir()
    RemoteLayerRef(digest, len(image.blobs[digest]),
                   [BlobLocation(registry.host, "hello-world")]).save(desc)
    store = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=64 * MiB, chunk_size=CHUNK,
                                     background_bw=0, timeout=10))
    blobmod.set_remote_opener(store.open_blob)
    try:
        with Image.create([local], None) as ref, native.NativeImage.create([desc], None) as nat:
            extents = [(start, min(length, 256 * KiB)) for start, length, data in ref.extents()
                       if data][:40]
            assert extents
            for offset, length in extents:
                assert nat.read(offset, length) == ref.read(offset, length)
            cold = _python_reads(nat)
            assert cold > 0
            for offset, length in extents:
                assert nat.read(offset, length) == ref.read(offset, length)
            assert _python_reads(nat) == cold
    finally:
        blobmod.set_remote_opener(None)
        store.close()


def test_a_miss_no_source_serves_is_eio_on_the_native_loop(layers: Layers, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The registry loses the blobs after the device opened: a cold read over NBD on the
    native thread gets EIO within the remote timeout (logged why), and the connection goes
    on serving."""
    short = Path(tempfile.mkdtemp(prefix="nr", dir="/tmp"))
    store = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=64 * CHUNK, chunk_size=CHUNK,
                                     background_bw=0, timeout=1))
    blobmod.set_remote_opener(store.open_blob)
    try:
        nat = native.NativeImage.create(_descriptors(layers, tmp_path / "d"), tmp_path / "nat",
                                        SIZE)
        for ref in layers.refs:  # the same BlobInfo the device reads through
            handle = store.open_blob(ref)
            handle.info.ref.sources[:] = [BlobLocation(ref.sources[0].registry, "gone")]
            handle.close()
        with _served(nat, str(short / "disk.sock")):
            client = NbdClient(str(short / "disk.sock"), "disk")
            try:
                error, _ = client.request(0, 0, 256 * KiB)  # CMD_READ
                assert error == 5
                client.write(0, b"\x42" * 4096)
                assert client.read(0, 4096) == b"\x42" * 4096
            finally:
                client.close()
        assert store.stats.eio >= 1
        assert any("the guest gets EIO" in r.getMessage() for r in caplog.records)
        nat.close()
    finally:
        blobmod.set_remote_opener(None)
        store.close()
        shutil.rmtree(short, ignore_errors=True)
