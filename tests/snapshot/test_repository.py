"""Snapshot repositories (snapshot/repository.py) in-process: a snapshot whose files live in
several directories, pushed to a real registry (Debian's docker-registry on loopback) and to
a shared directory, fetched into another node's snapshot root byte for byte."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.blockd.remote.chunkdigests import ChunkDigests
from agentenv.registry.errors import RegistryError
from agentenv.snapshot import repository
from agentenv.snapshot.record import (
    DiskConfig,
    DiskSnapshot,
    LayerRef,
    MachineConfig,
    SnapshotRecord,
)
from agentenv.snapshot.repository import (
    ARTIFACT_TYPE,
    CHUNK_SHA256,
    PACK_NAME,
    PART_TYPES,
    RepositoryError,
    fetch,
    parse_ref,
    push,
)
from tests.template.registry_server import Registry, running_registry


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


def _file(path: Path, size: int) -> LayerRef:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return LayerRef(path=str(path), size=size)


def _snapshot(root: Path, name: str, base: list[LayerRef] | None = None) -> Path:
    """A record naming files in its own directory, a parent's and an image layer cache."""
    own = root / "snapshots" / name
    base = base or [_file(root / "snapshots" / "parent" / "memory.layer", 300_000)]
    image = root / "layer-cache" / "rootfs.layer"
    rootfs = LayerRef(path=str(image), size=image.stat().st_size) if image.exists() \
        else _file(image, 200_000)
    tools_path = root / "assets" / "tools.img"
    tools = (LayerRef(path=str(tools_path), size=50_000) if tools_path.exists()
             else _file(tools_path, 50_000))
    record = SnapshotRecord(
        id=f"snap-{name}", mode="tcg",
        machine=MachineConfig(accel="tcg", kernel="/k", cmdline="c",
                              disks=[DiskConfig(name="tools", read_only=True, size=50_000),
                                     DiskConfig(name="rootfs", size=1 << 30)]),
        memory_layers=[*base, _file(own / "memory.layer", 100_000)],
        device_state=str(_file(own / "devstate.bin", 80_000).path),
        device_state_ram_block="ram0",
        disks=[DiskSnapshot(name="tools", layers=[], read_only=True, file=tools.path),
               DiskSnapshot(name="rootfs", layers=[rootfs, _file(own / "disk-rootfs.layer", 70_000)])])
    record.save(own)
    (own / PACK_NAME).write_text(json.dumps({"version": 1, "chunk_size": 1 << 20, "memory": [3, 0]}))
    return own


def _same_files(a: SnapshotRecord, b: SnapshotRecord) -> None:
    pairs = [(x.path, y.path) for x, y in zip(a.memory_layers, b.memory_layers, strict=True)]
    pairs.append((a.device_state, b.device_state))
    for da, db in zip(a.disks, b.disks, strict=True):
        pairs += [(x.path, y.path) for x, y in zip(da.layers, db.layers, strict=True)]
        if da.file:
            pairs.append((da.file, db.file))
    for x, y in pairs:
        assert Path(x).read_bytes() == Path(y).read_bytes(), (x, y)
        assert x != y


@pytest.mark.parametrize("kind", ["oci", "dir"])
def test_push_fetch_round_trip(kind: str, registry: Registry, tmp_path: Path) -> None:
    source = _snapshot(tmp_path / "a", "one")
    ref = (f"{registry.host}/aenv-snapshots/x:one" if kind == "oci"
           else f"dir://{tmp_path / 'shared' / 'one'}")
    meta = {"names": ["tpl"], "cpu_count": 1, "guest_token": "tok"}
    sent = push(source, ref, meta)
    assert sent["parts"] == 7 and sent["bytes_sent"] > sent["bytes"]  # + the config blob
    # A second snapshot sharing the parent's memory and the image layer: those are not sent again.
    parent = SnapshotRecord.load(source).memory_layers[:1]
    second = _snapshot(tmp_path / "a", "two", base=parent)
    ref2 = ref.replace("one", "two")
    again = push(second, ref2, meta)
    # Shared: the parent's memory layer, the image layer, the tools disk.
    assert again["bytes_sent"] < again["bytes"] - 300_000 - 200_000 - 50_000 + 1000

    node_b = tmp_path / "b" / "snapshots"
    got = fetch(ref, node_b, lazy=False)  # the parts are random bytes, not layers
    assert got.meta == meta and got.directory == node_b / "snap-one"
    original = SnapshotRecord.load(source)
    assert got.record.id == original.id and got.record.machine == original.machine
    got.record.check_files()
    assert all(Path(x.path).parent == got.directory for x in got.record.memory_layers)
    _same_files(original, got.record)
    assert json.loads((got.directory / PACK_NAME).read_text())["memory"] == [3, 0]
    assert got.bytes_fetched == sent["bytes"]
    # Fetching what the node holds already downloads nothing.
    assert fetch(ref, node_b).existed


