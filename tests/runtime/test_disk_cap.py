"""A guest filling its disk past blockd's upper cap (issue 18): on virtio-scsi it gets ENOSPC
(errno checked in the guest), the VM keeps running and answering, its filesystem stays usable
once files are deleted, and blockd logs and counts the refusals. The bus is recorded in the
machine config, so a restore of the VM's snapshot has the same SCSI disk and the same cap.

Why SCSI: virtio-blk has no "no space" status (OK, IOERR, UNSUPP), so QEMU's werror=report
answers IOERR (EIO) whatever the errno; scsi-hd reports ENOSPC as sense DATA PROTECT / SPACE
ALLOCATION FAILED (27/07), which Linux completes as BLK_STS_NOSPC. See docs/running.md §4 (disk cap)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.blockd.launch import BlockdProcess
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.errors import RuntimeError_
from agentenv.runtime.qemu import DiskAttachment, build_argv
from agentenv.runtime.vm import VM, BootSpec, DiskSource, Runtime
from agentenv.snapshot.record import DiskConfig, MachineConfig
from agentenv.testing.guest import build_test_guest
from agentenv.testing.harness import LoopThread, blockd_in, close_runtime, make_ext4_layer, sh

PREFIX = "aec"
DISK = 64 << 20
CAP = 12 << 20
MOUNT = ("n=0; while [ ! -b /dev/sda ] && [ $n -lt 200 ]; do sleep 0.05; n=$((n+1)); done;"
         " grep -q ' /mnt/disk ' /proc/mounts || mount -t ext4 /dev/sda /mnt/disk;"
         " grep ' /mnt/disk ' /proc/mounts")
# busybox dd reports strerror(errno) of the failed write() (O_DIRECT) or fsync(): ENOSPC's text,
# not EIO's ("I/O error"), is what the SCSI bus adds.
ENOSPC_TEXT = os.strerror(28)

Capped = tuple[LoopThread, Runtime, BlockdProcess, VM]


@pytest.fixture(scope="module")
def capped() -> Iterator[Capped]:
    if os.geteuid() != 0:
        pytest.skip("the runtime tests need root (network namespaces, nftables)")
    guest = build_test_guest()
    root = Path(tempfile.mkdtemp(prefix="cap", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as the unprivileged aenv-vm and must reach <root>/state
    blockd = blockd_in(root)
    os.environ["AENV_DISK_UPPER_LIMIT"] = str(CAP)  # the node-wide default, as `make up` sets it
    try:
        blockd.start()
    finally:
        del os.environ["AENV_DISK_UPPER_LIMIT"]
    loop = LoopThread()
    runtime: Runtime | None = None
    try:
        from agentenv.blockd.client import AsyncBlockdClient

        layer = make_ext4_layer(root / "disk.layer", DISK)
        # disk_bus as the node sets it from AENV_DISK_BUS: the writable disk goes on SCSI.
        config = RuntimeConfig(state_dir=root / "state", network_prefix=PREFIX,
                               envd_init_path="/cgi-bin/init", slot_pool_low=1, boot_timeout=300,
                               disk_bus="virtio-scsi")
        runtime = Runtime(config, blockd=AsyncBlockdClient(blockd.socket))
        loop.run(runtime.start(kernel_for_probe=guest.kernel))
        spec = BootSpec(kernel=guest.kernel, initramfs=guest.initramfs, cmdline=guest.cmdline_base,
                        disks=[DiskSource("rootfs", DISK, layers=[layer])], memory_mib=256)
        vm = loop.run(runtime.boot(spec))
        yield loop, runtime, blockd, vm
    finally:
        close_runtime(loop, runtime, PREFIX, blockd)
        shutil.rmtree(root, ignore_errors=True)


def _enospc_count(blockd: BlockdProcess) -> int:
    from agentenv.blockd.client import BlockdClient

    with BlockdClient(blockd.socket) as client:
        devices = client.call("list")
    return sum(d["stats"]["enospc"] for d in devices if d["upper_limit"] == CAP)


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_guest_filling_its_disk_gets_enospc_and_keeps_running(capped: Capped) -> None:
    loop, _runtime, blockd, vm = capped
    assert [d.bus for d in vm.machine.disks] == ["virtio-scsi"]
    assert "aenv.root=/dev/sda" in vm.machine.cmdline
    mounts = loop.run(sh(vm, MOUNT, timeout=120))
    assert "/dev/sda /mnt/disk ext4 rw" in mounts, mounts
    # Rewriting the same file stays under the cap (the upper reuses its blocks).
    out = loop.run(sh(vm, "for i in 1 2 3 4; do dd if=/dev/urandom of=/mnt/disk/log bs=1M "
                          "count=2 conv=notrunc,fsync 2>&1 || echo FAILED; done; echo done",
                      timeout=240))
    assert "FAILED" not in out and "done" in out, out
    # Past the cap: ENOSPC from write() itself (O_DIRECT) and from fsync() (buffered writes).
    out = loop.run(sh(vm, "dd if=/dev/zero of=/mnt/disk/direct bs=1M count=40 oflag=direct 2>&1;"
                          " echo rc=$?; dd if=/dev/zero of=/mnt/disk/big bs=1M count=40 conv=fsync"
                          " 2>&1; echo rc=$?", timeout=300))
    assert out.count(ENOSPC_TEXT) == 2 and "rc=0" not in out, out
    assert "error writing '/mnt/disk/direct'" in out and "dd: /mnt/disk/big:" in out, out
    # Not paused by QEMU (its default for ENOSPC); the filesystem stayed read-write and takes
    # new files once the big ones are deleted.
    status = loop.run(vm.process.qmp.execute("query-status"))
    assert status["status"] == "running", status
    out = loop.run(sh(vm, "rm -f /mnt/disk/direct /mnt/disk/big; sync; echo hello >"
                          " /mnt/disk/after && sync && cat /mnt/disk/after;"
                          " grep ' /mnt/disk ' /proc/mounts", timeout=120))
    assert "hello" in out and "/dev/sda /mnt/disk ext4 rw" in out, out
    assert _enospc_count(blockd) >= 2
    assert "disk full: write refused with ENOSPC" in blockd.log_file.read_text()


def _boot(runtime: Runtime, loop: LoopThread) -> VM:
    """A VM of its own on the capped disk. Not the fixture's VM once the first test filled its
    cap to the last block: ext4's metadata writeback after that (bitmaps, inode tables written
    home ~30 s after their commit, or at a journal checkpoint) is refused too, and jbd2 then
    aborts the journal, so every later open gets EIO (docs/running.md §4). When that happens
    depends on the guest's timers, so a test that reused that VM passed or failed by timing."""
    guest = build_test_guest()
    layer = runtime.config.state_dir.parent / "disk.layer"  # the fixture's
    spec = BootSpec(kernel=guest.kernel, initramfs=guest.initramfs, cmdline=guest.cmdline_base,
                    disks=[DiskSource("rootfs", DISK, layers=[layer])], memory_mib=256)
    vm = loop.run(runtime.boot(spec))
    try:
        loop.run(sh(vm, MOUNT, timeout=120))
    except BaseException:
        loop.run(runtime.kill(vm))
        raise
    return vm


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_restore_keeps_the_scsi_disk_and_its_cap(capped: Capped) -> None:
    loop, runtime, blockd, _vm = capped
    vm = _boot(runtime, loop)
    restored: VM | None = None
    try:
        out = loop.run(sh(vm, "echo hello > /mnt/disk/after && sync && cat /mnt/disk/after",
                          timeout=120))
        assert "hello" in out, out
        record = loop.run(runtime.snapshot(vm))
        assert [d.bus for d in record.machine.disks] == ["virtio-scsi"]
        restored = loop.run(runtime.restore(record))
        before = _enospc_count(blockd)
        # The restored guest has its /dev/sda mounted as it was; its upper starts empty (what
        # it writes after the snapshot), so the cap applies afresh.
        out = loop.run(sh(restored, "cat /mnt/disk/after; dd if=/dev/zero of=/mnt/disk/big"
                                    " bs=1M count=40 oflag=direct 2>&1; echo rc=$?", timeout=300))
        assert "hello" in out and ENOSPC_TEXT in out and "rc=0" not in out, out
        assert _enospc_count(blockd) > before
    finally:
        for machine in (restored, vm):
            if machine is not None:
                loop.run(runtime.kill(machine))


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_pause_and_resume_do_not_renew_the_cap(capped: Capped) -> None:
    """A pause seals the disk's upper and the resume stacks a new one on it: the new upper has
    only what is left of the cap (the sandbox's own sealed upper stays counted), so a guest
    cannot write its cap again after every pause. The guest gets ENOSPC and keeps running."""
    loop, runtime, _blockd, _vm = capped
    vm = _boot(runtime, loop)
    resumed: VM | None = None
    try:
        # Two thirds of the cap, past the page cache: in the upper before the pause.
        out = loop.run(sh(vm, "dd if=/dev/urandom of=/mnt/disk/first bs=1M count=8 oflag=direct"
                              " 2>&1; echo rc=$?; md5sum /mnt/disk/first", timeout=240))
        assert "rc=0" in out, out
        digest = out.split()[-2]
        record = loop.run(runtime.pause(vm, wait_teardown=True))
        (rootfs,) = [d for d in record.disks if d.name == "rootfs"]
        assert rootfs.chain_used > 8 << 20, rootfs
        resumed = loop.run(runtime.restore(record, own_disks=True))
        # Another two thirds: more than the cap in all, so the guest gets ENOSPC part way.
        out = loop.run(sh(resumed, "md5sum /mnt/disk/first; dd if=/dev/zero of=/mnt/disk/second"
                                   " bs=1M count=8 oflag=direct 2>&1; echo rc=$?", timeout=300))
        assert digest in out and ENOSPC_TEXT in out and "rc=0" not in out, out
        status = loop.run(resumed.process.qmp.execute("query-status"))
        assert status["status"] == "running", status
        out = loop.run(sh(resumed, "rm -f /mnt/disk/second; echo alive", timeout=120))
        assert "alive" in out, out
    finally:
        for machine in (resumed, vm):
            if machine is not None and machine.state != "paused":
                loop.run(runtime.kill(machine))


