"""Host-side builder of the guest: kernel, initramfs, tools disk, and user root disks for tests
and base images. Public API: build_assets, GuestAssets, guest_cmdline, make_rootfs_image,
busybox_root, debian_root, debian_root_tarball."""

from __future__ import annotations

from agentenv.guest.build.assets import (
    CMDLINE_BASE,
    ENVD_PORT,
    GUEST_GATEWAY,
    GUEST_IP,
    GuestAssets,
    build_assets,
    guest_cmdline,
    load_manifest,
)
from agentenv.guest.build.errors import GuestBuildError
from agentenv.guest.build.rootfs import (
    BASE_PACKAGES,
    busybox_root,
    debian_root,
    debian_root_tarball,
    make_rootfs_image,
)

__all__ = [
    "BASE_PACKAGES",
    "CMDLINE_BASE",
    "ENVD_PORT",
    "GUEST_GATEWAY",
    "GUEST_IP",
    "GuestAssets",
    "GuestBuildError",
    "build_assets",
    "busybox_root",
    "debian_root",
    "debian_root_tarball",
    "guest_cmdline",
    "load_manifest",
    "make_rootfs_image",
]
