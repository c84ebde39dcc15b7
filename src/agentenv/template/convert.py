"""Turn one tar layer into one overlaybd layer: stack, loop-mount, apply, seal.

For each layer: blockd makes a writable disk whose lowers are the layers already converted
below it (at the bottom, a shared base layer holding an empty 64 GiB ext4, made once per host
like containerd's converter's `ext4_64` (docs/templates.md §2)) and exposes it as a FUSE file; the file is
loop-mounted, the tar applied onto the mounted ext4, unmounted, and blockd seals the disk's
upper in place (snapshot) into the new layer. Nothing is copied: the sealed layer holds exactly
the blocks this layer's changes wrote.

Where the time goes (bench/template_bench.py): inflating the blob (ISA-L, in a thread beside
the applier), the applier's system calls, and every block ext4 writes passing loop -> FUSE ->
blockd -> upper file. The applier starts writeback of each large file as soon as it is written
(see apply.py), so that last part overlaps the apply instead of piling up at unmount.

blockd is the daemon at the given socket, or (`private_blockd`) one started for the pull.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from agentenv.blockd.client import BlockdClient
from agentenv.blockd.launch import BlockdProcess, BlockdStartFailed
from agentenv.registry.blobtap import BlobTap
from agentenv.registry.errors import PullError
from agentenv.storage.export import import_raw
from agentenv.template.apply import ApplyStats, apply_layer

VIRTUAL_SIZE = 64 << 30  # 64 GiB, as containerd's converter (docs/templates.md §2)
# No discard (it would punch the FUSE file for nothing); inode tables and the journal are left
# unzeroed: the disk is sparse, unwritten blocks read as zeros.
MKFS_ARGS = ("mkfs.ext4", "-F", "-q", "-b", "4096", "-E",
             "lazy_itable_init=1,lazy_journal_init=1,nodiscard")
# The base layer is made reproducible (same bytes on every host): fixed UUID, hash seed, time.
BASE_FS_UUID = "a3e1c0de-0b5e-4e4a-8f00-000000000064"
BASE_MKFS_ARGS = (*MKFS_ARGS[:-1], MKFS_ARGS[-1] + f",hash_seed={BASE_FS_UUID}", "-U", BASE_FS_UUID)
BASE_FAKE_TIME = "1600000000"
BASE_KEY = "sha256:" + hashlib.sha256(f"{BASE_MKFS_ARGS} {VIRTUAL_SIZE}".encode()).hexdigest()
# noinit_itable: no background zeroing of inode tables (it would write GiBs into the layer).
# nodev,nosuid,noexec: a layer is untrusted data on the host, never devices or programs.
MOUNT_OPTIONS = "nodev,nosuid,noexec,noinit_itable,nodiscard"


def _run(args: list[str], what: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(args, capture_output=True, text=True,
                            env={**os.environ, **env} if env else None)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise PullError(f"{what} failed ({' '.join(args[:2])}): {detail[-1] if detail else result.returncode}")
    return result.stdout.strip()


@contextlib.contextmanager
def loop_mount(file: Path, mountpoint: Path, *, readonly: bool = False) -> Iterator[Path]:
    """Attach `file` to a loop device and mount its ext4 at `mountpoint`."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    args = ["losetup", "--find", "--show"] + (["--read-only"] if readonly else []) + [str(file)]
    device = _run(args, "attaching a loop device")
    try:
        # Drop any block cache a previous user of this loop device number left behind.
        subprocess.run(["blockdev", "--flushbufs", device], capture_output=True)
        options = "ro,noload,nodev,nosuid,noexec" if readonly else MOUNT_OPTIONS
        _run(["mount", "-t", "ext4", "-o", options, device, str(mountpoint)], "mounting the layer")
        try:
            yield mountpoint
        finally:
            _unmount(mountpoint)
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True)


def _unmount(mountpoint: Path) -> None:
    for attempt in range(20):
        result = subprocess.run(["umount", str(mountpoint)], capture_output=True, text=True)
        if result.returncode == 0:
            return
        if "not mounted" in result.stderr:
            return
        time.sleep(0.05 * (attempt + 1))  # busy: someone still has a file open there
    raise PullError(f"cannot unmount {mountpoint}: {result.stderr.strip()}")


def private_blockd(work_dir: Path) -> BlockdProcess:
    """A blockd for one pull (when no daemon runs), with its own state and socket under
    `work_dir`; it dies with the puller."""
    return BlockdProcess(work_dir / "blockd", work_dir / "blockd.sock", work_dir / "blockd.log",
                         extra_args=("--log-level", "warning"), die_with_parent=True)


def start_private(blockd: BlockdProcess, timeout: float = 20.0) -> Path:
    """Start a `private_blockd`; its socket once it answers."""
    try:
        blockd.start(timeout)
    except BlockdStartFailed as exc:
        raise PullError(f"private {exc}") from exc
    return blockd.socket


@contextlib.contextmanager
def blockd_socket(socket: Path | None, work_dir: Path) -> Iterator[Path]:
    """The socket of a running blockd: the one given, or a private one started here (never
    the node's: a conversion must not leave devices in, or depend on, another daemon)."""
    if socket is not None:
        yield socket
        return
    private = private_blockd(work_dir)
    try:
        yield start_private(private)
    finally:
        private.stop()


def make_base_layer(work: Path, out: Path) -> Path:
    """The empty ext4 (64 GiB virtual disk) every converted image stacks on, as a layer."""
    raw = work / "base.raw"
    with open(raw, "wb") as f:
        f.truncate(VIRTUAL_SIZE)
    _run([*BASE_MKFS_ARGS, str(raw)], "making the base ext4 filesystem",
         env={"E2FSPROGS_FAKE_TIME": BASE_FAKE_TIME})
    import_raw(raw, out, uuid=BASE_FS_UUID)
    raw.unlink()
    return out


def convert_tar_layer(
    client: BlockdClient,
    lowers: list[Path],
    blob: Path | BlobTap,
    media_type: str,
    diff_id: str,
    work: Path,
    sealed: Path,
    *,
    label: str,
    progress: Callable[[int], None] | None = None,
) -> ApplyStats:
    """Apply the tar `blob` onto the stack `lowers` (the base layer at least) and seal the
    result at `sealed`."""
    if not lowers:
        raise ValueError("a tar layer is applied onto at least the base layer")
    upper = work / "upper"
    marks = [("start", time.perf_counter())]
    # No cap on the upper: the layer's expansion is bounded already (apply.py), and a share of
    # a small state disk would refuse layers that fit.
    device = client.create(lowers=list(lowers), upper_dir=upper, upper_limit=0)
    try:
        if not device.file:
            raise PullError("blockd runs without FUSE files (--no-fuse); conversion needs them "
                            "to loop-mount the layer")
        disk = Path(device.file)
        marks.append(("create", time.perf_counter()))
        with loop_mount(disk, work / "mnt") as root:
            marks.append(("mount", time.perf_counter()))
            stats = apply_layer(root, blob, media_type, diff_id, name=label, progress=progress)
            marks.append(("apply", time.perf_counter()))
        marks.append(("umount", time.perf_counter()))
        fd = os.open(disk, os.O_RDWR)  # push anything the loop device left in the page cache
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        client.snapshot(device.id, sealed)
        marks.append(("seal", time.perf_counter()))
    finally:
        with contextlib.suppress(Exception):
            client.release(device.id)
    marks.append(("release", time.perf_counter()))
    stats.phases = {name: round(t - marks[i][1], 4) for i, (name, t) in enumerate(marks[1:])}
    return stats