def test_damaged_and_foreign_artifacts_are_refused(registry: Registry, tmp_path: Path) -> None:
    source = _snapshot(tmp_path / "a", "one")
    shared = tmp_path / "shared"
    push(source, f"dir://{shared / 'one'}", {})
    blob = max((shared / "blobs" / "sha256").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(RepositoryError, match="damaged"):
        fetch(str(shared / "one"), tmp_path / "b")
    assert not (tmp_path / "b").exists() or not list((tmp_path / "b").iterdir())
    assert not list((tmp_path / ".incoming-snapshots").iterdir()), "nothing of a failed fetch stays"
    # An ordinary image is not a snapshot.
    from tests.template import helpers

    registry.push("plain/image", "v1", helpers.fixture_image("amd64"))
    with pytest.raises(RepositoryError, match="not an agentenv snapshot"):
        fetch(f"{registry.host}/plain/image:v1", tmp_path / "c")
    with pytest.raises(RepositoryError, match="dir:///"):
        parse_ref("dir://relative/x")
    with pytest.raises(RepositoryError, match="neither"):
        parse_ref("UPPER:case")
    assert parse_ref(f"oci://{registry.host}/a/b:c").kind == "oci"
    assert ARTIFACT_TYPE.startswith("application/vnd.aenv")


def _lsmt_snapshot(root: Path) -> tuple[Path, dict[str, bytes]]:
    """A snapshot whose memory and disk layers are real sealed overlaybd layers (readable
    through the chunk cache), and the bytes each stack must read as."""
    from tests.blockd.conftest import build_stack

    memory = build_stack(root / "memory", 2, 8 << 20, seed=3)
    rootfs = build_stack(root / "rootfs", 1, 4 << 20, seed=4)
    own = root / "snapshots" / "lazy"

    def ref(path: Path) -> LayerRef:
        return LayerRef(path=str(path), size=path.stat().st_size)

    tools = _file(root / "assets" / "tools.img", 50_000)
    record = SnapshotRecord(
        id="snap-lazy", mode="tcg",
        machine=MachineConfig(accel="tcg", kernel="/k", cmdline="c",
                              disks=[DiskConfig(name="tools", read_only=True, size=50_000),
                                     DiskConfig(name="rootfs", size=rootfs.size)]),
        memory_layers=[ref(p) for p in memory.lowers],
        device_state=str(_file(own / "devstate.bin", 80_000).path),
        device_state_ram_block="ram0",
        disks=[DiskSnapshot(name="tools", layers=[], read_only=True, file=tools.path),
               DiskSnapshot(name="rootfs", layers=[ref(p) for p in rootfs.lowers])])
    record.save(own)
    (own / PACK_NAME).write_text(json.dumps({"version": 1, "chunk_size": 1 << 20, "memory": [1]}))
    return own, {"memory": memory.expected, "rootfs": rootfs.expected}


def _read_stack(layers: list[str], work: Path, offset: int, length: int) -> bytes:
    from agentenv.blockd.images import open_image
    from agentenv.storage.config import ImageConfig

    config = ImageConfig(work / f"{len(list(work.glob('*.json')))}.json", [Path(p) for p in layers])
    config.save()
    image = open_image(config.path, writable=False)
    try:
        return bytes(image.read(offset, length))
    finally:
        image.close()


def test_lazy_fetch_reads_layers_through_the_chunk_cache(registry: Registry, tmp_path: Path) -> None:
    from agentenv.blockd.remote.store import RemoteConfig, RemoteStore
    from agentenv.storage import blob
    from agentenv.storage.layer import is_remote

    source, expected = _lsmt_snapshot(tmp_path / "a")
    ref = f"{registry.host}/aenv-snapshots/lazy:one"
    sent = push(source, ref, {"guest_token": "tok"})
    got = fetch(ref, tmp_path / "b" / "snapshots")
    record = got.record
    # Memory and disk layers stay in the registry; device state, pack and raw file come whole.
    layer_paths = [x.path for x in record.memory_layers] + [x.path for x in record.disks[1].layers]
    assert got.lazy_parts == len(layer_paths) == 3 and all(is_remote(Path(p)) for p in layer_paths)
    assert not is_remote(Path(record.device_state)) and not is_remote(Path(record.disks[0].file or ""))
    assert got.bytes_total == sent["bytes"]
    assert got.bytes_fetched == 80_000 + 50_000 + (got.directory / PACK_NAME).stat().st_size
    assert Path(record.device_state).read_bytes() == Path(
        SnapshotRecord.load(source).device_state).read_bytes()
    # Each layer's chunk table was published with it and travels in its descriptor: the
    # table blockd checks peers' chunks against (blockd/remote/chunkdigests.py).
    source_layers = [x.path for x in SnapshotRecord.load(source).memory_layers] + \
        [x.path for x in SnapshotRecord.load(source).disks[1].layers]
    for remote_path, local_path in zip(layer_paths, source_layers, strict=True):
        desc = blob.load_descriptor(Path(remote_path))
        with open(local_path, "rb") as f:
            want, _ = ChunkDigests.compute(f.read, desc.size)
        assert desc.chunk_sha256 == want.encode()

    store = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=64 << 20, chunk_size=1 << 20,
                                     background_bw=0))
    blob.set_remote_opener(store.open_blob)
    try:
        work = tmp_path / "configs"
        work.mkdir()
        for offset in (0, 3 << 20, (8 << 20) - 65536):
            assert _read_stack([x.path for x in record.memory_layers], work, offset, 65536) == \
                expected["memory"][offset : offset + 65536]
        assert _read_stack(layer_paths[2:], work, 1 << 20, 8192) == \
            expected["rootfs"][(1 << 20) : (1 << 20) + 8192]
        fetched = store.snapshot_stats()["fetched_bytes"].get("registry", 0)
        layer_bytes = sum(x.size for x in record.memory_layers) + record.disks[1].layers[0].size
        assert 0 < fetched < layer_bytes, (fetched, layer_bytes)

        # A lazily pulled snapshot publishes again: its remote parts read back and verified.
        again = push(got.directory, f"dir://{tmp_path / 'shared' / 'lazy'}", {})
        assert again["bytes"] == sent["bytes"]
        whole = fetch(f"dir://{tmp_path / 'shared' / 'lazy'}", tmp_path / "c" / "snapshots")
        republished = json.loads((tmp_path / "shared" / "lazy" / "manifest.json").read_text())
        tables = [d["annotations"].get(CHUNK_SHA256) for d in republished["layers"]
                  if d["mediaType"] in (PART_TYPES["memory"], PART_TYPES["disk"])]
        assert len(tables) == 3 and all(tables)  # carried over from the first push
        _same_files(SnapshotRecord.load(source), whole.record)
    finally:
        blob.set_remote_opener(None)
        store.close()
    # --download: every part whole.
    downloaded = fetch(ref, tmp_path / "d" / "snapshots", lazy=False)
    assert downloaded.lazy_parts == 0 and downloaded.bytes_fetched == sent["bytes"]
    _same_files(SnapshotRecord.load(source), downloaded.record)
    # A node holding the raw disk file (its tools disk) names its own copy and fetches none.
    tools = Path(SnapshotRecord.load(source).disks[0].file or "")
    other = tmp_path / "e-tools.img"
    other.write_bytes(os.urandom(50_000))  # same size, other content: not taken
    mine = fetch(ref, tmp_path / "e" / "snapshots", local_files=[other, tools])
    assert mine.record.disks[0].file == str(tools)
    assert mine.bytes_fetched == got.bytes_fetched - 50_000
    mine.record.check_files()


