"""Fixtures for the guest tests: the built assets (cached across runs under
/var/cache/aenv-test/guest; built from scratch when that cache is empty) and user root disks."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from agentenv.guest.build import GuestAssets, build_assets

CACHE = Path(os.environ.get("AENV_TEST_GUEST_CACHE", "/var/cache/aenv-test/guest"))
# AENV_TEST_GUEST_STATE: assets of its own for a checkout that changes the guest (tests/node too).
STATE = Path(os.environ.get("AENV_TEST_GUEST_STATE", CACHE / "state"))


def _need_tools(*names: str) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pytest.fail(f"missing host tools {missing}: run `bash scripts/install-system.sh`")


@pytest.fixture(scope="session")
def guest_assets() -> GuestAssets:
    if os.geteuid() != 0:
        pytest.skip("building the guest assets needs root (file owners in the tools disk)")
    _need_tools("apt-get", "dpkg-deb", "depmod", "mkfs.ext4", "e2fsck", "debugfs", "cpio")
    return build_assets(STATE, cache_dir=CACHE)
