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
                                      disks=None, incoming=True, netns=str(missing)))
    message = str(failure.value)
    assert "failed before exec" in message
    assert f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'" in message
    retries = [r for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retries) == SPAWN_TRIES - 1
