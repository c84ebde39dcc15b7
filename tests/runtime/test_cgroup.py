"""cgroup detection and limits (runtime/cgroup.py). The real hierarchy of this host is used by
test_privilege.py; the cgroup v2 layout is checked on a directory laid out like cgroupfs,
because this host's cgroup2 mount has no controllers to give (a hybrid v1 host)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agentenv.runtime.cgroup import (
    CgroupError,
    CgroupManager,
    IOLimit,
    limits_for,
    remove_cgroup,
)
from agentenv.runtime.config import RuntimeConfig, privilege_settings_from_env
from agentenv.snapshot.record import MachineConfig


def _machine(vcpus: int = 2, memory_mib: int = 512) -> MachineConfig:
    return MachineConfig(vcpus=vcpus, memory_mib=memory_mib, accel="tcg", kernel="/k",
                         cmdline="", disks=[], network=False)


def test_limits_follow_the_machine_and_the_config() -> None:
    config = RuntimeConfig(cpu_max_per_vcpu=0.5, qemu_pids_max=100)
    limits = limits_for(_machine(4, 1024), config, None)
    assert limits.memory_max == (1024 + 64 + 64 + 16) << 20
    assert limits.cpu_weight == 400 and limits.cpu_quota_us == 200_000
    assert limits.pids_max == 100
    assert limits_for(_machine(), RuntimeConfig(cpu_max_per_vcpu=0,
                                                vm_memory_overhead_mib=10), None) \
        .cpu_quota_us is None
    assert limits_for(_machine(), RuntimeConfig(vm_memory_overhead_mib=10), None) \
        .memory_max == 522 << 20
    # Single-threaded TCG: one host thread runs all vCPUs, so one task's weight; the CPU cap
    # stays per vCPU.
    single = limits_for(_machine(4, 1024), config, None, vcpu_threads=1)
    assert single.cpu_weight == 100 and single.cpu_quota_us == 200_000


def test_v2_layout_enables_controllers_and_writes_limits(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    manager = CgroupManager.detect("on", "/aenv.slice", root=root)
    assert manager.version == 2 and manager.parents[""] == root / "aenv.slice"
    assert (root / "cgroup.subtree_control").read_text() == "+memory +cpu +io +pids"
    assert (root / "aenv.slice" / "cgroup.subtree_control").read_text() == \
        "+memory +cpu +io +pids"
    group = manager.create("vm1", limits_for(_machine(), RuntimeConfig(), IOLimit("8:0", 1000)))
    assert group is not None and group.procs_files == [str(root / "aenv.slice/vm1/cgroup.procs")]
    vm = root / "aenv.slice" / "vm1"
    assert (vm / "memory.max").read_text() == str((512 + 136) << 20)
    assert (vm / "cpu.weight").read_text() == "200"
    assert (vm / "cpu.max").read_text() == "200000 100000"
    # The parent keeps the default weight: never the sum of its VMs' weights, which let idle
    # VMs outweigh the node's own processes (module doc of runtime/cgroup.py).
    assert not (root / "aenv.slice" / "cpu.weight").exists()
    # io.max and pids.max only where the kernel offers them (absent in this fake tree).
    assert not (vm / "io.max").exists()
    for name in ("memory.max", "cpu.weight", "cpu.max"):
        (vm / name).unlink()
    assert remove_cgroup(group) and not vm.exists()


def test_v2_without_memory_controller_fails_clearly_or_degrades(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu io pids\n")
    with pytest.raises(CgroupError, match="lacks the memory controller"):
        CgroupManager.detect("on", "aenv.slice", root=tmp_path)
    with caplog.at_level(logging.WARNING):
        manager = CgroupManager.detect("auto", "aenv.slice", root=tmp_path)
    assert not manager.enabled and manager.create("vm", limits_for(
        _machine(), RuntimeConfig(), None)) is None
    assert "VMs run without memory/CPU/IO limits" in caplog.text
    assert not CgroupManager.detect("off", "aenv.slice", root=tmp_path).enabled


def test_settings_from_the_environment() -> None:
    settings = privilege_settings_from_env({"AENV_QEMU_USER": "root", "AENV_QEMU_SANDBOX": "0",
                                            "AENV_CGROUPS": "on", "AENV_IO_READ_BPS": "1000"})
    config = RuntimeConfig(**settings)
    assert config.qemu_user is None and not config.qemu_sandbox
    assert config.cgroups == "on" and config.io_read_bps == 1000
    with pytest.raises(ValueError, match="cgroups"):
        RuntimeConfig(**privilege_settings_from_env({"AENV_CGROUPS": "maybe"}))


def test_default_parent_is_per_runtime_state_dir(tmp_path: Path) -> None:
    """Two runtimes with one prefix (two network namespaces) get different parents, so neither
    overwrites the other's parent cpu weight; one state dir always gets the same."""
    from agentenv.runtime.cgroup import default_parent

    a, b = default_parent("aet", tmp_path / "a"), default_parent("aet", tmp_path / "b")
    assert a != b and a.startswith("aet-") and a.endswith(".slice")
    assert default_parent("aet", tmp_path / "a") == a


