"""A minimal root filesystem made from this host's own binaries, for the process backend.

When envd runs as root with `--root DIR`, it chroots every process into DIR, so DIR needs a
userland: bash, coreutils, grep/sed/awk and the shared libraries they load. This builds one by
copying those binaries and what `ldd` says they need (about 15 MB), plus /etc/passwd with `root`
and `user` (uid 1000) like E2B templates, /home/user, /tmp and the usual /dev nodes, and the
build tools a VM's tools disk has (/agentenv/bin/busybox and sh, agentenv.template.build), so
templates build on the process backend too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from agentenv.errors import AgentEnvError

#: Bump when the content changes, so cached copies are rebuilt.
LAYOUT_VERSION = "4"

PROGRAMS = [
    "bash",
    "sh",
    "dash",
    "cat",
    "echo",
    "ls",
    "pwd",
    "env",
    "sleep",
    "mkdir",
    "rmdir",
    "rm",
    "cp",
    "mv",
    "touch",
    "head",
    "tail",
    "wc",
    "printf",
    "test",
    "true",
    "false",
    "whoami",
    "id",
    "uname",
    "date",
    "grep",
    "egrep",
    "sed",
    "awk",
    "mawk",
    "gawk",
    "find",
    "xargs",
    "tr",
    "cut",
    "sort",
    "uniq",
    "chmod",
    "chown",
    "ln",
    "basename",
    "dirname",
    "readlink",
    "stat",
    "tee",
    "seq",
    "yes",
    "timeout",
    "nohup",
    "kill",
    "tar",
    "gzip",
    "gunzip",
    "zcat",
    "du",
    "df",
    "md5sum",
    "sha1sum",
    "sha256sum",
    "base64",
    "dd",
    "sync",
    "mktemp",
    "realpath",
    "expr",
    "diff",
    "cmp",
    "od",
    "hostname",
    "nproc",
    "which",
    "split",
    "paste",
    "comm",
    "fold",
    "nl",
    "sum",
    "tac",
    "fmt",
    "install",
    "truncate",
]

PASSWD = (
    "root:x:0:0:root:/root:/bin/bash\n"
    "user:x:1000:1000:user:/home/user:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n"
DEVICES = {"null": (1, 3), "zero": (1, 5), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
_LDD_PATH = re.compile(r"(/\S+)")


def _copy_into(root: Path, host_path: str) -> None:
    """Copy the file behind host_path to the same path inside root (symlinks followed)."""
    target = root / host_path.lstrip("/")
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(os.path.realpath(host_path), target)


def _shared_libraries(binaries: list[str]) -> list[str]:
    """Every shared library the binaries load (one `ldd` call for all of them)."""
    try:
        out = subprocess.run(
            ["ldd", *binaries], capture_output=True, text=True, check=False, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    paths: list[str] = []
    for line in out.splitlines():
        if "not found" in line or line.endswith(":"):
            continue
        for match in _LDD_PATH.findall(line):
            if os.path.exists(match):
                paths.append(match)
    return paths


def build_host_rootfs(dest: Path) -> Path:
    """Build the rootfs at dest (atomically: built beside it, then renamed). Returns dest."""
    stamp = dest.with_name(dest.name + ".version")  # beside, so sandboxes never see it
    if stamp.exists() and stamp.read_text().strip() == LAYOUT_VERSION:
        return dest
    work = dest.with_name(dest.name + ".building")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # the merged-/usr layout of current Debian: /bin, /lib, /lib64, /sbin are links into /usr
    for sub in ("usr/bin", "usr/sbin", "usr/lib", "usr/lib64"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "sbin", "lib", "lib64"):
        os.symlink(f"usr/{link}", work / link)
    copied = []
    for name in PROGRAMS:
        host = shutil.which(name)
        if host is None:
            continue
        shutil.copy2(os.path.realpath(host), work / "usr/bin" / name)
        copied.append(host)
    for lib in sorted(set(_shared_libraries(copied))):
        _copy_into(work, lib)
    if not (work / "usr/bin/bash").exists():
        shutil.rmtree(work, ignore_errors=True)
        raise AgentEnvError("bash is not installed on this host: cannot build a process rootfs")
    if not (work / "usr/bin/sh").exists():
        os.symlink("bash", work / "usr/bin/sh")
    busybox = shutil.which("busybox")
    if busybox is not None:  # Debian's busybox-static: no libraries to copy
        tools = work / "agentenv/bin"
        tools.mkdir(parents=True)
        shutil.copy2(os.path.realpath(busybox), tools / "busybox")
        os.symlink("busybox", tools / "sh")
    etc = work / "etc"
    etc.mkdir()
    (etc / "passwd").write_text(PASSWD)
    (etc / "group").write_text(GROUP)
    (etc / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files dns\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    (etc / "hostname").write_text("sandbox\n")
    for d, mode in (("root", 0o700), ("tmp", 0o1777), ("home/user", 0o755), ("dev", 0o755)):
        (work / d).mkdir(parents=True, exist_ok=True)
        os.chmod(work / d, mode)
    if os.geteuid() == 0:
        os.chown(work / "home/user", 1000, 1000)
        for dev, (major, minor) in DEVICES.items():
            try:
                os.mknod(work / "dev" / dev, 0o20666, os.makedev(major, minor))
                os.chmod(work / "dev" / dev, 0o666)
            except OSError:
                pass  # no CAP_MKNOD: processes still run, without /dev/null inside
    if dest.exists():
        shutil.rmtree(dest)
    work.rename(dest)
    stamp.write_text(LAYOUT_VERSION + "\n")
    return dest
