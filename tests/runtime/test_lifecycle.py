"""Boot, pause/resume and fork real QEMU guests; failures end cleanly."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from agentenv.errors import AgentEnvError
from agentenv.runtime.errors import ModeMismatchError, SnapshotError, VMDiedError
from agentenv.runtime.qemu import QemuProcess
from agentenv.runtime.vm import VM
from agentenv.snapshot.record import SnapshotRecord
from agentenv.testing.harness import pss_kib, sh

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
        # Children start together beside their running source: on a small host (CI: 2 cores)
        # even two of them exceed tcg_vcpus_per_core vCPUs per core, so "auto" gives each
        # child's vCPUs one host thread (config.tcg_threads).
        cores = os.cpu_count() or 1
        if (rt.accel == "tcg" and rt.config.tcg_threads == "auto"
                and rt.config.tcg_vcpus_per_core * cores < 6):
            assert all("thread=single" in (c.workdir / "argv").read_text() for c in children)

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
    """Warm processes wait with the snapshot's disks attached; the pool refills to its high
    watermark once fewer than the low one wait."""
    rt = env.runtime
    saved = rt.config.process_pool_low, rt.config.process_pool_high
    rt.config.process_pool_low, rt.config.process_pool_high = 1, 2
    vms: list[VM] = []
    try:
        env.loop.run(rt.prime(counting))
        assert rt.warm_count(counting.id) == 2
        vms.append(env.loop.run(rt.restore(counting)))
        vm = vms[0]
        assert vm.timings["warm"] == 1.0
        assert vm.timings["process_ms"] < 5, "a warm restore creates and attaches no disk"
        assert count(env, vm) > 0
        env.loop.run(sh(vm, "echo 3 > /proc/sys/vm/drop_caches; cat /mnt/disk/data/file"))
        env.loop.run(asyncio.sleep(0.5))
        assert rt.warm_count(counting.id) == 1, "one left is not below the low watermark"
        vms.append(env.loop.run(rt.restore(counting)))
        assert vms[1].timings["warm"] == 1.0 and count(env, vms[1]) > 0

        async def refilled() -> None:
            while rt.warm_count(counting.id) < 2:
                await asyncio.sleep(0.05)

        env.loop.run(refilled(), timeout=60)
    finally:
        for vm in vms:
            env.loop.run(rt.kill(vm))
        env.loop.run(rt.unprime(counting.id))
        rt.config.process_pool_low, rt.config.process_pool_high = saved
    assert rt.warm_count(counting.id) == 0
    assert rt.memory.refcount(counting.id) == 0


def test_full_disk_during_pause_keeps_vm_and_last_snapshot(env: Env, counting: SnapshotRecord) -> None:
    """A pause on a full disk fails and the VM runs on: refused before writing when the pages
    the guest wrote cannot fit (runtime/memory.py), else by ENOSPC while writing
    (test_memory_capture covers both in isolation)."""
    rt = env.runtime
    full = env.root / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], check=True)
    vm = None
    try:
        vm = env.loop.run(rt.restore(counting))
        env.loop.run(sh(vm, "yes 0123456789 | head -c $((4*1048576)) > /tmp/fill; echo ok"))
        rt.config.snapshot_root = full
        with pytest.raises(SnapshotError, match=r"No space left|not enough free disk space"):
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


def test_pause_cycles_keep_the_memory_stack_within_ram(env: Env,
                                                       counting: SnapshotRecord) -> None:
    """Each pause adds a layer of the pages dirtied since the restore: with compaction by depth
    alone (32), three cycles each dirtying over a third of the RAM stacked ~1.5x the RAM of
    layers. The stack's bytes stay within max_memory_stack_ratio x RAM, and the compacted stack
    still restores the guest's memory. The ratio is 1.2 here (the default is 1.5, which took a
    fourth cycle to cross; each costs ~10 s of random data and digests under TCG): the third
    pause crosses it by ~70 MiB, and the compacted layer (~240 MiB, every page the guest has
    touched) stays ~70 MiB under it."""
    rt = env.runtime
    ram = counting.machine.memory_bytes
    saved_ratio, rt.config.max_memory_stack_ratio = rt.config.max_memory_stack_ratio, 1.2
    vm = None
    try:
        vm = env.loop.run(rt.restore(counting))
        for _ in range(3):
            # 96 MiB: /tmp is a tmpfs of half the 256 MiB RAM; more risks the guest's OOM killer
            out = env.loop.run(sh(vm, "rm -f /tmp/dirty; dd if=/dev/urandom of=/tmp/dirty"
                                      " bs=1M count=96 2>/dev/null; md5sum /tmp/dirty"))
            assert out.split(), "the guest answered nothing (out of memory?)"
            digest = out.split()[0]
            record = env.loop.run(rt.pause(vm))
            stack = sum(x.size for x in record.memory_layers)
            assert stack <= rt.config.max_memory_stack_ratio * ram, (
                f"{len(record.memory_layers)} layers of {stack >> 20} MiB for {ram >> 20} MiB RAM")
            vm = env.loop.run(rt.restore(record))
            assert env.loop.run(sh(vm, "md5sum /tmp/dirty")).split()[0] == digest
    finally:
        rt.config.max_memory_stack_ratio = saved_ratio
        if vm is not None:
            env.loop.run(rt.kill(vm))


# -- QEMU dying during a restore ------------------------------------------------------------
# The faults below are real (a real QEMU gets SIGKILL); only the moment is chosen by wrapping
# the runtime's own step (spawn, QMP command, the /init request), since nothing else can time
# a kill to land between two steps of one restore.


def _kill_now(pid: int) -> None:
    """SIGKILL and wait until the process is dead (a zombie or reaped), without letting the
    event loop run: the runtime's next step meets an already dead QEMU."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # reaped between open and read
            return
        if stat[stat.rindex(")") + 2:].split()[0] in ("Z", "X"):
            return
        time.sleep(0.001)
    raise AssertionError(f"QEMU pid {pid} did not die after SIGKILL")


