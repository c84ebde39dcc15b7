"""Fixtures for the runtime tests: a real blockd, the busybox test guest, one runtime on one
event loop for the whole module, and a booted VM with an ext4 rootfs served by blockd."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.harness import BlockdProcess, LoopThread, make_ext4_layer
from agentenv.runtime.network import teardown_host
from agentenv.runtime.testguest import TestGuest, build_test_guest
from agentenv.runtime.vm import VM, BootSpec, DiskSource, Runtime

ROOTFS_SIZE = 64 << 20
PREFIX = "aet"


@dataclass
class Env:
    loop: LoopThread
    runtime: Runtime
    guest: TestGuest
    rootfs_layer: Path
    root: Path

    def boot(self, **kwargs: object) -> VM:
        spec = BootSpec(kernel=self.guest.kernel, initramfs=self.guest.initramfs,
                        cmdline=self.guest.cmdline_base,
                        disks=[DiskSource("rootfs", ROOTFS_SIZE, layers=[self.rootfs_layer])],
                        memory_mib=256, **kwargs)  # type: ignore[arg-type]
        return self.loop.run(self.runtime.boot(spec))


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.skip("the runtime tests need root (network namespaces, nftables)")
    if shutil.which("qemu-system-x86_64") is None:
        pytest.fail("qemu-system-x86_64 is missing: run scripts/install-system.sh")
    guest = build_test_guest()
    root = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    blockd = BlockdProcess(root)
    blockd.start()
    loop = LoopThread()
    runtime: Runtime | None = None
    try:
        from agentenv.blockd.client import AsyncBlockdClient

        layer = make_ext4_layer(root / "rootfs.layer", ROOTFS_SIZE)
        config = RuntimeConfig(state_dir=root / "state", network_prefix=PREFIX,
                               envd_init_path="/cgi-bin/init", slot_pool_low=1)
        runtime = Runtime(config, blockd=AsyncBlockdClient(blockd.socket))
        loop.run(runtime.start(kernel_for_probe=guest.kernel))
        yield Env(loop, runtime, guest, layer, root)
    finally:
        if runtime is not None:
            loop.run(runtime.close())
            loop.run(runtime.blockd.close())
        loop.run(teardown_host(PREFIX))
        loop.close()
        blockd.stop()
        shutil.rmtree(root, ignore_errors=True)
