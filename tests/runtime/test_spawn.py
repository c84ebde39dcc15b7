"""QemuProcess.spawn when the child fails between fork and exec (no QEMU ever starts)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from agentenv.runtime.errors import VMDiedError
from agentenv.runtime.qemu import SPAWN_TRIES, QemuProcess
from agentenv.snapshot.record import MachineConfig


def test_failure_before_exec_is_retried_then_named(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A namespace that is not there makes the child's os.open raise: the child exits with the
    exception's text in qemu.stderr, spawn tries again, and finally raises an error naming it
    (not subprocess's bare "Exception occurred in preexec_fn")."""
    if os.geteuid() != 0:
        pytest.skip("setns needs root")
    machine = MachineConfig(accel="tcg", kernel="/k", cmdline="")
    missing = tmp_path / "no-such-netns"
    with caplog.at_level(logging.WARNING, logger="agentenv.runtime.qemu"), \
            pytest.raises(VMDiedError) as failure:
        asyncio.run(QemuProcess.spawn(machine, tmp_path / "vm", mem_path=str(tmp_path / "mem"),
                                      disks=[], incoming=True, netns=str(missing)))
    message = str(failure.value)
    assert "failed before exec" in message
    assert f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'" in message
    retries = [r for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retries) == SPAWN_TRIES - 1


def test_tcg_thread_mode_follows_config_and_host_load(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """config.tcg_threads: "auto" runs a VM's vCPUs on one host thread once the vCPUs starting
    together plus the host's load average exceed tcg_vcpus_per_core per host core."""
    from agentenv.runtime.config import RuntimeConfig
    from agentenv.runtime.qemu import build_argv
    from agentenv.runtime.vm import Runtime

    machine = MachineConfig(accel="tcg", kernel="/k", cmdline="")

    def accel(single: bool) -> str:
        argv = build_argv(machine, mem_path="/m", qmp_socket=tmp_path / "q", serial_log=tmp_path / "s",
                          disks=[], vmgenid="0", incoming=True, tcg_single_thread=single)
        return argv[argv.index("-accel") + 1]

    assert accel(False) == "tcg,tb-size=64"
    assert accel(True) == "tcg,tb-size=64,thread=single"
    cores = os.cpu_count() or 1
    load = [0.0]
    monkeypatch.setattr(os, "getloadavg", lambda: (load[0], load[0], load[0]))
    rt = Runtime(RuntimeConfig(state_dir=tmp_path, tcg_vcpus_per_core=1.0))
    assert not rt.tcg_single_thread(cores)
    assert rt.tcg_single_thread(cores + 1)
    with rt.launcher.starting(cores):  # e.g. a fork's other children
        assert not rt.tcg_single_thread()
        assert rt.tcg_single_thread(1)
    assert not rt.tcg_single_thread(1)
    load[0] = cores - 0.5  # a busy host
    assert not rt.tcg_single_thread()
    assert rt.tcg_single_thread(1)
    assert not rt.tcg_single_thread(1, boot=True)  # boots (template builds) keep their threads
    for mode, expected in (("single", True), ("multi", False)):
        fixed = Runtime(RuntimeConfig(state_dir=tmp_path, tcg_threads=mode))
        load[0] = 0.0
        assert fixed.tcg_single_thread() is expected
        load[0] = 10.0 * cores
        assert fixed.tcg_single_thread(10 * cores) is expected
