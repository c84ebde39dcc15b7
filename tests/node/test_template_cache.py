"""The host's cache of built-in templates (AENV_VM_TEMPLATE_CACHE, node/base_template.py):
a node's fresh build moves there whole, its record naming the new places, and the nodes of
one host take turns building. (A second VM node taking the build in place: test_vm_backend.)"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

import pytest

from agentenv.guest.build.assets import GuestAssets
from agentenv.guest.build.rootfs import BASE_USER
from agentenv.node.base_template import (
    BASE,
    CODE_INTERPRETER,
    BaseTemplate,
    _host_lock,
    load_cached,
    publish,
    template_key,
)
from agentenv.snapshot.record import (
    DiskSnapshot,
    LayerRef,
    MachineConfig,
    SnapshotRecord,
    SnapshotRecordError,
)

KEY = "0123456789abcdef01234567"


def _file(path: Path, size: int) -> LayerRef:
    path.write_bytes(os.urandom(size))
    return LayerRef(path=str(path), size=size)


def _fresh_build(tmp_path: Path) -> tuple[BaseTemplate, Path, Path]:
    """What a node's build leaves: the base rootfs layer in its template directory, the boot
    snapshot in its snapshot store, the tools disk among the guest assets."""
    template_dir = tmp_path / "state" / "templates" / "base"
    record_dir = tmp_path / "state" / "vm-backend" / "runtime" / "snapshots" / "boot"
    assets = tmp_path / "assets"
    for d in (template_dir, record_dir, assets):
        d.mkdir(parents=True)
    tools = assets / "tools.img"
    tools.write_bytes(b"tools")
    record = SnapshotRecord(
        mode="tcg",
        machine=MachineConfig(accel="tcg", kernel=str(assets / "vmlinuz"), cmdline="console=ttyS0"),
        memory_layers=[_file(record_dir / "memory.layer", 4096)],
        device_state=str(record_dir / "devstate.bin"),
        device_state_ram_block="ram0",
        disks=[DiskSnapshot(name="tools", layers=[], read_only=True, file=str(tools)),
               DiskSnapshot(name="rootfs", layers=[
                   _file(template_dir / f"rootfs-{KEY}.layer", 8192),
                   _file(record_dir / "rootfs-upper.layer", 1024)])])
    (record_dir / "devstate.bin").write_bytes(b"devstate")
    record.save(record_dir)
    built = BaseTemplate(record_dir, (), 2, 512, 4 << 30)
    return built, template_dir, tools


def test_a_build_moves_into_the_cache_and_its_record_names_the_new_places(
        tmp_path: Path) -> None:
    built, template_dir, tools = _fresh_build(tmp_path)
    entry = tmp_path / "cache" / f"base-{KEY}"
    shared = publish(built, template_dir, KEY, entry)

    assert shared.record_dir == entry
    assert not built.record_dir.exists()  # the node's emptied snapshot directory went
    assert not (template_dir / f"rootfs-{KEY}.layer").exists()
    assert sorted(p.name for p in entry.iterdir()) == sorted([
        "devstate.bin", "memory.layer", "rootfs-upper.layer", f"rootfs-{KEY}.layer",
        "snapshot.json", "template.json"])
    record = SnapshotRecord.load(entry)
    record.check_files()
    assert record.device_state == str(entry / "devstate.bin")
    assert [x.path for x in record.memory_layers] == [str(entry / "memory.layer")]
    rootfs = next(d for d in record.disks if d.name == "rootfs")
    assert [x.path for x in rootfs.layers] == [str(entry / f"rootfs-{KEY}.layer"),
                                               str(entry / "rootfs-upper.layer")]
    # the guest assets it names stay where they are: they are the host's already
    assert next(d for d in record.disks if d.name == "tools").file == str(tools)
    assert shared.layers == (str(entry / "memory.layer"), str(entry / f"rootfs-{KEY}.layer"),
                             str(entry / "rootfs-upper.layer"))
    assert load_cached(entry, KEY) == shared
    assert load_cached(entry, "another key") is None


def test_a_damaged_entry_is_refused_and_replaced(tmp_path: Path) -> None:
    built, template_dir, _ = _fresh_build(tmp_path)
    entry = tmp_path / "cache" / f"base-{KEY}"
    publish(built, template_dir, KEY, entry)
    (entry / "memory.layer").write_bytes(b"short")  # truncated
    with pytest.raises(SnapshotRecordError, match="memory layer"):
        SnapshotRecord.load(entry).check_files()
    assert load_cached(entry, KEY) is None

    again, template_dir, _ = _fresh_build(tmp_path / "again")
    shared = publish(again, template_dir, KEY, entry)
    assert load_cached(entry, KEY) == shared
    assert not entry.with_name(entry.name + ".partial").exists()
    assert json.loads((entry / "template.json").read_text())["record_dir"] == str(entry)


def test_the_hosts_builders_take_turns(tmp_path: Path) -> None:
    """Two nodes needing the same template: the second waits for the first's build (flock:
    freed by the kernel if the holder dies)."""
    lock = tmp_path / "cache" / ".base.lock"
    order: list[str] = []

    async def builder(name: str, holding: asyncio.Event, after: asyncio.Event | None) -> None:
        if after is not None:
            await after.wait()  # the other one holds the lock by now
        async with _host_lock(lock):
            order.append(f"{name} in")
            holding.set()
            await asyncio.sleep(0.1)
            order.append(f"{name} out")

    async def main() -> None:
        a_holds, b_holds = asyncio.Event(), asyncio.Event()
        await asyncio.gather(builder("a", a_holds, None), builder("b", b_holds, a_holds))

    asyncio.run(main())
    assert order == ["a in", "a out", "b in", "b out"]
    assert (tmp_path / "cache").stat().st_mode & 0o077 == 0  # root's alone: a layer cache


def test_the_start_user_is_part_of_the_key(tmp_path: Path) -> None:
    """code-interpreter-v1's server starts as root (its kernels are root's, as E2B's are): a
    build made when it started as `user` is not taken for it, and base's key is as before."""
    files = []
    for name in ("vmlinuz", "initramfs", "tools", "manifest"):
        (tmp_path / name).write_bytes(name.encode())
        files.append(tmp_path / name)
    assets = GuestAssets(*files, cmdline_base="console=ttyS0")
    assert CODE_INTERPRETER.start_user == "root" and BASE.start_user == BASE_USER
    as_user = dataclasses.replace(CODE_INTERPRETER, start_user=BASE_USER)
    assert template_key(assets, "kvm", spec=CODE_INTERPRETER) != \
        template_key(assets, "kvm", spec=as_user)
    assert template_key(assets, "kvm", spec=BASE) == template_key(
        assets, "kvm", spec=dataclasses.replace(BASE, start_user="root"))  # no start command
