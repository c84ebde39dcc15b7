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
    # The parent weighs what its VMs' vCPUs do (two normal tasks here), not one task.
    assert (root / "aenv.slice" / "cpu.weight").read_text() == "200"
    # io.max and pids.max only where the kernel offers them (absent in this fake tree).
    assert not (vm / "io.max").exists()
    for name in ("memory.max", "cpu.weight", "cpu.max"):
        (vm / name).unlink()
    assert remove_cgroup(group) and not vm.exists()
    assert (root / "aenv.slice" / "cpu.weight").read_text() == "100"


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
