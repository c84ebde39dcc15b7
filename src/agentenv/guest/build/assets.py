"""`build_assets`: kernel, initramfs and tools disk under STATE_DIR/guest/, rebuilt only when the
content of their inputs changed (Debian package SHA256s, init scripts, envd source, envd
requirements, this builder's own source), recorded in manifest.json."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from agentenv.guest.build import apt, kernel, rootfs, tools
from agentenv.guest.build.errors import GuestBuildError

MANIFEST_FORMAT = 1
KERNEL_FILE = "vmlinuz"
INITRAMFS_FILE = "initramfs.img"
TOOLS_FILE = "tools.ext4"
ENVD_PORT = 49983
GUEST_IP = "169.254.0.21/30"
GUEST_GATEWAY = "169.254.0.22"

# Serial console, no reboot loop on panic, skip probing legacy devices that only cost boot time
# under TCG. Network, hostname and DNS come per VM from guest_cmdline().
# page_reporting_order=0: free-page reporting hands the host free blocks from 4 KiB up, not only
# whole 2 MiB pageblocks (the kernel's default). QEMU maps guest RAM in 4 KiB pages, and the page
# cache the guest reclaims (guest/envd/reclaim.py) can come free scattered between pages still
# in use: of 300 MiB of cold page cache reclaimed, 60-84% left the host with 2 MiB blocks (next
# to nothing in two runs), 83-91% with 4 KiB ones every time (bench/RESULTS.md, "Cold memory
# back to the host"), at no idle cost.
CMDLINE_BASE = ("console=ttyS0 reboot=k panic=1 quiet mitigations=off 8250.nr_uarts=1 "
                "i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd random.trust_cpu=on "
                "page_reporting.page_reporting_order=0")

BUILDER_SOURCE = Path(__file__).resolve().parent
INIT_SOURCE = BUILDER_SOURCE.parent / "init"


@dataclass(frozen=True)
class GuestAssets:
    kernel: Path
    initramfs: Path
    tools_image: Path
    manifest: Path
    cmdline_base: str
    built: tuple[str, ...] = field(default=(), compare=False)  # what this call (re)built

    def cmdline(self, **kwargs: Any) -> str:
        return guest_cmdline(self.cmdline_base, **kwargs)


_WORD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")


def guest_cmdline(base: str = CMDLINE_BASE, *, ip: str = GUEST_IP, gw: str | None = GUEST_GATEWAY,
                  hostname: str = "sandbox", dns: str | None = None, extra: tuple[str, ...] = ()) -> str:
    """The full kernel command line for one VM, checking each value init will read."""
    try:
        ipaddress.ip_interface(ip)
        if "/" not in ip:
            raise ValueError("no prefix length")
        if gw is not None:
            ipaddress.ip_address(gw)
        if dns is not None:
            ipaddress.ip_address(dns)
    except ValueError as exc:
        raise GuestBuildError(f"bad guest network setting ({ip=}, {gw=}, {dns=}): {exc}") from exc
    if not _WORD.match(hostname):
        raise GuestBuildError(f"bad guest hostname {hostname!r}: letters, digits, '-' and '.' only")
    words = [base, f"aenv.ip={ip}", f"aenv.hostname={hostname}"]
    if gw is not None:
        words.append(f"aenv.gw={gw}")
    if dns is not None:
        words.append(f"aenv.dns={dns}")
    for word in extra:
        if not word or any(c.isspace() for c in word):
            raise GuestBuildError(f"bad extra kernel argument {word!r}")
        words.append(word)
    return " ".join(words)


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class _Steps:
    """Rich progress over the build's steps (silent when progress is off)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._progress: Progress | None = None
        if enabled:
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description:<40}"), BarColumn(),
                                      TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                      console=Console(stderr=True), transient=False)
            self._task = self._progress.add_task("guest assets", total=total)

    def __enter__(self) -> _Steps:
        if self._progress:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress:
            self._progress.stop()

    def step(self, description: str) -> None:
        if self._progress:
            self._progress.update(self._task, description=description)

    def done(self, note: str = "") -> None:
        if self._progress:
            if note:
                self._progress.console.print(f"  {note}")
            self._progress.advance(self._task)


