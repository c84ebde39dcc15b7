"""Shared read-write volumes, the spike (docs/volumes.md §7): real guests mount one export of the
node's nfs-ganesha (node/nfs.py) over their network with the kernel's NFSv4 client and busybox
mount, see each other's writes, and keep the mount through pause/resume and in fork children.

The hole in the walls is put here by hand, as the node is to put it for the slots of sandboxes
that mount a shared volume (and only those): the guest reaches 169.254.169.254:2049 (the same
address in every slot, so a restored or forked guest finds its server in whatever slot it wakes
up in); the slot's table accepts that, the host redirects it to ganesha's port and accepts
only redirected flows there.

Opt-in (AENV_TEST_NFS_SPIKE=1) until it passes: with vers=4.1 the shared reads and writes and
pause/resume pass; a fork child's first NFS access hangs (docs/volumes.md §7.1)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.node.nfs import NfsExport, NfsServer
from agentenv.runtime.vm import VM, BootSpec, DiskSource
from agentenv.testing.guest import build_test_guest
from agentenv.testing.harness import sh

from .conftest import PREFIX, ROOTFS_SIZE, Env

pytestmark = pytest.mark.skipif(os.environ.get("AENV_TEST_NFS_SPIKE") != "1",
                                reason="the shared-volume spike is opt-in: AENV_TEST_NFS_SPIKE=1")

NFS_IP = "169.254.169.254"
MOUNT = (
    "for m in $(cat /modules.extra); do insmod /modules/$m 2>/dev/null; done\n"
    "mkdir -p /mnt/shared\n"
    f"mount -t nfs4 -o vers=4.1,proto=tcp,port=2049,addr={NFS_IP},hard,timeo=50 "
    f"{NFS_IP}:/volumes/shared /mnt/shared && echo mounted\n"
)


def _nft(*args: str, netns: str | None = None) -> str:
    cmd = ["nft", "--echo", "--handle", *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _handle(echo: str) -> str:
    return echo.rsplit("# handle", 1)[1].split()[0]


class Hole:
    """The rules a shared mount needs, removed again at the end."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.rules: list[tuple[str | None, str, str, str]] = []  # netns, table, chain, handle
        host = f"{PREFIX}_host"
        self._add(None, f"ip {host}", "slots_pre",
                  f'iifname "{PREFIX}h*" ip daddr {NFS_IP} tcp dport 2049 redirect to :{port}')
        self._add(None, f"ip {host}", "slots_input",
                  f'iifname "{PREFIX}h*" tcp dport {port} ct status dnat accept')

    def _add(self, netns: str | None, table: str, chain: str, rule: str) -> None:
        out = _nft("insert", "rule", *table.split(), chain, rule, netns=netns)
        self.rules.append((netns, table, chain, _handle(out)))

    def open_slot(self, vm: VM) -> None:
        assert vm.slot is not None
        self._add(vm.slot.netns_name, "ip aenv", "egress",
                  f"ip daddr {NFS_IP} tcp dport 2049 accept")

    def close(self) -> None:
        for netns, table, chain, handle in reversed(self.rules):
            with contextlib.suppress(subprocess.CalledProcessError):
                _nft("delete", "rule", *table.split(), chain, "handle", handle, netns=netns)


@pytest.fixture
def nfs(env: Env, tmp_path: Path) -> Iterator[tuple[NfsServer, Hole, Path]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 4321, 4321)
    server = NfsServer(tmp_path / "nfs", bind_addr="0.0.0.0", port=port)
    server.start()
    hole = Hole(port)
    try:
        yield server, hole, shared
    finally:
        hole.close()
        server.stop()


def _boot(env: Env) -> VM:
    guest = build_test_guest(extra_modules=("nfsv4",))
    spec = BootSpec(kernel=guest.kernel, initramfs=guest.initramfs, cmdline=guest.cmdline_base,
                    disks=[DiskSource("rootfs", ROOTFS_SIZE, layers=[env.rootfs_layer])],
                    memory_mib=256)
    return env.loop.run(env.runtime.boot(spec))


def _export(server: NfsServer, shared: Path, vms: list[VM]) -> None:
    clients = tuple(vm.slot.guest_address for vm in vms if vm.slot is not None)
    server.update([NfsExport(1, shared, "/volumes/shared", clients, 4321, 4321)])


def test_two_guests_share_a_volume_through_pause_and_fork(
        env: Env, nfs: tuple[NfsServer, Hole, Path]) -> None:
    server, hole, shared = nfs
    rt = env.runtime
    a, b = _boot(env), _boot(env)
    vms = [a, b]
    try:
        for vm in vms:
            hole.open_slot(vm)
        _export(server, shared, vms)
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
        assert os.stat(shared / "b.txt").st_uid == 4321  # root in the guest, squashed
        (shared / "host.txt").write_text("from-host\n")  # the content API's side
        assert env.loop.run(sh(b, "cat /mnt/shared/host.txt")) == "from-host\n"
        env.loop.run(sh(a, "chown 0 /mnt/shared/a.txt; chown 1000 /mnt/shared/a.txt"))
        assert os.stat(shared / "a.txt").st_uid == 4321  # chown does not reach the host

        # Pause A (its QEMU ends), resume it: possibly in another slot, so another address.
        record = env.loop.run(rt.pause(a, wait_teardown=True))
        vms.remove(a)
        a = env.loop.run(rt.restore(record))
        vms.append(a)
        hole.open_slot(a)
        _export(server, shared, vms)
        t0 = time.monotonic()
        out = env.loop.run(sh(a, "cat /mnt/shared/b.txt; echo after-resume > /mnt/shared/c.txt; "
                                 "sync; echo written", timeout=180))
        print(f"first NFS answer after resume: {time.monotonic() - t0:.1f} s")
        assert out == "from-b\nwritten\n", out
        assert env.loop.run(sh(b, "cat /mnt/shared/c.txt")) == "after-resume\n"

        # Fork A into two children: every one reads and writes the volume.
        _, children = env.loop.run(rt.fork(a, 2))
        vms += children
        for child in children:
            hole.open_slot(child)
        _export(server, shared, vms)
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
        rss = subprocess.run(["ps", "-o", "rss=,nlwp=", "-p", str(server.pid)],
                             capture_output=True, text=True).stdout
        print(f"ganesha rss KiB, threads: {rss}")
    finally:
        for vm in vms:
            with contextlib.suppress(Exception):
                env.loop.run(rt.kill(vm))