def _qemu_children() -> set[int]:
    """QEMU processes this test process started (alive or not yet reaped)."""
    me, out = os.getpid(), set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if comm.startswith("qemu-system") and int(stat[stat.rindex(")") + 2:].split()[1]) == me:
            out.add(int(proc.name))
    return out


def _snapshot_digests(record: SnapshotRecord) -> dict[str, str]:
    """sha256 of every file the snapshot consists of (its directory, every layer it stacks)."""
    paths = {Path(x.path) for x in record.memory_layers}
    paths |= {Path(x.path) for d in record.disks for x in d.layers}
    paths |= {Path(d.file) for d in record.disks if d.file}
    paths |= set(Path(record.device_state).parent.iterdir())
    digests = {}
    for path in sorted(paths):
        with open(path, "rb") as f:
            digests[str(path)] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests


@dataclass
class _Holdings:
    """What the runtime holds: must be the same before a failed restore and after it."""

    vms: set[str]
    qemus: set[int]
    slots_in_use: set[int]
    blockd_devices: set[str]
    memory_refs: int
    vm_dirs: set[str]

    @classmethod
    def of(cls, env: Env, record: SnapshotRecord) -> _Holdings:
        rt = env.runtime
        env.loop.run(rt.drain())
        return cls(set(rt.vms), _qemu_children(),
                   set(rt.slots._in_use),  # no public view of the slots in use
                   {d.id for d in env.loop.run(rt.blockd.list())},
                   rt.memory.refcount(record.id),
                   {p.name for p in rt.config.vm_dir.iterdir()})

    def differences(self, other: _Holdings) -> dict[str, tuple[Any, Any]]:
        mine, theirs = asdict(self), asdict(other)
        return {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}


@pytest.fixture
def bystander(env: Env, counting: SnapshotRecord) -> Iterator[VM]:
    """A VM restored from `counting` before the fault: it must keep running through it (and
    its reference on the shared memory file makes a double release visible)."""
    vm = env.loop.run(env.runtime.restore(counting))
    yield vm
    env.loop.run(env.runtime.kill(vm))


