"""Fixtures for the runtime tests: a real blockd, the busybox test guest, one runtime on one
event loop for the whole module, and a booted VM with an ext4 rootfs served by blockd."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentenv.blockd.launch import BlockdProcess
from agentenv.runtime.config import RuntimeConfig, privilege_settings_from_env
from agentenv.runtime.vm import VM, BootSpec, DiskSource, Runtime
from agentenv.snapshot.record import SnapshotRecord
from agentenv.testing.guest import TestGuest, build_test_guest
from agentenv.testing.harness import (
    LoopThread,
    alive,
    blockd_in,
    close_runtime,
    make_ext4_layer,
    sh,
)

ROOTFS_SIZE = 64 << 20
PREFIX = "aet"


@dataclass
class Env:
    loop: LoopThread
    runtime: Runtime
    guest: TestGuest
    rootfs_layer: Path
    root: Path
    blockd: BlockdProcess | None = None

    def boot(self, **kwargs: object) -> VM:
        """A VM whose /mnt/disk is its one disk (vda, the ext4 rootfs layer served by blockd):
        what the tests write there goes through blockd into the disk's upper and snapshots."""
        spec = BootSpec(kernel=self.guest.kernel, initramfs=self.guest.initramfs,
                        cmdline=self.guest.cmdline_base,
                        disks=[DiskSource("rootfs", ROOTFS_SIZE, layers=[self.rootfs_layer])],
                        memory_mib=256, **kwargs)  # type: ignore[arg-type]
        vm = self.loop.run(self.runtime.boot(spec))
        # The test guest mounts only a second disk (vdb) by itself; without this, /mnt/disk
        # would be the initramfs (RAM).
        mounts = self.loop.run(sh(vm, "mount -t ext4 /dev/vda /mnt/disk; grep ' /mnt/disk ' /proc/mounts",
                                  timeout=120))
        assert mounts.startswith("/dev/vda /mnt/disk ext4"), mounts
        return vm


@pytest.fixture(scope="session")
def env() -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.skip("the runtime tests need root (network namespaces, nftables)")
    if shutil.which("qemu-system-x86_64") is None:
        pytest.fail("qemu-system-x86_64 is missing: run scripts/install-system.sh")
    guest = build_test_guest()
    root = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as the unprivileged aenv-vm and must reach <root>/state
    blockd = blockd_in(root)
    blockd.start()
    loop = LoopThread()
    runtime: Runtime | None = None
    try:
        from agentenv.blockd.client import AsyncBlockdClient

        layer = make_ext4_layer(root / "rootfs.layer", ROOTFS_SIZE)
        config = RuntimeConfig(state_dir=root / "state", network_prefix=PREFIX,
                               envd_init_path="/cgi-bin/init", slot_pool_low=1,
                               boot_timeout=300,
                               # AENV_QEMU_USER=root, AENV_CGROUPS=off...: the same tests
                               # without the hardening, for comparison.
                               **privilege_settings_from_env(os.environ))
        runtime = Runtime(config, blockd=AsyncBlockdClient(blockd.socket))
        loop.run(runtime.start(kernel_for_probe=guest.kernel))
        yield Env(loop, runtime, guest, layer, root, blockd)
    finally:
        close_runtime(loop, runtime, PREFIX, blockd)
        shutil.rmtree(root, ignore_errors=True)


COUNTER = (
    "mkdir -p /mnt/disk/data\n"
    "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count;"
    " sleep 0.1; done) >/dev/null 2>&1 &\n"
    "echo persistent-$((6*7)) > /mnt/disk/data/file; sync\n"
    "echo started\n"
)


def count(env: Env, vm) -> int:  # type: ignore[no-untyped-def]
    return int(env.loop.run(sh(vm, "cat /tmp/count")).strip())


@pytest.fixture(scope="session")
def counting(env: Env) -> SnapshotRecord:
    """A booted guest with the counter running, paused: the snapshot all tests start from."""
    vm = env.boot()
    assert "started" in env.loop.run(sh(vm, COUNTER))
    time.sleep(0.6)
    assert count(env, vm) >= 3
    record = env.loop.run(env.runtime.pause(vm, wait_teardown=True))
    assert not alive(vm.pid)
    assert vm.state == "paused"
    return record


@pytest.fixture(scope="session")
def idle(env: Env) -> SnapshotRecord:
    """A booted guest without the counter, paused (for network tests)."""
    vm = env.boot()
    return env.loop.run(env.runtime.pause(vm))
