"""Root in a real guest crashes its own VM: the node keeps nothing of it.

Red team of 2026-12-07: a VM that died (the guest's `echo b > /proc/sysrq-trigger`; QEMU runs
with -no-reboot and exits) had its resources released (slot, uid, blockd device) but its
working directory kept: the serial log, the device state and the writable disk's upper with
everything the guest wrote. Measured: 200 MiB written, the VM crashed, 201 MiB left on the
node's state filesystem until the node restarted. The disk cap bounds one sandbox's upper (25%
of the state filesystem by default), not what its crashed VMs leave: a team that writes up to
its cap and crashes, a few times, takes the state filesystem down to the disk reserve, and every
sandbox of every team then gets ENOSPC and every create a 503.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.node import conftest
from tests.node.conftest import NO_READY_POOLS, NodeProcess

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

NET_PREFIX = "arc"  # unique: a test teardown deletes every {NET_PREFIX}-s* namespace
FIRST_SLOT = 31901  # 31901-31950
WRITTEN_MB = 64


@pytest.fixture(scope="module")
def vm_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("crash")
    node = conftest.vm_node_process(base / "state", base / "node.log", NET_PREFIX, FIRST_SLOT,
                                    dict(NO_READY_POOLS))
    with conftest.serving_vm_node(node, NET_PREFIX):
        yield node


def vm_dirs(node: NodeProcess) -> set[Path]:
    return set((node.state_dir / "vm-backend" / "runtime" / "vms").iterdir())


def bytes_under(path: Path) -> int:
    total = 0
    for entry in path.rglob("*"):
        with contextlib.suppress(OSError):
            if entry.is_file() and not entry.is_symlink():
                total += entry.stat().st_blocks * 512
    return total


def test_a_crashed_vm_leaves_nothing_on_the_nodes_disk(vm_node: NodeProcess) -> None:
    """Root writes 64 MiB and crashes its VM: the sandbox is gone, and so is every byte its
    VM had on the node (its working directory with its disk's upper)."""
    from e2b import Sandbox

    before = vm_dirs(vm_node)
    sbx: Any = Sandbox.create(template="base", timeout=300)
    try:
        sbx.commands.run(f"dd if=/dev/zero of=/root/fill bs=1M count={WRITTEN_MB} conv=fsync"
                         " && sync", user="root", timeout=240)
        mine = vm_dirs(vm_node) - before
        assert len(mine) == 1, mine
        workdir = mine.pop()
        assert bytes_under(workdir) >= WRITTEN_MB << 20
        with contextlib.suppress(Exception):  # the command's stream ends with the VM
            sbx.commands.run("echo b > /proc/sysrq-trigger", user="root", timeout=20)
        deadline = time.monotonic() + 60
        with vm_node.client() as api:
            while api.get(f"/sandboxes/{sbx.sandbox_id}").status_code != 404:
                assert time.monotonic() < deadline, "the crashed sandbox was not removed"
                time.sleep(0.2)
        while workdir.exists():
            left = bytes_under(workdir)
            assert time.monotonic() < deadline, (
                f"the crashed VM's directory {workdir.name} still holds {left >> 20} MiB "
                f"of the node's disk: {sorted(p.name for p in workdir.rglob('*'))}")
            time.sleep(0.2)
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()
