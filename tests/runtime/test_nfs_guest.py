"""Shared read-write volumes in real guests (docs/volumes.md §7.1): the node's pieces without
the node. A shared volume's own file system (node/shared_fs.py) exported by the node's NFS
server (node/nfs_exports.py), reached through the slot's NFS hole (runtime/network.py
`set_nfs`, the host's DNAT to the server in its own network namespace, runtime/nfs_net.py),
mounted by envd's /init (guest/envd/mounts.py, kind nfs).

- test_envd_mounts_a_shared_volume: the real guest (kernel, tools disk, envd): /init mounts the
  volume; a file the host wrote is read through envd's /files, one uploaded there lands on the
  host (owned by the squash owner); paused and restored (another slot, another address: added
  to the export before the guest runs), the mount still reads and writes.
- test_two_guests_share_a_volume_through_pause_and_fork (opt-in, AENV_TEST_NFS_SPIKE=1): the
  busybox test guest mounting by hand, two guests, pause/resume, and a fork, whose children's
  NFS access hangs (they share the parent's NFSv4 client identity; §7.1).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from agentenv.node.nfs import stable_port
from agentenv.node.nfs_exports import SharedExports, SharedVolume
from agentenv.node.shared_fs import SharedFilesystem
from agentenv.runtime import network as rtnet
from agentenv.runtime import nfs_net
from agentenv.runtime.vm import VM, BootSpec, DiskSource
from agentenv.testing.guest import build_test_guest
from agentenv.testing.harness import sh

from .conftest import PREFIX, ROOTFS_SIZE, Env

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

GUEST_CACHE = Path(os.environ.get("AENV_TEST_GUEST_STATE", "/var/cache/aenv-test/guest/state"))
NFS_IP = "169.254.169.254"
OWNER = 4321  # the volume root's owner: every guest acts as it on the host
MOUNT = (
    "for m in $(cat /modules.extra); do insmod /modules/$m 2>/dev/null; done\n"
    "mkdir -p /mnt/shared\n"
    f"mount -t nfs4 -o vers=4.1,proto=tcp,port=2049,addr={NFS_IP},hard,timeo=50 "
    f"{NFS_IP}:/volumes/shared && echo mounted\n"
)


@dataclass
class Nfs:
    exports: SharedExports
    volume: SharedVolume
    root: Path  # the volume's file system, as the host (the content API) sees it

    async def open_for(self, env: Env, sandbox: str, vm: VM) -> None:
        """What the node does before a sandbox with the shared volume runs."""
        assert vm.slot is not None
        await env.runtime.set_nfs(vm, True)
        await self.exports.attach(sandbox, vm.slot.guest_address, (self.volume,))


@pytest.fixture
def nfs(env: Env, tmp_path: Path) -> Iterator[Nfs]:
    port = stable_port(tmp_path)  # below 1024, as a node's (node/nfs.py "Port")
    rt = env.runtime
    content = tmp_path / "content"
    content.mkdir()
    (content / "host.txt").write_text("from-host\n")
    os.chown(content / "host.txt", OWNER, OWNER)
    fs = SharedFilesystem(tmp_path / "vol")
    fs.create(content, 64 << 20, (OWNER, OWNER, 0o755))
    root = fs.mount()
    # ganesha's own network namespace and the runtime's host rules with the NFS DNAT to it
    # (a node makes both at its start: runtime/nfs_net.py).
    net = nfs_net.claim(PREFIX, port)
    rt.config.nfs_port, rt.config.nfs_address = port, net.server_address
    env.loop.run(rtnet.setup_host(PREFIX, rt.config.egress_proxy_port,
                                  keep_sources=rt.slots.in_use_addresses(), nfs_port=port,
                                  nfs_address=net.server_address))
    exports = SharedExports(tmp_path / "nfs", port, network=net)
    try:
        yield Nfs(exports, SharedVolume("shared", root, OWNER, OWNER), root)
    finally:
        env.loop.run(exports.close())
        net.remove()
        rt.config.nfs_port, rt.config.nfs_address = None, None
        env.loop.run(rtnet.setup_host(PREFIX, rt.config.egress_proxy_port,
                                      keep_sources=rt.slots.in_use_addresses()))
        fs.remove()


def test_envd_mounts_a_shared_volume(env: Env, nfs: Nfs) -> None:
    from agentenv.guest.build.assets import build_assets
    from agentenv.guest.build.rootfs import busybox_root, make_rootfs_image
    from agentenv.storage.export import import_raw

    assets = build_assets(GUEST_CACHE)
    raw = make_rootfs_image(busybox_root(env.root / "nfsroot"), env.root / "nfsuser.ext4",
                            64 << 20)
    layer = import_raw(raw, env.root / "nfsuser.layer")
    rt = env.runtime
    saved = rt.config.envd_init_path
    rt.config.envd_init_path = "/init"  # the real envd
    mounts = [{"kind": "nfs", "export": "/volumes/shared", "path": "/mnt/shared",
               "readOnly": False}]
    vm: VM | None = None
    try:
        vm = env.loop.run(rt.boot(BootSpec(
            kernel=assets.kernel, initramfs=assets.initramfs, cmdline=assets.cmdline_base,
            memory_mib=256,
            disks=[DiskSource("tools", assets.tools_image.stat().st_size, read_only=True,
                              file=assets.tools_image),
                   DiskSource("rootfs", 64 << 20, layers=[layer])])))
        env.loop.run(nfs.open_for(env, "sbx-1", vm))
        t0 = time.monotonic()
        env.loop.run(rt.envd_init(vm, mounts=mounts))
        print(f"/init with the NFS mount: {time.monotonic() - t0:.2f} s")

        def files(vm: VM) -> httpx.Client:
            return httpx.Client(base_url=vm.envd_url, timeout=60, trust_env=False,
                                params={"username": "root"})

        with files(vm) as c:
            got = c.get("/files", params={"path": "/mnt/shared/host.txt"})
            assert got.status_code == 200 and got.text == "from-host\n", got.text
            put = c.post("/files", params={"path": "/mnt/shared/guest.txt"}, content=b"from-guest\n",
                         headers={"Content-Type": "application/octet-stream"})
            assert put.status_code == 200, put.text
        assert (nfs.root / "guest.txt").read_text() == "from-guest\n"
        assert os.stat(nfs.root / "guest.txt").st_uid == OWNER  # root in the guest, squashed

        # Paused and restored: another slot (another address), let in before the guest runs.
        record = env.loop.run(rt.pause(vm, wait_teardown=True))
        env.loop.run(nfs.exports.detach("sbx-1"))
        vm = None
        (nfs.root / "while-paused.txt").write_text("later\n")

        async def before_start(new: VM) -> None:
            await nfs.open_for(env, "sbx-1", new)

        vm = env.loop.run(rt.restore(record, mounts=mounts, before_start=before_start))
        t0 = time.monotonic()
        with files(vm) as c:
            got = c.get("/files", params={"path": "/mnt/shared/while-paused.txt"})
            assert got.status_code == 200 and got.text == "later\n", got.text
            print(f"first NFS read after the restore: {time.monotonic() - t0:.2f} s")
            put = c.post("/files", params={"path": "/mnt/shared/after.txt"}, content=b"after\n",
                         headers={"Content-Type": "application/octet-stream"})
            assert put.status_code == 200, put.text
        assert (nfs.root / "after.txt").read_text() == "after\n"
    finally:
        rt.config.envd_init_path = saved
        if vm is not None:
            with contextlib.suppress(Exception):
                env.loop.run(rt.kill(vm))


def _spike_only() -> None:
    if os.environ.get("AENV_TEST_NFS_SPIKE") != "1":
        pytest.skip("the fork spike is opt-in: AENV_TEST_NFS_SPIKE=1 (a fork child's NFS hangs)")


def _boot(env: Env) -> VM:
    guest = build_test_guest(extra_modules=("nfsv4",))
    spec = BootSpec(kernel=guest.kernel, initramfs=guest.initramfs, cmdline=guest.cmdline_base,
                    disks=[DiskSource("rootfs", ROOTFS_SIZE, layers=[env.rootfs_layer])],
                    memory_mib=256)
    return env.loop.run(env.runtime.boot(spec))


def test_two_guests_share_a_volume_through_pause_and_fork(env: Env, nfs: Nfs) -> None:
    _spike_only()
    shared = nfs.root
    rt = env.runtime
    a, b = _boot(env), _boot(env)
    vms = [a, b]
    names = {a.id: "a", b.id: "b"}
    try:
        for vm in vms:
            env.loop.run(nfs.open_for(env, names[vm.id], vm))
        mem = "grep -E '^(MemAvailable|Slab|SUnreclaim|Percpu):' /proc/meminfo\n"
        before = env.loop.run(sh(a, mem))
        t0 = time.monotonic()
        for vm in vms:
            out = env.loop.run(sh(vm, MOUNT, timeout=120))
            assert "mounted" in out, out
        mount_s = time.monotonic() - t0
        after = env.loop.run(sh(a, mem + "awk '{s += $2} END {print \"modules\", s}' /proc/modules\n"
                                "cat /proc/mounts | grep nfs4"))
        print(f"two mounts in {mount_s:.1f} s\nbefore:\n{before}after:\n{after}")

        env.loop.run(sh(a, "echo from-a > /mnt/shared/a.txt; sync"))
        assert env.loop.run(sh(b, "cat /mnt/shared/a.txt")) == "from-a\n"
        env.loop.run(sh(b, "echo from-b > /mnt/shared/b.txt; sync"))
        assert env.loop.run(sh(a, "cat /mnt/shared/b.txt")) == "from-b\n"
        assert (shared / "a.txt").read_text() == "from-a\n"
        assert os.stat(shared / "b.txt").st_uid == OWNER  # root in the guest, squashed
        (shared / "host.txt").write_text("from-host\n")  # the content API's side
        assert env.loop.run(sh(b, "cat /mnt/shared/host.txt")) == "from-host\n"
        env.loop.run(sh(a, "chown 0 /mnt/shared/a.txt; chown 1000 /mnt/shared/a.txt"))
        assert os.stat(shared / "a.txt").st_uid == OWNER  # chown does not reach the host

        # Pause A (its QEMU ends), resume it: possibly in another slot, so another address.
        record = env.loop.run(rt.pause(a, wait_teardown=True))
        vms.remove(a)
        env.loop.run(nfs.exports.detach("a"))
        a = env.loop.run(rt.restore(record))
        vms.append(a)
        env.loop.run(nfs.open_for(env, "a", a))
        t0 = time.monotonic()
        out = env.loop.run(sh(a, "cat /mnt/shared/b.txt; echo after-resume > /mnt/shared/c.txt; "
                                 "sync; echo written", timeout=180))
        print(f"first NFS answer after resume: {time.monotonic() - t0:.1f} s")
        assert out == "from-b\nwritten\n", out
        assert env.loop.run(sh(b, "cat /mnt/shared/c.txt")) == "after-resume\n"

        # Fork A into two children: every one reads and writes the volume.
        _, children = env.loop.run(rt.fork(a, 2))
        vms += children
        for i, child in enumerate(children):
            env.loop.run(nfs.open_for(env, f"child-{i}", child))
        for i, child in enumerate(children):
            out = env.loop.run(sh(child, f"cat /mnt/shared/c.txt; echo child-{i} > "
                                         f"/mnt/shared/child-{i}.txt; sync; echo ok", timeout=180))
            assert out == "after-resume\nok\n", (i, out)
        for i in range(2):
            assert env.loop.run(sh(a, f"cat /mnt/shared/child-{i}.txt")) == f"child-{i}\n"
            assert env.loop.run(sh(b, f"cat /mnt/shared/child-{i}.txt")) == f"child-{i}\n"
        out = env.loop.run(sh(a, "echo parent-again > /mnt/shared/p.txt; sync; echo ok",
                              timeout=180))
        assert out == "ok\n", out
        assert (shared / "p.txt").read_text() == "parent-again\n"
        rss = subprocess.run(["ps", "-o", "rss=,nlwp=", "-p", str(nfs.exports.server.pid)],
                             capture_output=True, text=True).stdout
        print(f"ganesha rss KiB, threads: {rss}")
    finally:
        for vm in vms:
            with contextlib.suppress(Exception):
                env.loop.run(rt.kill(vm))