def _v1_tree(root: Path, own_memory: str) -> None:
    """A cgroup v1 hybrid layout like this build host's: one directory per controller."""
    for controller in ("memory", "cpu", "pids"):
        (root / controller).mkdir(parents=True)
        (root / controller / "cgroup.procs").write_text("1\n")
    (root / "memory" / own_memory.strip("/")).mkdir(parents=True, exist_ok=True)


def test_v1_cpu_groups_are_flat_beside_the_node(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On a v1 host a VM's cpu group is a peer of the node's processes (`<stem>-<vm>` in the
    node's own cpu cgroup); memory and pids keep `<parent>/<vm>`. Leftovers of this parent are
    removed at start, nothing else in the node's cpu cgroup is touched."""
    import agentenv.runtime.cgroup as cgroup

    own = {"memory": "/svc", "cpu": "/", "pids": "/"}
    monkeypatch.setattr(cgroup, "_own_cgroup", lambda controller: own.get(controller or "", "/"))
    root = tmp_path / "cgroup"
    _v1_tree(root, "/svc")
    # Ours and not ours, both without processes (a plain directory cannot hold cgroup.procs
    # and still be removed by rmdir, as a real cgroup can).
    for leftover in ("aet-1234abcd-crashedvm", "other-runtime-vm"):
        (root / "cpu" / leftover).mkdir()
    monkeypatch.setattr(cgroup, "_has_procs", lambda directory: False)
    manager = CgroupManager.detect("auto", "aet-1234abcd.slice", root=root)
    assert manager.version == 1
    assert manager.parents == {"memory": root / "memory/svc/aet-1234abcd.slice",
                               "cpu": root / "cpu", "pids": root / "pids/aet-1234abcd.slice"}
    assert not (root / "cpu" / "aet-1234abcd-crashedvm").exists()
    assert (root / "cpu" / "other-runtime-vm").exists()
    group = manager.create("vm1", limits_for(_machine(), RuntimeConfig(), None))
    assert group is not None
    cpu_dir = root / "cpu" / "aet-1234abcd-vm1"
    assert group.dirs == [root / "memory/svc/aet-1234abcd.slice/vm1", cpu_dir,
                          root / "pids/aet-1234abcd.slice/vm1"]
    assert (cpu_dir / "cpu.shares").read_text() == "2048"
    assert (cpu_dir / "cpu.cfs_quota_us").read_text() == "200000"
    assert (group.dirs[0] / "memory.limit_in_bytes").read_text() == str((512 + 136) << 20)
    assert not (root / "cpu" / "cpu.shares").exists(), "the node's own cpu group is not touched"
    for directory in group.dirs:
        for f in directory.iterdir():
            f.unlink()
    assert remove_cgroup(group)
    manager.close()
    assert not (root / "memory/svc/aet-1234abcd.slice").exists()
    assert (root / "cpu" / "other-runtime-vm").exists()


def test_auto_takes_v1_on_a_hybrid_host(tmp_path: Path) -> None:
    """An empty cgroup2 at the root (no cgroup.controllers) is skipped for the v1 hierarchies;
    without the v1 memory hierarchy either, auto runs without limits and says why."""
    _v1_tree(tmp_path, "/")
    assert CgroupManager.detect("auto", "/aenv.slice", root=tmp_path).version == 1
    assert CgroupManager.detect("v1", "/aenv.slice", root=tmp_path).version == 1
    (tmp_path / "memory" / "cgroup.procs").unlink()
    with pytest.raises(CgroupError, match="no cgroup v1 memory hierarchy"):
        CgroupManager.detect("on", "/aenv.slice", root=tmp_path)
