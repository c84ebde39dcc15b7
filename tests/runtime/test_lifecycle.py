"""Boot, pause/resume and fork real QEMU guests; failures end cleanly."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agentenv.runtime.errors import ModeMismatchError, SnapshotError
from agentenv.runtime.harness import pss_kib, sh
from agentenv.snapshot.record import SnapshotRecord

from .conftest import Env, count

pytestmark = [pytest.mark.qemu, pytest.mark.root]

def test_pause_resume_keeps_processes_and_files(env: Env, counting: SnapshotRecord) -> None:
    rt = env.runtime
    vm = env.loop.run(rt.restore(counting, env_vars={"A": "1"}))
    try:
        first = count(env, vm)
        time.sleep(0.5)
        second = count(env, vm)
        assert second > first, "the counter must keep running after the restore"
        out = env.loop.run(sh(vm, "echo 3 > /proc/sys/vm/drop_caches; cat /mnt/disk/data/file;"
                                  " cat /tmp/.envd-init.json"))
        assert "persistent-42" in out
        assert '"envVars":{"A":"1"}' in out.replace(" ", "")
        # Write more (memory and disk), pause again: the new memory layer stacks on the old.
        env.loop.run(sh(vm, "echo second > /tmp/marker; echo two > /mnt/disk/data/two; sync"))
        digest = env.loop.run(sh(vm, "dd if=/dev/urandom of=/tmp/rand bs=4096 count=512 2>/dev/null;"
                                     " md5sum /tmp/rand")).split()[0]
        before_pause = count(env, vm)
        record2 = env.loop.run(rt.pause(vm))
        assert len(record2.memory_layers) == len(counting.memory_layers) + 1
        assert len(record2.disks[0].layers) == len(counting.disks[0].layers) + 1
        vm = env.loop.run(rt.restore(record2))
        out = env.loop.run(sh(vm, "echo 3 > /proc/sys/vm/drop_caches; cat /tmp/marker "
                                  "/mnt/disk/data/two /mnt/disk/data/file"))
        assert out.split() == ["second", "two", "persistent-42"]
        assert env.loop.run(sh(vm, "md5sum /tmp/rand")).split()[0] == digest
        assert count(env, vm) >= before_pause
    finally:
        env.loop.run(rt.kill(vm))
    assert rt.memory.refcount(counting.id) == 0


RESEEDS = "dmesg | grep -c 'crng reseeded due to virtual machine fork'"
# The first thing a guest does after its restore: 32 bytes from the RNG, and the kernel's count
# of vmgenid-triggered reseeds.
FIRST_LOOK = f"head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; {RESEEDS}"


def test_fork_children_diverge(env: Env, counting: SnapshotRecord) -> None:
    rt = env.runtime
    source = env.loop.run(rt.restore(counting))
    children = []
    try:
        # The guest kernel (6.12) binds its vmgenid driver to QEMU's vmgenid device.
        assert env.loop.run(sh(source, "readlink /sys/bus/acpi/devices/QEMUVGID:00/physical_node/driver"
                                       )).strip().endswith("/vmgenid")
        reseeds_before = int(env.loop.run(sh(source, RESEEDS)).strip())
        assert reseeds_before >= 1, "the restore of `counting` must have reseeded the RNG already"
        env.loop.run(sh(source, "echo source > /tmp/who"))
        record, children = env.loop.run(rt.fork(source, 2))
        assert len({source.vmgenid, *(c.vmgenid for c in children)}) == 3

        async def first_looks() -> list[list[str]]:
            outs = await asyncio.gather(*[sh(c, FIRST_LOOK) for c in (*children, source)])
            return [o.split() for o in outs]

        looks = env.loop.run(first_looks())
        # Each child's new vmgenid made its kernel reseed once more than the source had; the
        # source (not restored) did not. Their RNG outputs all differ.
        assert [int(x[1]) for x in looks] == [reseeds_before + 1] * 2 + [reseeds_before], looks
        assert len({x[0] for x in looks}) == 3 and all(len(x[0]) == 64 for x in looks), looks
        assert len({c.envd_url for c in children}) == 2
        for n, child in enumerate(children):
            env.loop.run(sh(child, f"echo child{n} > /tmp/who; echo c{n} > /mnt/disk/data/mine; sync"))
        env.loop.run(sh(source, "echo src > /mnt/disk/data/mine; sync"))
        starts = [count(env, v) for v in (source, *children)]
        time.sleep(0.6)
        ends = [count(env, v) for v in (source, *children)]
        assert all(e > s for s, e in zip(starts, ends, strict=True)), (starts, ends)
        whos = [env.loop.run(sh(v, "cat /tmp/who; echo 3 > /proc/sys/vm/drop_caches;"
                                   " cat /mnt/disk/data/mine")).split()
                for v in (source, *children)]
        assert whos == [["source", "src"], ["child0", "c0"], ["child1", "c1"]]
        # The fork snapshot holds the source's state at fork time, before the writes above.
        assert len(record.memory_layers) == len(counting.memory_layers) + 1
    finally:
        for vm in (*children, source):
            env.loop.run(rt.kill(vm))


@pytest.mark.slow
def test_fork_16_children_run_at_once_and_share_memory(env: Env, counting: SnapshotRecord) -> None:
    rt = env.runtime
    source = env.loop.run(rt.restore(counting))
    children = []
    try:
        t0 = time.monotonic()
        _, children = env.loop.run(rt.fork(source, 16))
        fork_s = time.monotonic() - t0
        assert len(children) == 16

        async def all_run() -> list[str]:
            return await asyncio.gather(*[sh(c, f"echo $(( {n} * 1000 + 7 ))")
                                          for n, c in enumerate(children)])

        outs = env.loop.run(all_run())
        assert [o.strip() for o in outs] == [str(n * 1000 + 7) for n in range(16)]
        mem = [pss_kib(c.pid) for c in children]
        pss = sum(m["Pss"] for m in mem) / len(mem)
        rss = sum(m["Rss"] for m in mem) / len(mem)
        shared = sum(m["Shared_Clean"] for m in mem) / len(mem)
        print(f"fork 16: {fork_s:.1f} s; per child: Rss {rss/1024:.1f} MiB, "
              f"Pss {pss/1024:.1f} MiB, Shared_Clean {shared/1024:.1f} MiB")
        assert shared > 8 * 1024, "children must share clean pages of the snapshot memory file"
        assert pss < rss
    finally:
        for vm in (*children, source):
            env.loop.run(rt.kill(vm))


def _copy_record(record: SnapshotRecord, root: Path) -> SnapshotRecord:
    """A private copy of a snapshot's files (so damaging it leaves the original intact)."""
    root.mkdir(parents=True)
    layers = []
    for n, layer in enumerate(record.memory_layers):
        dst = root / f"mem{n}.layer"
        shutil.copyfile(layer.path, dst)
        layers.append(layer.model_copy(update={"path": str(dst)}))
    dev = root / "devstate.bin"
    shutil.copyfile(record.device_state, dev)
    return record.model_copy(update={"id": f"copy-{root.name}", "memory_layers": layers,
                                     "device_state": str(dev)})


