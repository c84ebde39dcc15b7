"""User root disks: ext4 images made without mounting (mkfs.ext4 -d), and the test roots: a
busybox-only one and a Debian one from debootstrap (cached as a tarball keyed by package list)."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from pathlib import Path

from agentenv.guest.build import apt
from agentenv.guest.build.errors import GuestBuildError
from agentenv.guest.build.tools import tree_size

MiB = 1 << 20
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEFAULT_DEBIAN_CACHE = Path("/var/cache/aenv-test/guest")
# What the node server's `base` template has on top of minbase: what E2B's base image gives a
# user (python as python3, pip, sudo, git, curl and the usual command-line tools), kept small.
BASE_PACKAGES = (
    "python3", "python3-pip", "python3-venv", "python-is-python3", "sudo", "git", "curl",
    "wget", "ca-certificates", "procps", "iproute2", "jq", "unzip", "zip", "less", "vim-tiny",
    "openssh-client", "file",
)


def image_size_for(src_dir: Path, *, free: int = 64 * MiB) -> int:
    """A size (bytes, MiB-aligned) that holds the tree with ext4 overhead plus `free` spare."""
    used, inodes = tree_size(src_dir)
    raw = used * 1.1 + inodes * 256 + free + 16 * MiB
    return math.ceil(raw / MiB) * MiB


def make_rootfs_image(src_dir: Path, out: Path, size: int | None = None, *, label: str = "aenv-root",
                      read_only: bool = False, inodes: int | None = None,
                      root: tuple[int, int, int] = (0, 0, 0o755)) -> Path:
    """Makes an ext4 image of `size` bytes (default: fits the tree with 64 MiB spare) holding
    src_dir's contents, owners and modes, without mounting anything. read_only drops the journal
    (for disks no VM ever writes, like the tools disk). `root`: the root directory's uid, gid
    and mode (mkfs -d does not take them from src_dir)."""
    if not src_dir.is_dir():
        raise GuestBuildError(f"root source {src_dir} is not a directory")
    if size is None:
        size = image_size_for(src_dir)
    used, count = tree_size(src_dir)
    if size < used:
        raise GuestBuildError(f"image size {size} bytes cannot hold {src_dir} ({used} bytes of files)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.unlink(missing_ok=True)
    with tmp.open("wb") as f:
        f.truncate(size)
    uid, gid, mode = root
    cmd = ["mkfs.ext4", "-q", "-F", "-b", "4096", "-m", "0", "-L", label,
           "-E", f"root_owner={uid}:{gid}", "-d", str(src_dir)]
    if read_only:
        cmd += ["-O", "^has_journal"]
    cmd += ["-N", str(inodes or max(count * 2 + 4096, 16384))]
    cmd.append(str(tmp))
    apt.run(cmd, what=f"making the ext4 image {out.name}")
    if mode != 0o755:  # mkfs's own
        apt.run(["debugfs", "-w", "-R", f"sif <2> mode 0{0o40000 | mode:o}", str(tmp)],
                what=f"setting the root directory's mode of {out.name}")
    tmp.rename(out)
    return out


def busybox_root(dest: Path, busybox: Path | None = None) -> Path:
    """A root holding only a static busybox with its applet links, /etc/passwd and /etc/group
    (no Python, no libc): the smallest image envd must still work in."""
    busybox = busybox or Path("/bin/busybox")
    if not busybox.is_file():
        raise GuestBuildError(f"{busybox} missing: install busybox-static")
    if dest.exists():
        shutil.rmtree(dest)
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "tmp", "proc", "sys", "dev", "run", "home"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    os.chmod(dest / "tmp", 0o1777)
    os.chmod(dest / "root", 0o700)
    shutil.copy2(busybox, dest / "bin" / "busybox")
    for applet in apt.run([str(busybox), "--list-full"], what="listing busybox applets").split():
        link = dest / applet
        if applet != "bin/busybox" and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to("/bin/busybox")
    (dest / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
    (dest / "etc" / "group").write_text("root:x:0:\nuser:x:1000:\n")
    (dest / "home" / "user").mkdir()
    os.chown(dest / "home" / "user", 1000, 1000)
    (dest / "etc" / "resolv.conf").write_text("")
    return dest


def debian_root_tarball(extra_packages: list[str] | tuple[str, ...] = (), *,
                        cache_dir: Path = DEFAULT_DEBIAN_CACHE) -> Path:
    """A tarball of `debootstrap --variant=minbase bookworm` plus extra packages, cached under
    cache_dir keyed by the package list. Built from the Debian archive on first use (~1-2 min)."""
    packages = sorted(set(extra_packages))
    key = hashlib.sha256(f"{DEBIAN_SUITE}|minbase|{','.join(packages)}".encode()).hexdigest()[:16]
    tarball = cache_dir / f"debian-{DEBIAN_SUITE}-minbase-{key}.tar"
    if tarball.is_file():
        return tarball
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".debootstrap-") as tmp:
        target = Path(tmp) / "root"
        cmd = ["debootstrap", "--variant=minbase"]
        if packages:
            cmd.append(f"--include={','.join(packages)}")
        cmd += [DEBIAN_SUITE, str(target), DEBIAN_MIRROR]
        apt.run(cmd, what="debootstrap of a Debian root")
        # Trim what only apt needs later and what differs per run.
        shutil.rmtree(target / "var/cache/apt/archives", ignore_errors=True)
        (target / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
        for lists in (target / "var/lib/apt/lists").glob("*_Packages"):
            lists.unlink()
        partial = tarball.with_name(tarball.name + ".tmp")
        apt.run(["tar", "--numeric-owner", "--xattrs", "-C", str(target), "-cf", str(partial), "."],
                what="archiving the Debian root")
        partial.rename(tarball)
    return tarball


BASE_USER, BASE_UID = "user", 1000


def add_base_user(root: Path) -> None:
    """E2B's `user` in a Debian root: uid 1000, bash, a home from /etc/skel, passwordless sudo;
    and pip allowed to install (`pip install --user`, or as root) next to Debian's packages,
    as in E2B's base image (Debian marks its Python externally managed, PEP 668)."""
    etc = root / "etc"
    passwd = (etc / "passwd").read_text()
    if not any(line.split(":")[0] == BASE_USER for line in passwd.splitlines()):
        with open(etc / "passwd", "a") as f:
            f.write(f"{BASE_USER}:x:{BASE_UID}:{BASE_UID}::/home/{BASE_USER}:/bin/bash\n")
        with open(etc / "group", "a") as f:
            f.write(f"{BASE_USER}:x:{BASE_UID}:\n")
        with open(etc / "shadow", "a") as f:
            f.write(f"{BASE_USER}:!:19000:0:99999:7:::\n")
    groups = []
    for line in (etc / "group").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == "sudo" and len(fields) == 4:
            members = [m for m in fields[3].split(",") if m]
            fields[3] = ",".join(members if BASE_USER in members else [*members, BASE_USER])
        groups.append(":".join(fields))
    (etc / "group").write_text("\n".join(groups) + "\n")
    home = root / "home" / BASE_USER
    if not home.exists():
        shutil.copytree(etc / "skel", home, symlinks=True)
        for path in [home, *home.rglob("*")]:
            os.lchown(path, BASE_UID, BASE_UID)
    sudoers = etc / "sudoers.d" / BASE_USER
    sudoers.parent.mkdir(parents=True, exist_ok=True)
    sudoers.write_text(f"{BASE_USER} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    os.chmod(sudoers, 0o440)
    (etc / "pip.conf").write_text("[global]\nbreak-system-packages = true\n")


def debian_root(dest: Path, extra_packages: list[str] | tuple[str, ...] = (), *,
                cache_dir: Path = DEFAULT_DEBIAN_CACHE) -> Path:
    """Unpacks the (cached) Debian root into dest."""
    tarball = debian_root_tarball(extra_packages, cache_dir=cache_dir)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    apt.run(["tar", "--numeric-owner", "--xattrs", "-C", str(dest), "-xf", str(tarball)],
            what="unpacking the Debian root")
    return dest
