"""blockd killed (SIGKILL) under running VMs that write with fsync: after it is started again,
every VM goes on without an I/O error and every write acknowledged after fsync is on disk."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.blockd.launch import BlockdProcess
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.vm import VM, BootSpec, DiskSource, Runtime
from agentenv.testing.guest import build_test_guest
from agentenv.testing.harness import LoopThread, blockd_in, close_runtime, make_ext4_layer, sh

pytestmark = [pytest.mark.qemu, pytest.mark.root]

PREFIX = "aebr"  # its own slots and nft table: the module kills its own blockd
ROOTFS_SIZE = 64 << 20

# Numbered records appended to a file on the blockd disk, each made durable with fdatasync
# (busybox `sync -d FILE` reports the error, unlike a bare sync); /tmp/acked holds the last
# number whose fsync succeeded (renamed into place: a reader never sees it empty), /tmp/err the
# first failure.
WRITER = (
    # The test guest mounts only a second disk; this VM's one blockd disk is vda.
    "grep -q ' /mnt/disk ' /proc/mounts || mount -t ext4 /dev/vda /mnt/disk || echo mount-failed\n"
    "(i=0; while [ ! -e /tmp/stop ]; do i=$((i+1));"
    " echo rec-$i >> /mnt/disk/records || { echo write-$i > /tmp/err; break; };"
    " sync -d /mnt/disk/records || { echo fsync-$i > /tmp/err; break; };"
    " echo $i > /tmp/acked.new; mv /tmp/acked.new /tmp/acked; done) >/dev/null 2>&1 &\n"
    # Direct reads of the whole disk keep NBD requests in flight nearly all the time, so the
    # kill catches some: those are the ones QEMU must resend (without reconnect-delay they fail).
    "(while [ ! -e /tmp/stop ]; do dd if=/dev/vda of=/dev/null bs=1M iflag=direct 2>/tmp/dd.out"
    " || { echo read > /tmp/err; break; }; done) >/dev/null 2>&1 &\n"
    "echo started\n"
)


def acked(loop: LoopThread, vm: VM) -> int:
    out = loop.run(sh(vm, "cat /tmp/acked 2>/dev/null || echo 0")).strip()
    return int(out)


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[LoopThread, Runtime, BlockdProcess, list[VM]]]:
    if os.geteuid() != 0:
        pytest.skip("the runtime tests need root (network namespaces, nftables)")
    guest = build_test_guest()
    root = Path(tempfile.mkdtemp(prefix="brt", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as the unprivileged aenv-vm and must reach <root>/state
    blockd = blockd_in(root)
    blockd.start()
    loop = LoopThread()
    runtime: Runtime | None = None
    vms: list[VM] = []
    try:
        from agentenv.blockd.client import AsyncBlockdClient

        layer = make_ext4_layer(root / "rootfs.layer", ROOTFS_SIZE)
        config = RuntimeConfig(state_dir=root / "state", network_prefix=PREFIX,
                               envd_init_path="/cgi-bin/init", slot_pool_low=1,
                               boot_timeout=300)
        runtime = Runtime(config, blockd=AsyncBlockdClient(blockd.socket))
        loop.run(runtime.start(kernel_for_probe=guest.kernel))
        for _ in range(3):
            spec = BootSpec(kernel=guest.kernel, initramfs=guest.initramfs,
                            cmdline=guest.cmdline_base, memory_mib=192,
                            disks=[DiskSource("rootfs", ROOTFS_SIZE, layers=[layer])])
            vms.append(loop.run(runtime.boot(spec)))
        yield loop, runtime, blockd, vms
    finally:
        if runtime is not None:
            for vm in vms:
                loop.run(runtime.kill(vm))
        close_runtime(loop, runtime, PREFIX, blockd)
        shutil.rmtree(root, ignore_errors=True)


def _wait_acked(loop: LoopThread, vms: list[VM], above: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        now = [acked(loop, vm) for vm in vms]
        if all(n > a for n, a in zip(now, above, strict=True)):
            return now
        assert time.monotonic() < deadline, f"writers stuck: acked {now}, wanted above {above}"
        time.sleep(0.2)


def test_blockd_killed_under_writing_vms(
    setup: tuple[LoopThread, Runtime, BlockdProcess, list[VM]],
) -> None:
    loop, runtime, blockd, vms = setup
    for vm in vms:
        out = loop.run(sh(vm, WRITER))
        assert "started" in out and "mount-failed" not in out, out
    _wait_acked(loop, vms, [10, 10, 10], timeout=120)
    devices_before = {d.id for d in loop.run(runtime.blockd.list())}

    assert blockd.proc is not None
    os.kill(blockd.proc.pid, signal.SIGKILL)
    blockd.proc.wait(10)
    killed_at = time.monotonic()
    # While blockd is gone the writers stall in fsync; nothing fails.
    time.sleep(1.0)
    at_kill = [acked(loop, vm) for vm in vms]
    blockd.start()  # same state directory and socket: the devices come back from records
    restarted = time.monotonic() - killed_at
    devices_after = {d.id for d in loop.run(runtime.blockd.list())}
    assert devices_before <= devices_after
    after = _wait_acked(loop, vms, at_kill, timeout=120)
    resumed = time.monotonic() - killed_at
    print(f"blockd down {restarted:.2f} s; every writer acknowledged again {resumed:.2f} s after"
          f" the kill; acked at kill {at_kill}, later {after}")

    for vm in vms:
        loop.run(sh(vm, "touch /tmp/stop"))
    time.sleep(1.0)
    for vm in vms:
        out = loop.run(sh(vm, "cat /tmp/err 2>/dev/null; dmesg | grep -iE 'I/O error|EXT4-fs error'"
                              " ; echo end"))
        if out.strip() != "end":
            detail = loop.run(sh(vm, "cat /tmp/dd.out; dmesg | tail -n 15"))
            raise AssertionError(f"VM {vm.id} saw an error: {out}\n{detail}")
        last = acked(loop, vm)
        # Every acknowledged record read back from the disk (not the guest's page cache).
        records = loop.run(sh(vm, "echo 3 > /proc/sys/vm/drop_caches; cat /mnt/disk/records"))
        numbers = [int(line.removeprefix("rec-")) for line in records.split()]
        assert numbers[:last] == list(range(1, last + 1)), f"VM {vm.id}: records lost"