def test_restore_across_modes_is_refused(env: Env, counting: SnapshotRecord) -> None:
    other = "kvm" if counting.mode == "tcg" else "tcg"
    record = counting.model_copy(update={"mode": other})
    vms_before = set(env.runtime.vms)
    with pytest.raises(ModeMismatchError, match="cannot cross accelerators"):
        env.loop.run(env.runtime.restore(record))
    assert set(env.runtime.vms) == vms_before


def test_damaged_or_missing_memory_layer_fails_cleanly(env: Env, counting: SnapshotRecord) -> None:
    rt = env.runtime
    free_slots = rt.slots.free_count
    # A layer whose header is garbage (same size, so the record's size check passes).
    bad = _copy_record(counting, env.root / "damaged")
    with open(bad.memory_layers[-1].path, "r+b") as f:
        f.write(os.urandom(4096))
    with pytest.raises(SnapshotError, match="memory layer"):
        env.loop.run(rt.restore(bad))
    assert rt.memory.refcount(bad.id) == 0
    assert not rt.memory.path_for(bad.id).exists()
    # A missing layer.
    gone = _copy_record(counting, env.root / "missing")
    os.unlink(gone.memory_layers[0].path)
    with pytest.raises(SnapshotError, match="missing"):
        env.loop.run(rt.restore(gone))
    # A truncated device state: QEMU refuses it, the VM is not created, resources come back.
    cut = _copy_record(counting, env.root / "cut")
    os.truncate(cut.device_state, 100)
    with pytest.raises(SnapshotError):
        env.loop.run(rt.restore(cut))
    assert rt.slots.free_count >= free_slots
    assert rt.memory.refcount(cut.id) == 0
    # The original snapshot still restores.
    vm = env.loop.run(rt.restore(counting))
    assert count(env, vm) > 0
    env.loop.run(rt.kill(vm))


