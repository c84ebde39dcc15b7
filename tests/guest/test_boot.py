"""Boots the real Debian cloud kernel in QEMU (TCG) with the built initramfs and tools disk and a
user root disk, and drives envd in the guest with the official E2B SDK over the guest network."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from agentenv.guest.build import GuestAssets, busybox_root, debian_root, make_rootfs_image

from .conftest import CACHE
from .guestvm import SLIRP_DNS, boot, wait_health

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

MEASUREMENTS = CACHE / "measurements.json"


def _record(name: str, value: float) -> None:
    """Keeps the latest figures (boot time, envd RSS) for the report; printed with -s."""
    data = json.loads(MEASUREMENTS.read_text()) if MEASUREMENTS.is_file() else {}
    data[name] = value
    MEASUREMENTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"{name} = {value}")


def _envd_pid(sbx) -> int:
    # The loop's own shell has the pattern in its command line too: leave it out.
    out = sbx.commands.run("for p in /proc/[0-9]*; do [ ${p#/proc/} = $$ ] && continue; "
                           "grep -q envd-main $p/cmdline 2>/dev/null && echo ${p#/proc/}; done; true",
                           user="root").stdout
    pids = [int(x) for x in out.split()]
    assert len(pids) == 1, out
    return pids[0]


def _zombies(sbx) -> list[str]:
    out = sbx.commands.run("cat /proc/[0-9]*/stat 2>/dev/null", user="root").stdout
    return [line for line in out.splitlines() if re.match(r"^\d+ \(.*\) Z ", line)]


def _debugfs_cat(image: Path, path: str) -> str:
    return subprocess.run(["debugfs", "-R", f"cat {path}", str(image)], capture_output=True,
                          text=True, check=True).stdout


def test_busybox_guest(guest_assets: GuestAssets, tmp_path: Path) -> None:
    disk = make_rootfs_image(busybox_root(tmp_path / "root"), tmp_path / "user.ext4")
    with boot(guest_assets, disk, tmp_path, hostname="bb-guest", dns=SLIRP_DNS) as guest:
        _record("tcg_boot_to_envd_ready_s", round(guest.boot_seconds, 2))
        sbx = guest.sandbox()
        r = sbx.commands.run("hostname; cat /etc/resolv.conf; ip -4 -o addr show eth0; ip route; "
                             "cat /proc/1/cmdline | tr '\\0' ' '; echo; grep ' /agentenv ' /proc/mounts",
                             user="root")
        assert r.exit_code == 0
        lines = r.stdout.splitlines()
        assert lines[0] == "bb-guest"
        assert f"nameserver {SLIRP_DNS}" in r.stdout
        assert "169.254.0.21/30" in r.stdout
        assert "default via 169.254.0.22 dev eth0" in r.stdout
        assert "/agentenv/bin/sh /agentenv/init" in r.stdout
        assert re.search(r"^/dev/vda /agentenv ext4 ro[,\s]", r.stdout, re.M)

        # Files round-trip through envd into the user disk.
        sbx.files.write("/home/user/note.txt", "written by the SDK")
        assert sbx.commands.run("cat /home/user/note.txt").stdout == "written by the SDK"

        # PID 1 reaps orphans: a grandchild whose parent already exited.
        sbx.commands.run("sh -c 'sleep 0.3 >/dev/null 2>&1 &'; exit 0", user="root")
        time.sleep(1.5)
        assert _zombies(sbx) == []

        envd_pid = _envd_pid(sbx)
        rss_kib = int(re.search(r"VmRSS:\s+(\d+)", sbx.commands.run(
            f"cat /proc/{envd_pid}/status", user="root").stdout).group(1))
        _record("envd_idle_rss_mib", round(rss_kib / 1024, 1))

        # envd is restarted when it dies.
        sbx.commands.run(f"(sleep 0.5; kill -9 {envd_pid}) >/dev/null 2>&1 &", user="root")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{guest.url}/health", timeout=0.5)
            except httpx.HTTPError:
                break
            time.sleep(0.1)
        assert wait_health(guest.url, 60, guest.process)
        sbx = guest.sandbox()
        assert _envd_pid(sbx) != envd_pid
        assert "envd exited (status 137); restarting" in guest.console()
        sbx.commands.run("sync", user="root")
        console = guest.console()
    assert "aenv-init: envd started" in console
    # The user image keeps its own (empty) resolv.conf: init bind-mounted a tmpfs copy over it.
    assert _debugfs_cat(disk, "/etc/resolv.conf") == ""
    assert _debugfs_cat(disk, "/home/user/note.txt") == "written by the SDK"


def test_debian_guest(guest_assets: GuestAssets, tmp_path: Path) -> None:
    root = debian_root(tmp_path / "root", ["python3"], cache_dir=CACHE)
    disk = make_rootfs_image(root, tmp_path / "user.ext4")
    with boot(guest_assets, disk, tmp_path, hostname="deb-guest") as guest:
        sbx = guest.sandbox()
        r = sbx.commands.run("echo $BASH_VERSION; cat /etc/debian_version; hostname", user="root")
        bash_version, debian_version, hostname = r.stdout.splitlines()
        assert bash_version.startswith("5.")  # the image's own bash, not the fallback
        assert debian_version.startswith("12.")
        assert hostname == "deb-guest"
        # The image's Python and libc serve user processes; nothing of /agentenv leaks in.
        r = sbx.commands.run("python3 -c 'import sys, ssl; print(sys.prefix, sys.executable)'; "
                             "grep -o '[^ ]*libc.so.6' /proc/self/maps | sort -u; env", user="root")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.splitlines()[0] == "/usr /usr/bin/python3"
        assert "/usr/lib/x86_64-linux-gnu/libc.so.6" in r.stdout
        assert "agentenv" not in r.stdout.split("\n", 1)[1]
        # A regular user (created by envd on first use) gets a working shell and home.
        r = sbx.commands.run("id -un; cd && pwd && echo hi > f && cat f")
        assert r.stdout.split() == ["user", "/home/user", "hi"]
        # Without aenv.dns the image's resolv.conf is left as it is.
        assert "169.254" not in sbx.commands.run("cat /etc/resolv.conf", user="root").stdout


def _hello_world_root(shared_dir: Path, dest: Path) -> Path:
    """The amd64 layer of the hello-world fixture: a single static /hello, no shell, no libc."""
    layout = shared_dir / "fixtures" / "oci" / "hello-world"
    index = json.loads((layout / "index.json").read_text())
    entry = next(m for m in index["manifests"]
                 if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == "amd64")
    manifest = json.loads((layout / "blobs" / "sha256" / entry["digest"].split(":")[1]).read_text())
    (layer,) = manifest["layers"]
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-xzf", str(layout / "blobs" / "sha256" / layer["digest"].split(":")[1]),
                    "-C", str(dest)], check=True)
    assert sorted(p.name for p in dest.iterdir()) == ["hello"]
    return dest


def test_shell_less_guest(guest_assets: GuestAssets, shared_dir: Path, tmp_path: Path) -> None:
    """An image with nothing but a static binary still boots and serves envd: init creates the
    mount points it needs and commands fall back to the tools disk's shell."""
    disk = make_rootfs_image(_hello_world_root(shared_dir, tmp_path / "root"), tmp_path / "user.ext4",
                             32 << 20)
    with boot(guest_assets, disk, tmp_path, hostname="hello") as guest:
        sbx = guest.sandbox()
        r = sbx.commands.run("/hello", user="root")
        assert "Hello from Docker!" in r.stdout
        r = sbx.commands.run("echo $0; read -r name </proc/sys/kernel/hostname; echo $name", user="root")
        assert r.stdout.split() == ["/agentenv/bin/sh", "hello"]
