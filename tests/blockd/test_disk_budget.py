"""The node's disk budget (storage/budget.py): however many disks write, blockd never takes the
uppers' filesystem below AENV_DISK_RESERVE. Proved on a small tmpfs of our own holding blockd's
state and uppers, with QEMU's NBD client (qemu-io) writing through the devices: a write that
would cut into the reserve gets ENOSPC (not EIO), the devices keep serving, and the room a
released disk gave back is usable again. Both data paths (native core, Python)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Daemon, MiB, nbd_uri, run

FS_SIZE = 192 * MiB
RESERVE = 64 * MiB
ENOSPC_TEXT = os.strerror(28)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _qemu_io(uri: str, *commands: str) -> str:
    args = ["qemu-io", "-f", "raw"]
    for command in commands:
        args += ["-c", command]
    done = subprocess.run([*args, uri], capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


@pytest.fixture
def small_fs(short_tmp: Path) -> Iterator[Path]:
    """A 192 MiB tmpfs of the test's own: blockd's state directory and every upper live on it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    root = short_tmp / "fs"
    root.mkdir()
    run(["mount", "-t", "tmpfs", "-o", f"size={FS_SIZE},mode=0711", "tmpfs", str(root)])
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "python"])
def test_disks_never_take_the_filesystem_below_the_reserve(small_fs: Path, native: str) -> None:
    daemon = Daemon(small_fs, fuse=False)
    # As the node starts it: the reserve from the environment, no per-disk cap (the budget
    # alone stands between the guests and the host's filesystem).
    env = {"AENV_DISK_RESERVE": str(RESERVE), "AENV_DISK_UPPER_LIMIT": "0",
           "AENV_BLOCKD_NATIVE": native}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        daemon.start()
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    try:
        with daemon.client() as client:
            a = client.create_blank(512 * MiB)
            b = client.create_blank(512 * MiB)
        assert a.upper_limit is None and b.upper_limit is None
        assert _free(small_fs) > RESERVE + 96 * MiB  # the room the two disks share
        # The first disk takes 64 MiB: well within the room.
        run(["qemu-io", "-f", "raw", "-c", "write -P 0xa1 0 64M", "-c", "flush", nbd_uri(a)])
        # The second asks for more than is left above the reserve: it gets what fits, then
        # ENOSPC (QEMU's client reports the NBD error as it is, not as an I/O error).
        out = _qemu_io(nbd_uri(b), "write -P 0xb2 0 128M")
        assert ENOSPC_TEXT in out and "Input/output error" not in out, out
        assert _free(small_fs) >= RESERVE, (_free(small_fs), RESERVE)
        # Several more tries, from both disks: the reserve holds.
        for uri, at in ((nbd_uri(a), "128M"), (nbd_uri(b), "256M"), (nbd_uri(a), "300M")):
            out = _qemu_io(uri, f"write -P 0xc3 {at} 32M")
            assert ENOSPC_TEXT in out, out
            assert _free(small_fs) >= RESERVE
        # Both disks keep serving: reads, and rewrites of blocks a disk holds (no growth).
        run(["qemu-io", "-f", "raw", "-c", "read -P 0xa1 0 64M", "-c", "write -P 0xa3 0 1M",
             "-c", "read -P 0xa3 0 1M", "-c", "flush", nbd_uri(a)])
        with daemon.client() as client:
            refused = {d.id: d.stats["enospc"] for d in client.list()}
            assert refused[a.id] >= 2 and refused[b.id] >= 2, refused
            # A released disk's room comes back to the others.
            client.release(b.id)
        run(["qemu-io", "-f", "raw", "-c", "write -P 0xa4 64M 32M", "-c", "flush",
             "-c", "read -P 0xa4 64M 32M", "-c", "read -P 0xa1 1M 63M", nbd_uri(a)])
        assert _free(small_fs) >= RESERVE
    finally:
        daemon.stop()
    assert "disk full: write refused with ENOSPC" in daemon.log_file.read_text()