@contextlib.contextmanager
def _locked(guest_dir: Path) -> Iterator[None]:
    guest_dir.mkdir(parents=True, exist_ok=True)
    with (guest_dir / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _fresh(entry: dict[str, Any] | None, key: str, path: Path) -> bool:
    """The manifest says this file was built from these inputs, and it is still that file."""
    if not entry or entry.get("inputs") != key or not path.is_file():
        return False
    st = path.stat()
    return entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns


def _describe(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"file": path.name, "sha256": apt.sha256_file(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _drop_stale(work: Path, prefix: str, keep: Path) -> None:
    for old in work.glob(prefix + "*"):
        if old != keep and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def build_assets(state_dir: Path, *, progress: bool = False, cache_dir: Path | None = None,
                 kernel_suite: str | None = None) -> GuestAssets:
    """Builds (or finds up to date) the guest kernel, initramfs and tools disk under
    state_dir/guest/. cache_dir holds downloaded .debs (default state_dir/guest/cache).
    kernel_suite takes the kernel from another release than kernel.DEFAULT_SUITE
    (bookworm-backports, 6.12, which unlike bookworm's 6.1 cloud kernel has vmgenid)."""
    guest_dir = Path(state_dir) / "guest"
    work = guest_dir / "work"
    cache = Path(cache_dir) if cache_dir else guest_dir / "cache"
    manifest_path = guest_dir / "manifest.json"
    kernel_path, initramfs_path, tools_path = (guest_dir / n for n in (KERNEL_FILE, INITRAMFS_FILE, TOOLS_FILE))
    built: list[str] = []

    with _locked(guest_dir), _Steps(progress, total=8) as steps:
        old: dict[str, Any] = {}
        if manifest_path.is_file():
            with contextlib.suppress(ValueError):
                old = json.loads(manifest_path.read_text())
        if old.get("format") != MANIFEST_FORMAT:
            old = {}
        work.mkdir(parents=True, exist_ok=True)

        steps.step("resolving Debian packages")
        kernel_suite = kernel_suite or kernel.DEFAULT_SUITE
        meta = f"{kernel.KERNEL_METAPACKAGE}/{kernel_suite}" if kernel_suite else kernel.KERNEL_METAPACKAGE
        pkgs = apt.resolve([meta, *tools.PYTHON_PACKAGES, tools.BUSYBOX_PACKAGE])
        kernel_pkg = kernel.kernel_package(pkgs.pop(kernel.KERNEL_METAPACKAGE), kernel_suite)
        pkgs[kernel_pkg.name] = kernel_pkg
        steps.done()

        steps.step("downloading Debian packages")
        debs = apt.fetch(list(pkgs.values()), cache / "debs")
        steps.done()

        builder_digest = tools.tree_digest(BUILDER_SOURCE)
        init_digest = tools.tree_digest(INIT_SOURCE)

        # Busybox: the same static binary goes into the initramfs and the tools disk.
        busybox_dir = work / f"busybox-{pkgs[tools.BUSYBOX_PACKAGE].sha256[:16]}"
        if not (busybox_dir / "bin" / "busybox").is_file():
            shutil.rmtree(busybox_dir, ignore_errors=True)
            apt.extract(debs[tools.BUSYBOX_PACKAGE], busybox_dir)
            _drop_stale(work, "busybox-", busybox_dir)
        busybox = busybox_dir / "bin" / "busybox"

        steps.step("kernel")
        kernel_dir = work / f"kernel-{kernel_pkg.sha256[:16]}"
        release_file = kernel_dir / ".release"
        if release_file.is_file():
            tree = kernel.KernelTree(kernel_dir, release_file.read_text().strip())
        else:
            tree = kernel.unpack_kernel(debs[kernel_pkg.name], kernel_dir)
            release_file.write_text(tree.release + "\n")
            _drop_stale(work, "kernel-", kernel_dir)
        kernel_key = _key(kernel_pkg.sha256)
        if not _fresh(old.get("kernel"), kernel_key, kernel_path):
            shutil.copyfile(tree.vmlinuz, kernel_path.with_suffix(".tmp"))
            kernel_path.with_suffix(".tmp").rename(kernel_path)
            built.append("kernel")
        kernel_entry = {**(_describe(kernel_path) if "kernel" in built else old["kernel"]),
                        "inputs": kernel_key, "release": tree.release,
                        "package": kernel_pkg.name, "version": kernel_pkg.version}
        steps.done()

        steps.step("initramfs")
        initramfs_key = _key(kernel_pkg.sha256, pkgs[tools.BUSYBOX_PACKAGE].sha256, init_digest, builder_digest)
        if _fresh(old.get("initramfs"), initramfs_key, initramfs_path):
            initramfs_entry = old["initramfs"]
        else:
            modules = kernel.build_initramfs(tree, busybox, initramfs_path)
            _order, absent = kernel.module_load_order(tree)
            initramfs_entry = {**_describe(initramfs_path), "inputs": initramfs_key,
                               "modules": modules, "absent_modules": absent}
            built.append("initramfs")
        steps.done()

        steps.step("python runtime")
        python_key = _key([pkgs[n].sha256 for n in tools.PYTHON_PACKAGES], builder_digest)
        python_dir = work / f"python-{python_key[:16]}"
        if not python_dir.is_dir():
            tools.unpack_python(debs, python_dir)
            _drop_stale(work, "python-", python_dir)
            built.append("python")
        steps.done()

        steps.step("envd dependencies (PyPI)")
        requirements = tools.envd_requirements()
        site_key = _key(requirements, builder_digest)
        site_dir = work / f"site-{site_key[:16]}"
        site_list_file = site_dir.with_name(site_dir.name + ".json")
        if site_dir.is_dir() and site_list_file.is_file():
            site_packages = json.loads(site_list_file.read_text())
        else:
            site_packages = tools.install_site_packages(requirements, site_dir)
            site_list_file.write_text(json.dumps(site_packages))
            for stale in work.glob("site-*.json"):
                if stale != site_list_file:
                    stale.unlink()
            _drop_stale(work, "site-", site_dir)
            built.append("site-packages")
        steps.done()

        steps.step("tools disk")
        envd_digest = tools.tree_digest(tools.ENVD_SOURCE)
        codeint_digest = tools.tree_digest(tools.CODEINT_SOURCE)
        versions = {
            "python": pkgs["python3.11-minimal"].version,
            "busybox": pkgs[tools.BUSYBOX_PACKAGE].version,
            "libc6": pkgs["libc6"].version,
            "envd_digest": envd_digest,
            "codeint_digest": codeint_digest,
            "site_packages": site_packages,
        }
        on_demand = kernel.ON_DEMAND_MODULES
        tools_key = _key(python_key, site_key, pkgs[tools.BUSYBOX_PACKAGE].sha256, envd_digest,
                         codeint_digest, init_digest, builder_digest,
                         *((kernel_pkg.sha256, *on_demand) if on_demand else ()))
        if _fresh(old.get("tools"), tools_key, tools_path):
            tools_entry = old["tools"]
        else:
            stage = work / "tools-stage"
            tools.stage_tools(python_dir=python_dir, site_dir=site_dir, busybox=busybox, stage=stage,
                              versions=versions,
                              modules={"nfs": kernel.on_demand_modules(tree)} if on_demand else None)
            rootfs.make_rootfs_image(stage, tools_path, rootfs.image_size_for(stage, free=8 * rootfs.MiB),
                                     label="aenv-tools", read_only=True)
            shutil.rmtree(stage)
            tools_entry = {**_describe(tools_path), "inputs": tools_key, **versions}
            built.append("tools")
        steps.done()

        manifest = {
            "format": MANIFEST_FORMAT,
            "cmdline_base": CMDLINE_BASE,
            "kernel": kernel_entry,
            "initramfs": initramfs_entry,
            "tools": tools_entry,
            "packages": {name: pkg.version for name, pkg in sorted(pkgs.items())},
        }
        _write_manifest(manifest_path, manifest, old)
        steps.done(f"built: {', '.join(built) or 'nothing (up to date)'}")

    return GuestAssets(kernel=kernel_path, initramfs=initramfs_path, tools_image=tools_path,
                       manifest=manifest_path, cmdline_base=CMDLINE_BASE, built=tuple(built))


def _write_manifest(path: Path, manifest: dict[str, Any], old: dict[str, Any]) -> None:
    """Writes the manifest only when its content changed, so an up-to-date build touches nothing."""
    old_body = {k: v for k, v in old.items() if k != "built_at"}
    if old_body == manifest and path.is_file():
        return
    manifest = {**manifest, "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    tmp.rename(path)


def load_manifest(state_dir: Path) -> dict[str, Any]:
    path = Path(state_dir) / "guest" / "manifest.json"
    if not path.is_file():
        raise GuestBuildError(f"no guest assets under {path.parent}: run `aenv guest build`")
    return json.loads(path.read_text())
