"""Least privilege and resource limits with real QEMU: the VM user, both seccomp layers, the
per-VM cgroup, and a hostile guest (memory hog, fork bomb) that must hurt nobody else."""

from __future__ import annotations

import os
import pwd
import time
from pathlib import Path

import pytest

from agentenv.runtime.cgroup import CgroupManager, default_parent, vm_memory_overhead_mib
from agentenv.snapshot.record import SnapshotRecord
from agentenv.testing.harness import alive, sh

from .conftest import PREFIX, Env


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _ram_rss_kib(pid: int, mem_path: str) -> int:
    """Resident KiB of the guest RAM mapping (the pages of guest RAM the VM touched)."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(mem_path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def _rss_kib(pid: int) -> int:
    return int(_status(pid)["VmRSS"].split()[0])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_qemu_runs_as_the_vm_user_under_both_seccomp_layers(env: Env,
                                                            counting: SnapshotRecord) -> None:
    runtime = env.runtime
    vm = env.loop.run(runtime.restore(counting))
    try:
        user = pwd.getpwnam(runtime.config.qemu_user or "")
        status = _status(vm.pid)
        uid, gid = str(user.pw_uid), str(user.pw_gid)
        if runtime.uids is not None:
            # Jailed (runtime/jail.py): a uid and gid of its own, the VM group besides.
            uid = gid = status["Uid"].split()[0]
            assert runtime.uids.contains(int(uid))
            assert status["Groups"] == str(user.pw_gid)
        else:
            assert status["Groups"] == ""
        assert status["Uid"].split() == [uid] * 4
        assert status["Gid"].split() == [gid] * 4
        assert status["CapEff"] == "0000000000000000"
        assert status["Seccomp"] == "2"
        # Ours (punch-hole) and QEMU's own -sandbox.
        assert int(status["Seccomp_filters"]) >= 2
        assert status["NoNewPrivs"] == "1"
        assert "-sandbox" in (vm.workdir / "argv").read_text()
        # Everything it opened after the drop still works: snapshot (device state written),
        # fork (device state read, NBD, TAP, RAM file), the child answers.
        _, children = env.loop.run(runtime.fork(vm, 1))
        assert "ok" in env.loop.run(sh(children[0], "echo ok"))
        child_uid = _status(children[0].pid)["Uid"].split()[0]
        assert child_uid == uid if runtime.uids is None else child_uid != uid
        env.loop.run(runtime.kill(children[0]))
    finally:
        env.loop.run(runtime.kill(vm))


def test_each_vm_has_its_cgroup_with_limits_removed_at_exit(env: Env,
                                                           counting: SnapshotRecord) -> None:
    runtime = env.runtime
    if not runtime.cgroups.enabled:
        pytest.skip("no usable cgroups on this host")
    vm = env.loop.run(runtime.restore(counting))
    group = vm.process.cgroup
    assert group is not None and group.dirs
    try:
        for directory in group.dirs:
            assert str(vm.pid) in (directory / "cgroup.procs").read_text().split()
        machine = counting.machine
        expected = machine.memory_bytes + (vm_memory_overhead_mib(machine, runtime.config) << 20)
        memory_dir = next(d for d in group.dirs if "memory" in d.parts or runtime.cgroups.version == 2)
        limit_file = "memory.max" if runtime.cgroups.version == 2 else "memory.limit_in_bytes"
        assert int((memory_dir / limit_file).read_text()) == expected
        cpu_dir = next(d for d in group.dirs if "cpu" in d.parts or runtime.cgroups.version == 2)
        if runtime.cgroups.version == 1:
            assert int((cpu_dir / "cpu.cfs_quota_us").read_text()) == machine.vcpus * 100_000
            # One normal task's weight per host thread running vCPUs (1 with thread=single).
            threads = 1 if "thread=single" in (vm.workdir / "argv").read_text() else machine.vcpus
            assert int((cpu_dir / "cpu.shares").read_text()) == threads * 1024
            # Flat: a peer of the node's processes, not inside a parent whose weight would
            # count for every VM at once (runtime/cgroup.py).
            assert cpu_dir.parent == runtime.cgroups.parents["cpu"]
            assert cpu_dir.name == f"{runtime.cgroups.flat['cpu']}{group.name}"
        # A crashed runtime's leftover (empty) is removed at the next start; a cgroup with a
        # live QEMU (one a restarted node adopts) stays.
        leftovers = [base / f"{runtime.cgroups.flat.get(c, '')}leftover-of-a-crash"
                     for c, base in runtime.cgroups.parents.items()]
        for leftover in leftovers:
            leftover.mkdir()
        again = CgroupManager.detect(runtime.config.cgroups, runtime.config.cgroup_parent
                                     or default_parent(PREFIX, runtime.config.state_dir))
        assert again.parents == runtime.cgroups.parents
        assert not any(leftover.exists() for leftover in leftovers)
        assert all(d.exists() for d in group.dirs)
    finally:
        env.loop.run(runtime.kill(vm))
    assert not any(d.exists() for d in group.dirs)


def test_memory_overhead_of_an_idle_vm_fits_the_limit(env: Env, counting: SnapshotRecord) -> None:
    """The measure behind QEMU_BASE_OVERHEAD_MIB: RSS of an idle restored VM minus the guest
    RAM it touched, printed for bench/RESULTS.md."""
    runtime = env.runtime
    vm = env.loop.run(runtime.restore(counting))
    try:
        env.loop.run(sh(vm, "echo warm"))
        time.sleep(2)
        rss = _rss_kib(vm.pid)
        ram = _ram_rss_kib(vm.pid, str(vm.mem_path))
        overhead_mib = (rss - ram) / 1024
        allowed = vm_memory_overhead_mib(counting.machine, runtime.config)
        print(f"\nidle VM: RSS {rss / 1024:.1f} MiB, guest RAM touched {ram / 1024:.1f} MiB, "
              f"QEMU overhead {overhead_mib:.1f} MiB (allowed {allowed} MiB)")
        assert overhead_mib < allowed
    finally:
        env.loop.run(runtime.kill(vm))


HOG = ("awk 'BEGIN { for (i = 0; ; i++) a[i] = sprintf(\"%0100000d\", i) }' "
       ">/dev/null 2>&1; echo hog-exit=$?")


def test_hostile_guest_memory_hog_and_fork_bomb_hurt_nobody_else(
        env: Env, counting: SnapshotRecord) -> None:
    runtime = env.runtime
    saved = runtime.config.cpu_max_per_vcpu
    # Half a host CPU per vCPU: the 2-vCPU hostile VM may use one of the host's two cores.
    runtime.config.cpu_max_per_vcpu = 0.5
    try:
        hostile = env.loop.run(runtime.restore(counting))
    finally:
        runtime.config.cpu_max_per_vcpu = saved
    bystander = env.loop.run(runtime.restore(counting))
    try:
        limit = counting.machine.memory_bytes + (
            vm_memory_overhead_mib(counting.machine, runtime.config) << 20)
        # 1. Allocate past the guest's memory: the guest's OOM killer ends the hog.
        t0 = time.monotonic()
        out = env.loop.run(sh(hostile, HOG, timeout=240), timeout=300)
        hog_s = time.monotonic() - t0
        assert "hog-exit=" in out and "hog-exit=0" not in out, out
        log = env.loop.run(sh(hostile, "dmesg | grep -ci 'out of memory' || true"))
        assert int(log.strip().splitlines()[-1]) >= 1, "the guest's OOM killer did not run"
        assert alive(hostile.pid) and hostile.state == "running"
        assert env.loop.run(sh(hostile, "echo still-here")).strip() == "still-here"
        peak = runtime.cgroups.memory_peak(hostile.process.cgroup) if hostile.process.cgroup else None
        oom = runtime.cgroups.oom_kills(hostile.process.cgroup) if hostile.process.cgroup else 0
        assert oom == 0, "the host's OOM killer hit QEMU"
        rss = _rss_kib(hostile.pid)
        print(f"\nmemory hog: guest OOM after {hog_s:.1f} s, QEMU RSS {rss / 1024:.0f} MiB, "
              f"cgroup peak {(peak or 0) / 2**20:.0f} MiB of {limit / 2**20:.0f} MiB, "
              f"host OOM kills {oom}")
        if peak is not None:
            assert peak <= limit

        # 2. Fork bomb: the bystander and the host keep answering.
        env.loop.run(sh(hostile, "(f() { f | f & }; f) >/dev/null 2>&1 </dev/null &\necho bombed",
                        timeout=30))
        cpu0, w0 = _cpu_seconds(hostile.pid), time.monotonic()
        latencies = []
        for _ in range(5):
            t = time.monotonic()
            assert env.loop.run(sh(bystander, "echo alive"), timeout=60).strip() == "alive"
            latencies.append(time.monotonic() - t)
            time.sleep(1)
        host_t = time.monotonic()
        sum(range(2_000_000))
        host_s = time.monotonic() - host_t
        cpu_share = (_cpu_seconds(hostile.pid) - cpu0) / (time.monotonic() - w0)
        assert alive(hostile.pid), "QEMU of the fork-bombed VM died"
        assert runtime.cgroups.oom_kills(hostile.process.cgroup) == 0 if hostile.process.cgroup else True
        print(f"fork bomb: bystander answers in {max(latencies):.2f} s max "
              f"(median {sorted(latencies)[2]:.2f} s), hostile QEMU uses {cpu_share:.2f} host "
              f"CPUs (cap 1.0), host loop of 2M adds {host_s:.2f} s")
        if runtime.cgroups.enabled:
            assert cpu_share < 1.25
        assert max(latencies) < 30
    finally:
        env.loop.run(runtime.kill(hostile))
        env.loop.run(runtime.kill(bystander))
