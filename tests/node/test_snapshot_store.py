"""The VM backend's snapshot store deletes released snapshots: whole when nothing names a file
in them, else trimmed to the layer files a later snapshot grew from or a running VM reads (a
sandbox's earlier pause keeps its sealed disk upper for the later pauses' disk chain, not its
memory, device state or record)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentenv.node.vm_backend.snapshots import RELEASED_MARK, SnapshotStore
from agentenv.snapshot.record import (
    DiskSnapshot,
    LayerRef,
    MachineConfig,
    SnapshotRecord,
)


def _snapshot(root: Path, name: str, memory: list[Path], disk: list[Path]) -> Path:
    """A snapshot directory as runtime/vm.py writes one: its own memory layer, device state,
    sealed disk upper, startup pack and record (which names the stacks given)."""
    snap = root / name
    snap.mkdir(parents=True)
    for file in ("memory.layer", "devstate.bin", "disk-rootfs.layer", "startup-pack.json"):
        (snap / file).write_bytes(b"x" * 4096)
    record = SnapshotRecord(
        mode="tcg", machine=MachineConfig(accel="tcg", kernel="/k", cmdline=""),
        memory_layers=[LayerRef(path=str(p), size=4096) for p in [*memory,
                                                                  snap / "memory.layer"]],
        device_state=str(snap / "devstate.bin"), device_state_ram_block="ram0",
        disks=[DiskSnapshot(name="rootfs", layers=[
            LayerRef(path=str(p), size=4096) for p in [*disk, snap / "disk-rootfs.layer"]])])
    record.save(snap)
    return snap


def _collect(store: SnapshotStore, files: frozenset[Path] | set[Path] = frozenset(),
             dirs: frozenset[Path] | set[Path] = frozenset()) -> None:
    asyncio.run(store.collect(set(files), set(dirs)))


def _names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()} if path.exists() else set()


def test_an_earlier_pause_keeps_only_what_the_later_one_grew_from(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "vm-backend")
    first = _snapshot(store.root, "p1", [], [])
    # The second pause's memory was compacted (its stack names none of p1's memory); its disk
    # chain goes on from p1's sealed upper.
    second = _snapshot(store.root, "p2", [], [first / "disk-rootfs.layer"])
    (tmp_path / "vm-backend" / "sandboxes").mkdir()
    store.own("sbx", first)
    store.own("sbx", second)
    store.disown("sbx", str(first))
    assert store.owned("sbx") == [str(second)]
    assert store.mark_released([str(first)]) == 1
    _collect(store)
    assert _names(first) == {"disk-rootfs.layer", RELEASED_MARK}
    assert "memory.layer" in _names(second) and "devstate.bin" in _names(second)
    # Killed: nothing names p1's upper any more, both go whole.
    store.mark_released([str(second)])
    _collect(store)
    assert not first.exists() and not second.exists()


def test_a_memory_stack_not_yet_compacted_keeps_the_earlier_memory_layer(
        tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "vm-backend")
    first = _snapshot(store.root, "p1", [], [])
    _snapshot(store.root, "p2", [first / "memory.layer"], [first / "disk-rootfs.layer"])
    store.mark_released([str(first)])
    _collect(store)
    assert _names(first) == {"memory.layer", "disk-rootfs.layer", RELEASED_MARK}


def test_files_a_running_vm_reads_stay_and_a_restore_under_way_keeps_all(
        tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "vm-backend")
    first = _snapshot(store.root, "p1", [], [])
    store.mark_released([str(first)])
    # A child forked from p1 runs on its memory and disk layers (no later snapshot names them).
    running = {first / "memory.layer", first / "disk-rootfs.layer"}
    _collect(store, dirs={first})  # a restore from it under way: untouched
    assert "devstate.bin" in _names(first) and "snapshot.json" in _names(first)
    _collect(store, files=running)
    assert _names(first) == {"memory.layer", "disk-rootfs.layer", RELEASED_MARK}
    _collect(store)  # the child ended
    assert not first.exists()


def test_an_unreleased_snapshot_is_never_trimmed(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "vm-backend")
    first = _snapshot(store.root, "p1", [], [])
    _snapshot(store.root, "p2", [], [first / "disk-rootfs.layer"])
    _collect(store)
    assert {"memory.layer", "devstate.bin", "snapshot.json"} <= _names(first)
