"""Snapshot repositories (snapshot/repository.py) in-process: a snapshot whose files live in
several directories, pushed to a real registry (Debian's docker-registry on loopback) and to
a shared directory, fetched into another node's snapshot root byte for byte."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.snapshot.record import (
    DiskConfig,
    DiskSnapshot,
    LayerRef,
    MachineConfig,
    SnapshotRecord,
)
from agentenv.snapshot.repository import (
    ARTIFACT_TYPE,
    PACK_NAME,
    RepositoryError,
    fetch,
    parse_ref,
    push,
)
from tests.template.conftest import Registry, _start_registry, _stop


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = _start_registry(tmp_path_factory.mktemp("registry"), None)
    yield reg
    _stop(reg)


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
    got = fetch(ref, node_b)
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