def test_dead_qemu_is_noticed(env: Env, counting: SnapshotRecord) -> None:
    rt = env.runtime
    died: list[str] = []
    rt.on_vm_died = lambda vm: died.append(vm.id)
    try:
        vm = env.loop.run(rt.restore(counting))
        os.kill(vm.pid, signal.SIGKILL)
        env.loop.run(asyncio.sleep(0.5))
        assert died == [vm.id]
        assert vm.state == "error" and "exited" in (vm.error or "")
        assert vm.id not in rt.vms
        assert rt.memory.refcount(counting.id) == 0
    finally:
        rt.on_vm_died = None


def test_warm_pool_serves_restores(env: Env, counting: SnapshotRecord) -> None:
    rt = env.runtime
    env.loop.run(rt.prime(counting, 2))
    assert rt.warm_count(counting.id) == 2
    vm = env.loop.run(rt.restore(counting))
    try:
        assert vm.timings["warm"] == 1.0
        assert count(env, vm) > 0
        env.loop.run(sh(vm, "echo 3 > /proc/sys/vm/drop_caches; cat /mnt/disk/data/file"))

        async def refilled() -> None:
            while rt.warm_count(counting.id) < 2:
                await asyncio.sleep(0.05)

        env.loop.run(refilled(), timeout=60)
    finally:
        env.loop.run(rt.kill(vm))
        env.loop.run(rt.unprime(counting.id))
    assert rt.warm_count(counting.id) == 0
    assert rt.memory.refcount(counting.id) == 0


def test_full_disk_during_pause_keeps_vm_and_last_snapshot(env: Env, counting: SnapshotRecord) -> None:
    rt = env.runtime
    full = env.root / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], check=True)
    vm = None
    try:
        vm = env.loop.run(rt.restore(counting))
        env.loop.run(sh(vm, "yes 0123456789 | head -c $((4*1048576)) > /tmp/fill; echo ok"))
        rt.config.snapshot_root = full
        with pytest.raises(SnapshotError, match="No space left"):
            env.loop.run(rt.pause(vm))
        rt.config.snapshot_root = None
        assert vm.state == "running" and "snapshot failed" in (vm.error or "")
        assert list(full.iterdir()) == [], "a failed snapshot leaves nothing behind"
        first = count(env, vm)
        time.sleep(0.4)
        assert count(env, vm) > first
        # With space again, pausing works and the older snapshot still restores too.
        record = env.loop.run(rt.pause(vm))
        vm = env.loop.run(rt.restore(record))
        assert "0123456789" in env.loop.run(sh(vm, "head -c 10 /tmp/fill"))
        env.loop.run(rt.kill(vm))
        vm = env.loop.run(rt.restore(counting))
        assert count(env, vm) > 0
    finally:
        rt.config.snapshot_root = None
        if vm is not None:
            env.loop.run(rt.kill(vm))
        subprocess.run(["umount", str(full)], check=False)


def test_deep_memory_stack_is_compacted(env: Env, counting: SnapshotRecord) -> None:
    rt = env.runtime
    rt.config.max_memory_layers = 1
    vm = None
    try:
        vm = env.loop.run(rt.restore(counting))
        digest = env.loop.run(sh(vm, "dd if=/dev/urandom of=/tmp/rand2 bs=4096 count=256"
                                     " 2>/dev/null; md5sum /tmp/rand2")).split()[0]
        record = env.loop.run(rt.pause(vm))
        assert [Path(x.path).name for x in record.memory_layers] == ["memory-compacted.layer"]
        assert not (Path(record.device_state).parent / "memory.layer").exists()
        vm = env.loop.run(rt.restore(record))
        assert env.loop.run(sh(vm, "md5sum /tmp/rand2")).split()[0] == digest
        first = count(env, vm)
        time.sleep(0.4)
        assert count(env, vm) > first
    finally:
        rt.config.max_memory_layers = 32
        if vm is not None:
            env.loop.run(rt.kill(vm))
