"""The VM backend's built-in `base` template: Debian bookworm with what E2B's base image has
(rootfs.BASE_PACKAGES: python, pip, sudo, git, curl...) and the `user` account with sudo.

Built once per node and cached under <state>/templates/base/:

    Debian root (debootstrap, cached tarball)  ->  ext4 image (sparse, BASE_DISK_BYTES)
    ->  overlaybd layer (import_raw)  ->  cold boot through the runtime  ->  pause
    ->  the boot snapshot every `create` restores.

template.json records the boot snapshot's directory and a key of everything the snapshot
depends on (guest assets, accelerator, machine size, package list); a restart with the same key
reuses the snapshot, a different key rebuilds it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path

from agentenv.fsutil import atomic_write_json
from agentenv.guest.build import GuestAssets
from agentenv.guest.build.rootfs import (
    BASE_PACKAGES,
    add_base_user,
    debian_root,
    make_rootfs_image,
)
from agentenv.runtime.vm import BootSpec, DiskSource, Runtime
from agentenv.snapshot.record import SnapshotRecord
from agentenv.storage.export import import_raw

log = logging.getLogger("agentenv.node.base_template")

TEMPLATE_FORMAT = 2  # 2: the `user` account with sudo, pip.conf (rootfs.add_base_user)
BASE_DISK_BYTES = 4 << 30  # virtual size; the image file and the layer stay sparse
BASE_INODES = 262_144  # room for pip installs (mkfs -d would size inodes to the tree only)
BASE_VCPUS = 2
BASE_MEMORY_MIB = 512


@dataclass(frozen=True)
class BaseTemplate:
    record_dir: Path  # the boot snapshot's directory (snapshot.json)
    layers: tuple[str, ...]  # layer files the snapshot needs
    vcpus: int
    memory_mib: int
    disk_bytes: int


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def template_key(assets: GuestAssets, accel: str, dns: IPv4Address | None = None) -> str:
    parts = [
        str(TEMPLATE_FORMAT), accel, ",".join(sorted(BASE_PACKAGES)), str(BASE_DISK_BYTES),
        str(BASE_VCPUS), str(BASE_MEMORY_MIB),
        _file_key(assets.kernel), _file_key(assets.initramfs), _file_key(assets.tools_image),
        assets.cmdline_base,
        # the boot snapshot keeps the resolv.conf of its boot (restores do not boot)
        *([f"dns={dns}"] if dns else []),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def snapshot_layers(record: SnapshotRecord) -> tuple[str, ...]:
    paths = [x.path for x in record.memory_layers]
    for disk in record.disks:
        paths.extend(x.path for x in disk.layers)
    return tuple(paths)


def load_cached(template_dir: Path, key: str) -> BaseTemplate | None:
    meta_path = template_dir / "template.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("key") != key:
        return None
    record_dir = Path(meta["record_dir"])
    try:
        record = SnapshotRecord.load(record_dir)
        record.check_files()
    except Exception as exc:  # any damage means: rebuild
        log.warning("cached base template unusable, rebuilding", extra={"error": str(exc)})
        return None
    return BaseTemplate(record_dir, snapshot_layers(record), record.machine.vcpus,
                        record.machine.memory_mib, BASE_DISK_BYTES)


async def build_base_template(
    runtime: Runtime, assets: GuestAssets, template_dir: Path, *, debian_cache: Path,
    on_progress: Callable[[str], None] | None = None,
) -> BaseTemplate:
    """Builds (or reuses) the base template's boot snapshot."""
    assert runtime.accel is not None
    key = template_key(assets, runtime.accel, runtime.config.guest_dns)
    cached = load_cached(template_dir, key)
    if cached is not None:
        log.info("base template reused", extra={"record_dir": str(cached.record_dir)})
        return cached

    def step(message: str) -> None:
        log.info("base template: " + message)
        if on_progress is not None:
            on_progress(message)

    t0 = time.monotonic()
    template_dir.mkdir(parents=True, exist_ok=True)
    work = template_dir / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    step(f"unpacking a Debian bookworm root with {', '.join(BASE_PACKAGES)}"
         " (debootstrap on first use: 1-2 min)")
    root = await asyncio.to_thread(debian_root, work / "root", BASE_PACKAGES,
                                   cache_dir=debian_cache)
    await asyncio.to_thread(add_base_user, root)
    step(f"making a {BASE_DISK_BYTES >> 30} GiB sparse ext4 image")
    raw = await asyncio.to_thread(make_rootfs_image, root, work / "rootfs.ext4", BASE_DISK_BYTES,
                                  inodes=BASE_INODES)
    await asyncio.to_thread(shutil.rmtree, root, True)
    step("importing the image as an overlaybd layer")
    layer = template_dir / f"rootfs-{key}.layer"
    await asyncio.to_thread(import_raw, raw, layer)
    raw.unlink()
    step("booting the template VM (under TCG this takes a while)")
    vm = await runtime.boot(BootSpec(
        kernel=assets.kernel, initramfs=assets.initramfs, cmdline=assets.cmdline_base,
        vcpus=BASE_VCPUS, memory_mib=BASE_MEMORY_MIB, outbound=True,
        disks=[DiskSource("tools", assets.tools_image.stat().st_size, read_only=True,
                          file=assets.tools_image),
               DiskSource("rootfs", BASE_DISK_BYTES, layers=[layer])]))
    step("pausing it into the boot snapshot")
    try:
        record = await runtime.pause(vm, wait_teardown=True)
    except BaseException:
        await runtime.kill(vm)
        raise
    record_dir = Path(record.device_state).parent
    meta = {"format": TEMPLATE_FORMAT, "key": key, "record_dir": str(record_dir),
            "layer": str(layer), "built_at": time.time()}
    atomic_write_json(template_dir / "template.json", meta, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    # Older rootfs layers stay: paused sandboxes and snapshots made from an earlier build of
    # the template name them in their records.
    step(f"base template ready in {time.monotonic() - t0:.0f} s")
    return BaseTemplate(record_dir, snapshot_layers(record), record.machine.vcpus,
                        record.machine.memory_mib, BASE_DISK_BYTES)


def load_previous(template_dir: Path) -> dict[str, object] | None:
    try:
        raw = json.loads((template_dir / "template.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None
