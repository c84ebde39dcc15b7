"""Smoke test without QEMU: the tools disk's Python runs envd inside a busybox-only root (no libc,
no Python) on the host, through the disk's own loader, and the E2B SDK drives it."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.guest.build import GuestAssets, busybox_root

from .guestvm import free_port, wait_health

pytestmark = pytest.mark.root
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"


@pytest.fixture
def chroot_root(guest_assets: GuestAssets, tmp_path: Path) -> Iterator[Path]:
    root = busybox_root(tmp_path / "root")
    (root / "agentenv").mkdir()
    for name, minor in (("null", 3), ("zero", 5), ("urandom", 9)):
        os.mknod(root / "dev" / name, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    mounted: list[Path] = []
    try:
        subprocess.run(["mount", "-o", "ro,loop", str(guest_assets.tools_image), str(root / "agentenv")],
                       check=True)
        mounted.append(root / "agentenv")
        subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
        mounted.append(root / "proc")
        yield root
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", str(point)], check=False)


@contextlib.contextmanager
def envd_in_chroot(root: Path) -> Iterator[str]:
    port = free_port()
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "AENV_ENVD_SHELL_FALLBACK": "/agentenv/bin/sh",
           "PYTHONHOME": "/nonexistent", "PYTHONPATH": "/nonexistent"}  # must be ignored (-E)
    process = subprocess.Popen(
        [CHROOT, str(root), "/agentenv/bin/envd", "--port", str(port), "--host", "127.0.0.1",
         "--no-system-changes"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        if not wait_health(url, 60, process):
            process.kill()
            raise AssertionError(f"envd in the chroot did not start: {process.communicate()[0].decode()[-3000:]}")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_tools_python_has_its_stdlib_in_a_busybox_root(chroot_root: Path) -> None:
    assert not (chroot_root / "usr" / "lib").exists()  # nothing but busybox in the user root
    code = ("import ssl, sqlite3, ctypes, lzma, bz2, zlib, decimal, uuid, hashlib, json, asyncio, "
            "pty, readline, sys; print(sys.prefix, ssl.OPENSSL_VERSION.split()[0])")
    done = subprocess.run([CHROOT, str(chroot_root), "/agentenv/bin/python3", "-c", code],
                          capture_output=True, text=True, env={"PATH": "/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["/agentenv/usr", "OpenSSL"]


def test_envd_runs_in_a_busybox_root(chroot_root: Path) -> None:
    with envd_in_chroot(chroot_root) as url:
        from e2b import Sandbox

        sbx = Sandbox.connect("debug", debug=True, sandbox_url=url)
        result = sbx.commands.run("echo shell=$0; env", user="root")
        assert result.exit_code == 0
        assert "shell=/agentenv/bin/sh" in result.stdout  # no /bin/bash here: the fallback
        assert "PYTHON" not in result.stdout  # envd's own Python leaks nothing to children
        assert "LD_LIBRARY_PATH" not in result.stdout
        sbx.files.write("/tmp/hello.txt", "from the host")
        assert (chroot_root / "tmp" / "hello.txt").read_text() == "from the host"
        assert sbx.files.read("/tmp/hello.txt") == "from the host"