def _install_fault(stage: str, env: Env, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Kill QEMU at `stage` of the next restore; returns the list the killed pid lands in."""
    killed: list[int] = []

    def kill(pid: int) -> None:
        if not killed:
            killed.append(pid)
            _kill_now(pid)

    if stage == "spawned":
        spawn = QemuProcess.spawn

        async def spawn_then_die(cls: type[QemuProcess], *args: Any, **kwargs: Any) -> QemuProcess:
            process = await spawn(*args, **kwargs)
            kill(process.pid)
            return process

        monkeypatch.setattr(QemuProcess, "spawn", classmethod(spawn_then_die))
    elif stage in ("warm-taken", "device-state", "cont"):
        execute = QemuProcess.execute
        # warm-taken: the first command of the restore to the warm process it took.
        kill_before = {"cont": "cont", "warm-taken": "migrate-set-capabilities"}.get(stage)

        async def execute_with_death(self: QemuProcess, command: str, *args: Any,
                                     **kwargs: Any) -> Any:
            if command == kill_before:
                kill(self.pid)
            result = await execute(self, command, *args, **kwargs)
            if stage == "device-state" and command == "migrate-incoming":
                kill(self.pid)  # the device state is loading (or just loaded)
            return result

        monkeypatch.setattr(QemuProcess, "execute", execute_with_death)
    elif stage == "envd-init":
        http = env.runtime.envd.http
        stream = http.stream
        victims: list[int] = []
        real_while_alive = env.runtime.envd.while_alive

        async def note_victim(vm: VM, call: Any) -> Any:
            victims.append(vm.pid)
            return await real_while_alive(vm, call)

        def stream_and_die(method: str, url: str, **kwargs: Any) -> Any:
            if method != "POST" or not url.endswith("/init"):
                return stream(method, url, **kwargs)
            body = json.dumps(kwargs.pop("json")).encode()
            # With its length announced, the guest's CGI waits for the whole body.
            kwargs["headers"] = {**(kwargs.get("headers") or {}), "Content-Length": str(len(body))}

            async def chunks() -> AsyncIterator[bytes]:
                yield body[:8]
                # The guest has accepted the connection and has the headers and a part of
                # the body: /init is in flight when QEMU dies.
                kill(victims[-1])
                await asyncio.sleep(60)
                yield body[8:]

            return stream(method, url, content=chunks(), **kwargs)

        monkeypatch.setattr(env.runtime.envd, "while_alive", note_victim)
        monkeypatch.setattr(http, "stream", stream_and_die)
    else:
        raise AssertionError(stage)
    return killed


_STAGES = {
    "spawned": (SnapshotError, "QEMU died loading its device state"),
    "warm-taken": (SnapshotError, "QEMU died loading its device state"),
    "device-state": (SnapshotError, "QEMU died loading its device state"),
    "cont": (VMDiedError, "restore of snapshot .*: QEMU died resuming the guest"),
    "envd-init": (VMDiedError, "restore of snapshot .*: QEMU died while envd /init was in flight"),
}


@pytest.mark.parametrize("stage, error", list(_STAGES.items()), ids=list(_STAGES))
def test_qemu_dying_during_restore_fails_cleanly(
        env: Env, counting: SnapshotRecord, bystander: VM, monkeypatch: pytest.MonkeyPatch,
        stage: str, error: tuple[type[AgentEnvError], str]) -> None:
    rt = env.runtime
    digests = _snapshot_digests(counting)
    before = _Holdings.of(env, counting)
    if stage == "warm-taken":  # the restore takes a warm process, which dies at once
        env.loop.run(rt.prime(counting, 1))
        warm_pids = _qemu_children() - before.qemus
    try:
        with monkeypatch.context() as patch:
            killed = _install_fault(stage, env, patch)
            t0 = time.monotonic()
            with pytest.raises(error[0], match=error[1]) as failure:
                env.loop.run(rt.restore(counting), timeout=60)
            failed_in = time.monotonic() - t0
        assert killed, f"the fault at {stage} never fired (restore raised {failure.value!r})"
        assert f"pid {killed[0]}" in str(failure.value) and "status -9" in str(failure.value)
        assert failed_in < 10, f"noticing the dead QEMU took {failed_in:.1f} s"
        if stage == "warm-taken":
            assert killed == list(warm_pids)

            async def refilled() -> None:
                while rt.warm_count(counting.id) < 1:
                    await asyncio.sleep(0.05)

            env.loop.run(refilled(), timeout=60)  # the pool recovers from the failure
            env.loop.run(rt.unprime(counting.id))
        after = _Holdings.of(env, counting)
        assert killed[0] not in after.qemus
        assert not after.differences(before), "(after, before) of what the runtime holds"
        assert after.memory_refs == 1, "the bystander's reference, and only it"
    finally:
        env.loop.run(rt.unprime(counting.id))
    assert _snapshot_digests(counting) == digests, "the snapshot's files must not change"
    assert bystander.state == "running" and bystander.id in rt.vms
    first = count(env, bystander)
    time.sleep(0.5)
    assert count(env, bystander) > first
    vm = env.loop.run(rt.restore(counting))
    try:
        first = count(env, vm)
        time.sleep(0.5)
        assert count(env, vm) > first
        assert "persistent-42" in env.loop.run(sh(vm, "cat /mnt/disk/data/file"))
    finally:
        env.loop.run(rt.kill(vm))
    assert rt.memory.refcount(counting.id) == 1


def test_warm_process_that_died_in_the_pool_is_skipped(
        env: Env, counting: SnapshotRecord, bystander: VM) -> None:
    rt = env.runtime
    before = _Holdings.of(env, counting)
    env.loop.run(rt.prime(counting, 2))
    vm = None
    try:
        pool = rt.warm.waiting(counting.id)  # the next restore takes the last one
        dead, alive_one = pool[-1].process, pool[0].process
        _kill_now(dead.pid)
        env.loop.run(asyncio.wait_for(dead.died.wait(), 5))
        vm = env.loop.run(rt.restore(counting))
        assert vm.timings["warm"] == 1.0 and vm.pid == alive_one.pid
        first = count(env, vm)
        time.sleep(0.5)
        assert count(env, vm) > first

        async def refilled() -> None:
            while not (rt.warm_count(counting.id) == 2
                       and all(not w.process.died.is_set() for w in rt.warm.waiting(counting.id))):
                await asyncio.sleep(0.05)

        env.loop.run(refilled(), timeout=60)
        # The dead process's slot, memory reference and directory are already back.
        assert rt.memory.refcount(counting.id) == before.memory_refs + 3  # vm + 2 warm
        assert len(rt.slots._in_use) == len(before.slots_in_use) + 3
    finally:
        if vm is not None:
            env.loop.run(rt.kill(vm))
        env.loop.run(rt.unprime(counting.id))
    assert not _Holdings.of(env, counting).differences(before)
    first = count(env, bystander)
    time.sleep(0.5)
    assert count(env, bystander) > first


def test_restore_cancelled_while_its_memory_file_is_made_keeps_no_reference(
        env: Env, counting: SnapshotRecord, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore cancelled (its client went away) while a thread materialises the memory
    file: the thread still takes its reference, which must be given back."""
    rt = env.runtime
    copy = _copy_record(counting, env.root / "cancelled")
    acquire = rt.memory.acquire
    started, proceed, done = threading.Event(), threading.Event(), threading.Event()

    def gated_acquire(*args: Any) -> Path:
        started.set()
        proceed.wait(30)  # the restore is cancelled before the real acquire starts
        try:
            return acquire(*args)
        finally:
            done.set()

    monkeypatch.setattr(rt.memory, "acquire", gated_acquire)

    async def cancel_while_materialising() -> None:
        restore = asyncio.ensure_future(rt.restore(copy))
        assert await asyncio.to_thread(started.wait, 30)
        restore.cancel()
        proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await restore
        assert await asyncio.to_thread(done.wait, 60)
        deadline = time.monotonic() + 5  # the thread's result reaches the loop soon after
        while rt.memory.refcount(copy.id) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    vms_before = set(rt.vms)
    env.loop.run(cancel_while_materialising())
    assert rt.memory.refcount(copy.id) == 0
    assert not rt.memory.path_for(copy.id).exists(), "an unused memory file is removed"
    assert set(rt.vms) == vms_before