def _manifest_status(registry: Registry, name: str, tag: str) -> int:
    return httpx.get(f"http://{registry.host}/v2/{name}/manifests/{tag}", timeout=10,
                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}
                     ).status_code


def test_delete_removes_the_tag_and_a_second_delete_finds_it_gone(
        registry: Registry, tmp_path: Path) -> None:
    """registry/client.py delete_manifest: the tag resolved to its digest (HEAD), that digest
    deleted; the other snapshot of the repository stays."""
    ref = f"{registry.host}/aenv-snapshots/deleted:one"
    kept = f"{registry.host}/aenv-snapshots/deleted:two"
    sent = push(_snapshot(tmp_path / "a", "one"), ref, {})
    push(_snapshot(tmp_path / "a", "two"), kept, {})
    assert _manifest_status(registry, "aenv-snapshots/deleted", "one") == 200
    mark = registry.log_mark()
    gone = repository.delete(ref)
    assert gone == {"ref": ref, "digest": sent["digest"], "deleted": True}
    assert f"DELETE /v2/aenv-snapshots/deleted/manifests/{sent['digest']}" in \
        registry.requests_since(mark)
    assert _manifest_status(registry, "aenv-snapshots/deleted", "one") == 404
    assert _manifest_status(registry, "aenv-snapshots/deleted", "two") == 200
    # gone already: no error, and nothing deleted
    assert repository.delete(ref) == {"ref": ref, "digest": None, "deleted": False}
    assert repository.delete(f"{registry.host}/aenv-snapshots/never:pushed")["deleted"] is False
    with pytest.raises(RepositoryError, match="registry"):
        repository.delete(f"dir://{tmp_path / 'shared' / 'one'}")


def test_a_registry_that_refuses_deletes_says_so(tmp_path_factory: pytest.TempPathFactory,
                                                tmp_path: Path) -> None:
    with running_registry(tmp_path_factory.mktemp("no-delete-registry"), delete=False) as strict:
        ref = f"{strict.host}/aenv-snapshots/kept:one"
        push(_snapshot(tmp_path / "a", "one"), ref, {})
        with pytest.raises(RegistryError) as refused:
            repository.delete(ref)
        assert "refuses deletes" in str(refused.value)
        assert "storage.delete.enabled" in str(refused.value)
        assert _manifest_status(strict, "aenv-snapshots/kept", "one") == 200
