"""The project's real guest (kernel, initramfs, tools disk, envd) under the runtime:
boot, pause, restore with env vars and an access token set through envd's /init."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from agentenv.runtime.vm import BootSpec, DiskSource

from .conftest import Env

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

GUEST_CACHE = Path(os.environ.get("AENV_TEST_GUEST_STATE", "/var/cache/aenv-test/guest/state"))


def test_real_guest_pause_restore_envd_init(env: Env) -> None:
    from agentenv.guest.build.assets import build_assets
    from agentenv.guest.build.rootfs import busybox_root, make_rootfs_image
    from agentenv.storage.export import import_raw

    assets = build_assets(GUEST_CACHE)
    raw = make_rootfs_image(busybox_root(env.root / "bbroot"), env.root / "user.ext4", 64 << 20)
    layer = import_raw(raw, env.root / "user.layer")
    tools_size = assets.tools_image.stat().st_size
    rt = env.runtime
    saved = rt.config.envd_init_path
    rt.config.envd_init_path = "/init"  # the real envd
    try:
        vm = env.loop.run(rt.boot(BootSpec(
            kernel=assets.kernel, initramfs=assets.initramfs, cmdline=assets.cmdline_base,
            memory_mib=256,
            disks=[DiskSource("tools", tools_size, read_only=True, file=assets.tools_image),
                   DiskSource("rootfs", 64 << 20, layers=[layer])])))
        record = env.loop.run(rt.pause(vm))
        assert [d.name for d in record.disks] == ["tools", "rootfs"]
        vm = env.loop.run(rt.restore(record, env_vars={"FOO": "bar"}, access_token="tok-123"))
        try:
            answer = httpx.get(vm.envd_url + "/envs", headers={"X-Access-Token": "tok-123"},
                               timeout=30)
            assert answer.status_code == 200
            assert answer.json().get("FOO") == "bar"
            assert httpx.get(vm.envd_url + "/health", timeout=30).status_code == 204
        finally:
            env.loop.run(rt.kill(vm))
    finally:
        rt.config.envd_init_path = saved
