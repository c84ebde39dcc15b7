"""A shared volume's own file system (docs/volumes.md §7.1 "Found", step 4).

ganesha's VFS FSAL does not check that a file handle lies under the exported directory, only
that it is on the export's file system (nfs-ganesha issue #650), and a guest's kernel is the
user's: it can forge handles. So a shared volume is never exported from a directory of the
node's state file system: it gets an ext4 image of its own, loop-mounted, and the export is the
root of that file system; a forged handle reaches nothing but this volume. The image is made
as a volume's sealed layer is (rootfs.make_rootfs_image, the same `fs_bytes` size: the volume's
size plus ext4's own), so a full volume is ENOSPC to the guests and the content API alike.

    <dir>/fs.ext4   the image (sparse)
    <dir>/fs/       where it is mounted (nosuid, nodev, noexec on the host)
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from agentenv.guest.build.rootfs import make_rootfs_image


class SharedFsError(Exception):
    pass


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SharedFsError(f"{' '.join(argv[:3])} failed: {proc.stderr.strip()}")


def _mounted_at(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(len(fields) > 4 and fields[4] == target
                   for fields in (line.split() for line in f))


class SharedFilesystem:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.image = self.directory / "fs.ext4"
        self.mountpoint = self.directory / "fs"

    def exists(self) -> bool:
        return self.image.is_file()

    def create(self, content: Path, size_bytes: int, root: tuple[int, int, int]) -> None:
        """The image: an ext4 of `size_bytes` holding `content`'s files (owners and modes),
        its root directory owned and moded as `root` says. Not mounted."""
        if self.exists():
            raise SharedFsError(f"{self.image} exists already")
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            make_rootfs_image(content, self.image, size_bytes, label="aenv-shared", root=root,
                              inodes=max(size_bytes // 16384, 16384))
            # Its whole size taken from the node's disk now (unwritten extents: quick): guests
            # write it unseen by the node's disk reserve, so what they may write is held up
            # front, where the reserve was checked (Volumes.make_shared).
            fd = os.open(self.image, os.O_WRONLY)
            try:
                os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        except Exception as exc:
            self.image.unlink(missing_ok=True)
            raise SharedFsError(f"making the shared volume's file system: {exc}") from exc

    def mounted(self) -> bool:
        return _mounted_at(self.mountpoint)

    def mount(self) -> Path:
        """Mount the image (once: a mount in place is kept); returns the mountpoint."""
        if not self.exists():
            raise SharedFsError(f"{self.image} is missing")
        if self.mounted():
            return self.mountpoint
        self.mountpoint.mkdir(mode=0o700, exist_ok=True)
        # A journal replay after a crash is fine: the volume is the host's, not a guest's disk.
        _run("mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noexec", str(self.image),
             str(self.mountpoint))
        return self.mountpoint

    def unmount(self, lazy: bool = False) -> None:
        """Unmount (the loop device goes with it: autoclear). Nothing to do when not mounted.
        `lazy`: when the file system is busy (the NFS server may hold files of an export it
        just dropped), it is detached now and goes once the last file is closed."""
        if not self.mounted():
            return
        try:
            _run("umount", str(self.mountpoint))
        except SharedFsError:
            if not lazy:
                raise
            _run("umount", "-l", str(self.mountpoint))

    def remove(self) -> None:
        self.unmount(lazy=True)
        self.image.unlink(missing_ok=True)
        if self.mountpoint.is_dir() and not os.listdir(self.mountpoint):
            self.mountpoint.rmdir()