def test_disk_bus_on_the_command_line_and_in_old_records(tmp_path: Path) -> None:
    common = {"mem_path": str(tmp_path / "mem"), "qmp_socket": tmp_path / "qmp",
              "serial_log": tmp_path / "serial", "vmgenid": "0", "incoming": True}
    nbd = {"nbd_socket": "/run/x.sock", "nbd_export": "x"}
    machine = MachineConfig(accel="tcg", kernel="/k", cmdline="", disks=[
        DiskConfig(name="tools", size=1 << 20, read_only=True),
        DiskConfig(name="rootfs", size=1 << 20, bus="virtio-scsi")])
    argv = build_argv(machine, disks=[DiskAttachment("tools", True, file="/t"),
                                      DiskAttachment("rootfs", False, **nbd)], **common)
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]
    assert "virtio-blk-pci,id=dev-tools,drive=tools,addr=0x10,werror=report,rerror=report" in devices
    assert "virtio-scsi-pci,id=scsi0,addr=0xa" in devices
    assert any(d.startswith("scsi-hd,id=dev-rootfs,drive=rootfs,bus=scsi0.0,")
               and "werror=report" in d for d in devices), devices
    two = machine.model_copy(update={"disks": [
        DiskConfig(name="a", size=1 << 20, bus="virtio-scsi"),
        DiskConfig(name="b", size=1 << 20, bus="virtio-scsi")]})
    with pytest.raises(RuntimeError_, match="at most one disk can be on virtio-scsi"):
        build_argv(two, disks=[DiskAttachment("a", False, **nbd), DiskAttachment("b", False, **nbd)],
                   **common)
    # A record written before the field restores on virtio-blk, as it was taken.
    old = {"accel": "tcg", "kernel": "/k", "cmdline": "", "disks": [{"name": "rootfs", "size": 1}]}
    assert MachineConfig.model_validate(old).disks[0].bus == "virtio-blk"
    with pytest.raises(ValueError, match="bus"):
        DiskConfig.model_validate({"name": "rootfs", "size": 1, "bus": "ide"})
