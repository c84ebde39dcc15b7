"""Free-page reporting returns a guest's freed memory to the host without touching the memory
file its siblings share (runtime/qemu.py: RAM file opened writable, punch-hole filtered out by
seccomp, QEMU's madvise(DONTNEED) drops the private copies).

The QEMU tests run their own runtime (network prefix "afr", slots from 28001) so they can run
beside the other runtime tests, and use no disks (nothing here needs one)."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.errors import RuntimeError_
from agentenv.runtime.memory import PAGE, written_pages
from agentenv.runtime.qemu import (
    DiskAttachment,
    FileStamp,
    _preexec,
    build_argv,
    qemu_filter,
)
from agentenv.runtime.vm import VM, BootSpec, Runtime
from agentenv.snapshot.record import DiskConfig, MachineConfig, SnapshotRecord
from agentenv.testing.guest import TestGuest as Guest
from agentenv.testing.guest import build_test_guest
from agentenv.testing.harness import LoopThread, close_runtime, pss_kib, sh

PREFIX = "afr"
SLOT_FIRST_INDEX = 28001
MEMORY_MIB = 384
FILL_MIB = 160
MiB = 1 << 20

# A counter in tmpfs (guest memory only) and a 1 MiB file of known content in tmpfs.
SETUP = (
    "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count;"
    " sleep 0.1; done) >/dev/null 2>&1 &\n"
    "yes marker-0123456789 | head -c 1048576 > /tmp/marker\n"
    "sha256sum /tmp/marker\n"
)
# The guest writes every page (zeros from /dev/zero: a written zero page costs the host a
# private page like any other).
FILL = ("mount -o remount,size=300M /tmp;"
        f" dd if=/dev/zero of=/tmp/fill bs=1M count={FILL_MIB} 2>/dev/null; echo filled")


@dataclass
class Afr:
    loop: LoopThread
    runtime: Runtime
    guest: Guest


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * MiB):
            digest.update(chunk)
    return digest.hexdigest()


def _sha(text: str) -> str:
    match = re.search(r"\b([0-9a-f]{64})\b", text)
    assert match, f"no sha256 in {text!r}"
    return match.group(1)


def _count(afr: Afr, vm: VM) -> int:
    return int(afr.loop.run(sh(vm, "cat /tmp/count")).strip())


# -- no QEMU -------------------------------------------------------------------------------


def test_filter_turns_punch_hole_into_a_no_op(tmp_path: Path) -> None:
    """fallocate --punch-hole under the filter succeeds and changes nothing; a plain
    (allocating) fallocate is refused (a QEMU may not reserve the host's disk); without the
    filter the same punch zeroes the range."""
    data = tmp_path / "data"
    data.write_bytes(os.urandom(MiB))
    before, stamp = _sha256_file(data), FileStamp.of(data)
    filtered = subprocess.run(
        ["fallocate", "--punch-hole", "--keep-size", "-o", "0", "-l", "65536", str(data)],
        preexec_fn=_preexec(None, die_with_parent=False, seccomp=qemu_filter()),
        capture_output=True, text=True)
    assert filtered.returncode == 0, filtered.stderr
    assert _sha256_file(data) == before and FileStamp.of(data) == stamp
    grown = subprocess.run(["fallocate", "-o", str(MiB), "-l", "4096", str(data)],
                           preexec_fn=_preexec(None, die_with_parent=False,
                                               seccomp=qemu_filter()))
    assert grown.returncode != 0 and data.stat().st_size == MiB
    subprocess.run(["fallocate", "--punch-hole", "-o", "0", "-l", "65536", str(data)], check=True)
    assert data.read_bytes()[:65536] == bytes(65536)


def test_command_line_opens_the_ram_file_writable_only_with_the_filter(tmp_path: Path) -> None:
    machine = MachineConfig(accel="tcg", kernel="/k", cmdline="",
                            disks=[DiskConfig(name="scratch", size=MiB)])
    common = {"mem_path": str(tmp_path / "mem"), "qmp_socket": tmp_path / "qmp",
              "serial_log": tmp_path / "serial", "vmgenid": "0", "incoming": True}
    read_only = [DiskAttachment("scratch", read_only=True, file=str(tmp_path / "disk"))]
    ram = [a for a in build_argv(machine, disks=read_only, **common)
           if a.startswith("memory-backend")]
    assert "readonly=off" in ram[0] and "share=off" in ram[0]
    ram = [a for a in build_argv(machine, disks=read_only, return_free_memory=False, **common)
           if a.startswith("memory-backend")]
    assert "readonly=on" in ram[0]
    # A writable file disk would have QEMU trust punch-hole for its write-zeroes.
    writable_file = [DiskAttachment("scratch", read_only=False, file=str(tmp_path / "disk"))]
    with pytest.raises(RuntimeError_, match="writable file disk"):
        build_argv(machine, disks=writable_file, **common)
    build_argv(machine, disks=writable_file, return_free_memory=False, **common)


def test_dropped_private_pages_count_as_unwritten(tmp_path: Path) -> None:
    """What the capture sees after QEMU's madvise(DONTNEED) on a private file mapping: the
    dropped pages are neither present-anonymous nor swapped (so not captured: a restore takes
    them from the lower layers), and they read back the file's content."""
    npages = 64
    backing = tmp_path / "mem"
    content = os.urandom(npages * PAGE)
    backing.write_bytes(content)
    with open(backing, "rb") as f:
        ram = mmap.mmap(f.fileno(), npages * PAGE, flags=mmap.MAP_PRIVATE,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(ram))
        for page in range(0, npages, 2):  # the "guest" writes every even page
            ram[page * PAGE : page * PAGE + 8] = b"written!"
        assert written_pages(os.getpid(), addr, npages * PAGE).tolist() == list(range(0, npages, 2))
        ram.madvise(mmap.MADV_DONTNEED, 16 * PAGE, 16 * PAGE)  # "reported free": pages 16..31
        expected = [p for p in range(0, npages, 2) if not 16 <= p < 32]
        assert written_pages(os.getpid(), addr, npages * PAGE).tolist() == expected
        assert ram[16 * PAGE : 32 * PAGE] == content[16 * PAGE : 32 * PAGE]
        assert ram[0:8] == b"written!"
    finally:
        ram.close()


# -- QEMU ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def afr() -> Iterator[Afr]:
    if os.geteuid() != 0:
        pytest.skip("the runtime tests need root (network namespaces, nftables)")
    if shutil.which("qemu-system-x86_64") is None:
        pytest.fail("qemu-system-x86_64 is missing: run scripts/install-system.sh")
    guest = build_test_guest()
    root = Path(tempfile.mkdtemp(prefix="afr", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as aenv-vm: it must reach the state dir
    loop = LoopThread()
    runtime: Runtime | None = None
    try:
        config = RuntimeConfig(state_dir=root / "state", network_prefix=PREFIX,
                               slot_first_index=SLOT_FIRST_INDEX, envd_init_path="/cgi-bin/init",
                               slot_pool_low=1, boot_timeout=300)
        runtime = Runtime(config)
        loop.run(runtime.start(kernel_for_probe=guest.kernel))
        yield Afr(loop, runtime, guest)
    finally:
        close_runtime(loop, runtime, PREFIX)
        shutil.rmtree(root, ignore_errors=True)


def _guest_ram_sha256(vm: VM) -> str:
    """Hash of guest RAM as QEMU's mapping shows it (what the guest reads), through
    /proc/PID/mem: reading a not-present page maps the file's page, it does not write it."""
    from agentenv.runtime.memory import find_ram_mapping

    size = vm.machine.memory_bytes
    addr = find_ram_mapping(vm.pid, str(vm.mem_path), size)
    digest = hashlib.sha256()
    fd = os.open(f"/proc/{vm.pid}/mem", os.O_RDONLY)
    try:
        for offset in range(0, size, 16 * MiB):
            digest.update(os.pread(fd, 16 * MiB, addr + offset))
    finally:
        os.close(fd)
    return digest.hexdigest()


# The balloon's negotiated virtio feature bits, as the guest's sysfs shows them (one '0'/'1'
# per bit): bit 4 PAGE_POISON, bit 5 REPORTING.
BALLOON_FEATURES = ("for d in /sys/bus/virtio/devices/*; do"
                    " [ \"$(cat $d/device)\" = 0x0005 ] && cat $d/features; done")


def _balloon_features(afr: Afr, vm: VM) -> str:
    bits = afr.loop.run(sh(vm, BALLOON_FEATURES)).strip()
    assert re.fullmatch(r"[01]{32,}", bits), bits
    return bits


def _no_discard_errors(vm: VM) -> None:
    """QEMU warns once that discarding a private file mapping may modify the file (the filter
    prevents exactly that); any refusal or failure would be an error line."""
    log = vm.process.stderr_log.read_text(errors="replace")
    assert "not supported" not in log and "Failed to" not in log, log[-2000:]


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_free_page_reporting_returns_memory_and_keeps_the_shared_file(afr: Afr) -> None:
    rt, run = afr.runtime, afr.loop.run
    vm = run(rt.boot(BootSpec(kernel=afr.guest.kernel, initramfs=afr.guest.initramfs,
                              cmdline=afr.guest.cmdline_base, memory_mib=MEMORY_MIB)))
    marker_sha = _sha(run(sh(vm, SETUP)))
    assert _balloon_features(afr, vm)[5] == "1", "the guest did not negotiate free-page reporting"
    time.sleep(0.5)
    base: SnapshotRecord = run(rt.pause(vm, wait_teardown=True))
    # The boot's RAM file (the empty sparse file every cold boot of this size maps) is as it
    # was when QEMU started.
    assert vm.process.mem_stamp is not None and vm.process.mem_file_changed() is None
    assert Path(vm.mem_path).stat().st_blocks == 0

    # Two siblings restored from one memory file.
    first = run(rt.restore(base))
    sibling = run(rt.restore(base))
    assert first.mem_path == sibling.mem_path
    mem_file = first.mem_path
    mem_sha, mem_stamp = _sha256_file(mem_file), FileStamp.of(mem_file)
    count_sibling = _count(afr, sibling)

    assert "filled" in run(sh(first, FILL, timeout=300))
    full = pss_kib(first.pid)["Rss"] * 1024
    run(sh(first, "rm /tmp/fill; echo ok"))
    t0 = time.monotonic()
    target = full - 0.75 * FILL_MIB * MiB
    while (rss := pss_kib(first.pid)["Rss"] * 1024) > target:
        assert time.monotonic() - t0 < 30, (
            f"RSS {rss / MiB:.0f} MiB, was {full / MiB:.0f} MiB with {FILL_MIB} MiB filled: "
            f"freed memory not returned ({first.process.stderr_log.read_text()[-600:]})")
        time.sleep(0.25)
    returned_after = time.monotonic() - t0
    print(f"RSS {full / MiB:.0f} -> {rss / MiB:.0f} MiB in {returned_after:.1f} s")
    _no_discard_errors(first)

    # The shared file is byte for byte what it was, and the sibling runs on with its memory.
    assert FileStamp.of(mem_file) == mem_stamp
    assert first.process.mem_file_changed() is None
    assert _sha(run(sh(sibling, "sha256sum /tmp/marker"))) == marker_sha
    time.sleep(0.3)
    assert _count(afr, sibling) > count_sibling
    assert "ok" in run(sh(sibling, "echo ok"))

    # Capture after reporting: the snapshot holds exactly what the guest sees. The VM is
    # stopped (not ended) so its RAM can be read as the guest sees it and compared with the
    # snapshot's materialised memory.
    after_sha = _sha(run(sh(first, "yes after-free | head -c 4194304 > /tmp/after;"
                                    " sha256sum /tmp/after")))
    count_first = _count(afr, first)
    record = run(rt.snapshot(first, keep_running=False))
    seen = _guest_ram_sha256(first)
    restored_file = rt.memory.acquire(record.id, [Path(x.path) for x in record.memory_layers],
                                      record.machine.memory_bytes)
    try:
        assert _sha256_file(restored_file) == seen
    finally:
        rt.memory.release(record.id)
    run(rt.kill(first))

    again = run(rt.restore(record))
    assert _count(afr, again) >= count_first
    assert _sha(run(sh(again, "sha256sum /tmp/marker"))) == marker_sha
    assert _sha(run(sh(again, "sha256sum /tmp/after"))) == after_sha
    assert "gone" in run(sh(again, "[ -e /tmp/fill ] || echo gone"))
    time.sleep(0.3)
    assert _count(afr, again) > count_first
    _no_discard_errors(again)
    assert _sha256_file(mem_file) == mem_sha
    for v in (again, sibling):
        run(rt.kill(v))


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_guest_relying_on_zeroed_free_pages_does_not_report(afr: Afr) -> None:
    """A guest zeroing pages on free (init_on_free=1) skips zeroing on allocation, so a page it
    reported must read back as zeros; ours read back the snapshot's content. The balloon
    offers no PAGE_POISON, so such a guest turns reporting off (Linux virtballoon_validate)."""
    rt, run = afr.runtime, afr.loop.run
    vm = run(rt.boot(BootSpec(kernel=afr.guest.kernel, initramfs=afr.guest.initramfs,
                              cmdline=afr.guest.cmdline_base + " init_on_free=1",
                              memory_mib=128)))
    try:
        assert "heap free:on" in run(sh(vm, "dmesg | grep 'mem auto-init'"))
        bits = _balloon_features(afr, vm)
        assert bits[4] == "0" and bits[5] == "0", bits
    finally:
        run(rt.kill(vm))
