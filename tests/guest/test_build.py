"""The guest asset build: idempotence, rebuild of only what changed, manifest, and the artefacts
checked with real tools (e2fsck, debugfs, cpio)."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from agentenv.cli.main import cli
from agentenv.guest.build import (
    GuestAssets,
    GuestBuildError,
    build_assets,
    busybox_root,
    guest_cmdline,
    make_rootfs_image,
    tools,
)

from .conftest import CACHE, STATE

pytestmark = pytest.mark.root


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _envd_edited_since(when: float) -> bool:
    return any(p.stat().st_mtime > when - 30 for p in tools.ENVD_SOURCE.rglob("*") if p.is_file())


def test_second_build_does_no_work(guest_assets: GuestAssets) -> None:
    stats = {p: p.stat().st_mtime_ns for p in (guest_assets.kernel, guest_assets.initramfs,
                                                guest_assets.tools_image, guest_assets.manifest)}
    built_at = guest_assets.tools_image.stat().st_mtime
    again = build_assets(STATE, cache_dir=CACHE)
    for _ in range(3):
        # envd is edited by others while this runs: then the tools disk (and its PyPI deps) must
        # catch up, after which a build must do nothing.
        if not (set(again.built) <= {"site-packages", "tools"} and _envd_edited_since(built_at)):
            break
        built_at = time.time()
        stats = {p: p.stat().st_mtime_ns for p in stats}
        again = build_assets(STATE, cache_dir=CACHE)
        if again.built == ():
            break
    assert again.built == ()
    assert again == guest_assets
    assert {p: p.stat().st_mtime_ns for p in stats} == stats


def test_manifest_describes_the_files(guest_assets: GuestAssets) -> None:
    manifest = json.loads(guest_assets.manifest.read_text())
    for key, path in (("kernel", guest_assets.kernel), ("initramfs", guest_assets.initramfs),
                      ("tools", guest_assets.tools_image)):
        assert manifest[key]["file"] == path.name
        assert manifest[key]["sha256"] == _sha256(path)
        assert manifest[key]["size"] == path.stat().st_size
    assert manifest["kernel"]["release"].endswith("-cloud-amd64")
    assert manifest["kernel"]["package"] == f"linux-image-{manifest['kernel']['release']}"
    assert manifest["tools"]["python"].startswith("3.11.")
    assert manifest["tools"]["busybox"]
    assert manifest["packages"]["libc6"] == manifest["tools"]["libc6"]
    assert manifest["cmdline_base"] == guest_assets.cmdline_base
    assert "console=ttyS0" in guest_assets.cmdline_base
    modules = [Path(m).name for m in manifest["initramfs"]["modules"]]
    absent = manifest["initramfs"]["absent_modules"]
    # Each wanted module is in the initramfs or built into the kernel (6.12 builds in
    # virtio_pci and vmgenid, which 6.1 ships as modules or lacks).
    for needed in ("virtio_pci", "virtio_blk", "virtio_net", "virtio_balloon"):
        assert f"{needed}.ko" in modules or needed not in absent
    assert "virtio_blk.ko" in modules
    # Dependencies load first.
    loaded = [m for m in ("virtio.ko", "virtio_pci.ko", "virtio_blk.ko") if m in modules]
    assert [modules.index(m) for m in loaded] == sorted(modules.index(m) for m in loaded)
    # The NFSv4 client for shared read-write volumes is not loaded at boot (it cost a cold boot
    # seconds under TCG): envd loads it from the tools disk (test_tools_image_layout).
    assert not any(m.startswith(("nfs", "sunrpc", "lockd")) for m in modules), modules


def test_tools_image_is_clean_ext4(guest_assets: GuestAssets) -> None:
    done = subprocess.run(["e2fsck", "-fn", str(guest_assets.tools_image)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _debugfs(image: Path, request: str) -> str:
    return subprocess.run(["debugfs", "-R", request, str(image)], capture_output=True, text=True,
                          check=True).stdout


def test_tools_image_layout(guest_assets: GuestAssets) -> None:
    image = guest_assets.tools_image
    for path in ("/init", "/bin/busybox", "/bin/envd", "/bin/python3", "/manifest.json",
                 "/usr/bin/python3.11", "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
                 "/python/agentenv/__init__.py", "/python/agentenv/guest/envd/__main__.py",
                 "/python/agentenv/guest/codeint/__main__.py",
                 "/python/envd-main.py", "/usr/lib/python3.11/os.py"):
        assert "Type: regular" in _debugfs(image, f"stat {path}"), path
    assert _debugfs(image, "cat /python/agentenv/__init__.py") == ""
    # The NFSv4 client's modules, for envd to load in this order (dependencies first) before
    # the first shared-volume mount (docs/volumes.md §7.1).
    order = _debugfs(image, "cat /modules/nfs.order").split()
    nfs = ["sunrpc.ko", "lockd.ko", "nfs.ko", "nfsv4.ko"]
    assert all(m in order for m in nfs), order
    assert [order.index(m) for m in nfs] == sorted(order.index(m) for m in nfs)
    for name in order:
        assert "Type: regular" in _debugfs(image, f"stat /modules/{name}"), name
    # Symlinks stay inside the disk (no absolute target would resolve under /agentenv).
    assert _debugfs(image, "stat /bin/sh").count('Fast link dest: "busybox"') == 1
    lib64 = _debugfs(image, "stat /lib64/ld-linux-x86-64.so.2")
    assert 'Fast link dest: "../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"' in lib64
    # Precompiled: the disk is read-only in the guest.
    assert "os.cpython-311.pyc" in _debugfs(image, "ls /usr/lib/python3.11/__pycache__")
    envd_cache = _debugfs(image, "ls /python/agentenv/guest/envd/__pycache__")
    assert "__main__.cpython-311.pyc" in envd_cache
    launcher = _debugfs(image, "cat /bin/envd")
    assert launcher.startswith("#!/agentenv/bin/sh\nexec /agentenv/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 ")
    inner = json.loads(_debugfs(image, "cat /manifest.json"))
    assert inner["python"] == json.loads(guest_assets.manifest.read_text())["tools"]["python"]


def test_initramfs_holds_init_console_and_modules(guest_assets: GuestAssets) -> None:
    raw = gzip.decompress(guest_assets.initramfs.read_bytes())
    listing = subprocess.run(["cpio", "-itv", "--quiet"], input=raw, capture_output=True, check=True).stdout
    lines = listing.decode().splitlines()
    names = {line.split()[-1] for line in lines}
    assert {"init", "bin/busybox", "dev/console"} <= names
    console = next(line for line in lines if line.endswith(" dev/console"))
    assert console.startswith("crw") and "5," in console
    release = json.loads(guest_assets.manifest.read_text())["kernel"]["release"]
    assert f"lib/modules/{release}/kernel/drivers/block/virtio_blk.ko" in names
    assert f"lib/modules/{release}/load-order" in names


def test_only_the_missing_artefact_is_rebuilt(guest_assets: GuestAssets, tmp_path: Path) -> None:
    state = tmp_path / "state"
    shutil.copytree(STATE, state, symlinks=True)
    (state / "guest" / "tools.ext4").unlink()
    kernel_mtime = (state / "guest" / "vmlinuz").stat().st_mtime_ns
    rebuilt = build_assets(state, cache_dir=CACHE)
    # (site-packages too, if envd's requirements were edited since the fixture ran)
    assert rebuilt.built in (("tools",), ("site-packages", "tools"))
    assert (state / "guest" / "vmlinuz").stat().st_mtime_ns == kernel_mtime
    manifest = json.loads(rebuilt.manifest.read_text())
    assert manifest["tools"]["sha256"] == _sha256(rebuilt.tools_image)


def test_cli_build_reports_up_to_date(guest_assets: GuestAssets) -> None:
    args = ["guest", "build", "-q", "--state-dir", str(STATE), "--cache-dir", str(CACHE)]
    # The first call catches up with any source edited since the fixture ran.
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    assert f"tools disk {STATE}/guest/tools.ext4" in first.output
    second = CliRunner().invoke(cli, args)
    assert second.exit_code == 0, second.output
    assert "rebuilt: nothing, up to date" in second.output


def test_guest_cmdline_checks_values() -> None:
    line = guest_cmdline(ip="169.254.0.21/30", gw="169.254.0.22", hostname="sbx-1", dns="10.0.0.2")
    assert line.endswith("aenv.ip=169.254.0.21/30 aenv.hostname=sbx-1 aenv.gw=169.254.0.22 aenv.dns=10.0.0.2")
    for bad in ({"ip": "169.254.0.21"}, {"ip": "300.1.1.1/30"}, {"hostname": "a b"},
                {"dns": "x"}, {"extra": ("a b",)}):
        with pytest.raises(GuestBuildError):
            guest_cmdline(**bad)  # type: ignore[arg-type]


def test_make_rootfs_image(tmp_path: Path) -> None:
    root = busybox_root(tmp_path / "root")
    image = make_rootfs_image(root, tmp_path / "root.ext4", 64 << 20)
    assert image.stat().st_size == 64 << 20
    done = subprocess.run(["e2fsck", "-fn", str(image)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    assert "Type: regular" in _debugfs(image, "stat /bin/busybox")
    with pytest.raises(GuestBuildError, match="cannot hold"):
        make_rootfs_image(root, tmp_path / "small.ext4", 1 << 20)
    with pytest.raises(GuestBuildError, match="not a directory"):
        make_rootfs_image(tmp_path / "absent", tmp_path / "x.ext4", 64 << 20)
