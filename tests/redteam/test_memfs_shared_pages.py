"""A QEMU taken over by its guest writes into the memory file every VM of its snapshot maps.

Every VM restored from one snapshot maps the same memfs file (blockd/memfs.py) MAP_PRIVATE:
its clean pages are the one page cache of that file, shared by all of them (the built-in
`base` template's: every team's sandboxes). QEMU opens it read-write (free-page reporting
needs a writable descriptor); the jail forbids it shared mappings and hole punches
(runtime/qemu.py `qemu_filter`), and memfs refuses every write. But a `pwrite` to a FUSE file
without direct I/O is copied into the cached page first and only then sent to memfs: the
refusal marks the page not up to date, it does not undo the copy, and every process that
already maps that page sees the written bytes (red team of 2026-12-07).

Here the test process maps the file as a restored QEMU does; a process with another VM's uid
and the VM group (what a jailed QEMU is) writes a page. The mapping must still read the
snapshot's bytes.
"""

from __future__ import annotations

import grp
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.blockd import memfs
from agentenv.storage.config import ImageConfig
from tests.blockd.test_memfs_native import PAGE, SIZE, memory_stack

pytestmark = pytest.mark.root

ATTACKER_UID = 200777  # a VM uid of no running VM (AENV_VM_UID_RANGE's default is 200000+)
PAGE_NO = 3
MARKER = b"written by another VM's QEMU!!!!" * (PAGE // 32)


@pytest.fixture
def mount() -> Iterator[Path]:
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"):
        pytest.skip("needs root and FUSE")
    # reachable by another uid (as the jail's bind of the file is), unlike pytest's 0700 dirs
    root = Path(tempfile.mkdtemp(prefix="rt24memfs", dir="/tmp"))
    root.chmod(0o711)
    state = root / "state"
    state.mkdir(mode=0o711)
    (state / "memdev").mkdir(mode=0o700)
    try:
        ImageConfig(state / "memdev" / f"k{memfs.MEMORY_SUFFIX}",
                    memory_stack(root, 11)).save()
        mounted = memfs.ensure_running(state)
        try:
            yield mounted / "k"
        finally:
            memfs.stop(state)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_another_vms_write_does_not_reach_a_mapped_page(mount: Path) -> None:
    try:
        vm_group = grp.getgrnam("aenv-vm").gr_gid
    except KeyError:
        pytest.skip("no aenv-vm group (scripts/install-system.sh)")
    fd = os.open(mount, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, SIZE, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        at = PAGE_NO * PAGE
        snapshot = bytes(mapped[at:at + PAGE])  # faulted in: the page cache's page
        assert snapshot != MARKER
        attack = (f"import os\ntry:\n    fd = os.open({str(mount)!r}, os.O_RDWR)\n"
                  f"    os.pwrite(fd, {MARKER!r}, {at})\n    print('written')\n"
                  f"except OSError as exc:\n    print('refused', exc.errno)\n")
        done = subprocess.run(
            ["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={ATTACKER_UID}",
             f"--groups={vm_group}", sys.executable, "-c", attack],
            capture_output=True, text=True, timeout=60, cwd="/")
        assert done.returncode == 0, done.stderr[-2000:]
        print("the other VM's write:", done.stdout.strip())
        seen = bytes(mapped[at:at + PAGE])
        assert seen == snapshot, (
            "another VM's QEMU changed a page this VM maps: "
            f"{seen[:32]!r} instead of {snapshot[:32]!r} (its write: {done.stdout.strip()})")
    finally:
        mapped.close()
