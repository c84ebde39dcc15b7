"""Volumes mounted in real VMs (docs/volumes.md §6), with the official SDK unchanged: one
volume filled through the content API, mounted read-only in three sandboxes at once (the same
bytes in each, one shared read-only blockd device, writes fail with EROFS), read-write in one
(a second is refused, 409) and copy-on-write in another (each its own writes, the volume
untouched); the mounts stay through a pause and resume (memory kept, and filesystem-only: the
guest boots again and mounts again) and go into a fork child by reference; a commit makes the
read-write sandbox's writes the volume's content. A volume mounted `rw-shared` (over NFS,
docs/volumes.md §7.1) in two sandboxes is one volume for both and the content API.

One VM node (network prefix "avo", slots 21001-21200, no ready pool), at most four VMs at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator

import pytest
from e2b import CommandExitException, Sandbox, SandboxException, Volume, VolumeException

from agentenv.blockd.client import BlockdClient
from tests.node import conftest
from tests.node.conftest import NodeProcess
from tests.node.test_cli import aenv_inline

NET_PREFIX = "avo"  # unique: a test teardown deletes every {NET_PREFIX}-s* namespace
FIRST_SLOT = 21001  # 21001-21200: disjoint from the other VM test modules and benches

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]


@pytest.fixture(scope="module")
def volume_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("volumenode")
    node = conftest.vm_node_process(base / "state", base / "node.log", NET_PREFIX, FIRST_SLOT,
                                    {**conftest.NO_READY_POOLS, "AENV_VOLUME_SHARED_RW": "1"})
    with conftest.serving_vm_node(node, NET_PREFIX):
        yield node


def _run(sbx: Sandbox, command: str, user: str = "user") -> str:
    return str(sbx.commands.run(command, user=user, timeout=120).stdout)


def _shared_volume_devices(node: NodeProcess) -> list[tuple[str | None, int]]:
    """(source, users) of the node's blockd devices that are shared read-only volume layers."""
    sock = node.state_dir / "vm-backend" / "blockd" / "blockd.sock"
    with BlockdClient(sock, timeout=10) as client:
        return [(d.source, d.refcount) for d in client.list()
                if d.kind == "shared" and d.source and "/volumes/layers/" in d.source]


def test_volumes_mount_read_only_and_copy_on_write(volume_node: NodeProcess) -> None:
    blob = os.urandom(3 << 20)
    vol = Volume.create("data")
    made: list[Sandbox] = []
    try:
        vol.make_dir("/dataset")
        vol.write_file("/dataset/blob.bin", blob)
        vol.write_file("/hello.txt", "hello from the volume\n")
        vol.update_metadata("/", uid=1000, gid=1000)  # the sandbox's `user` may write (cow)

        # read-only in three sandboxes at once: the same bytes, one shared device
        readers = [Sandbox.create(volume_mounts={"/mnt/data": vol}, timeout=900)
                   for _ in range(3)]
        made += readers
        for sbx in readers:
            assert _run(sbx, "cat /mnt/data/hello.txt") == "hello from the volume\n"
            digest = _run(sbx, "sha256sum /mnt/data/dataset/blob.bin").split()[0]
            assert digest == hashlib.sha256(blob).hexdigest()
            with pytest.raises(CommandExitException) as refused:
                _run(sbx, "echo x > /mnt/data/new.txt", user="root")
            assert "Read-only file system" in refused.value.stderr
            assert Sandbox.get_info(sbx.sandbox_id).volume_mounts == [
                {"name": "data", "path": "/mnt/data"}]
        shared = _shared_volume_devices(volume_node)
        assert len(shared) == 1 and shared[0][1] == 3, shared
        for sbx in readers[1:]:
            sbx.kill()

        # read-write in one (its alone: a second is refused, the content API too) and
        # copy-on-write in another: each sees its own writes; the volume does not change
        writers = [Sandbox.create(volume_mounts={"/mnt/work": f"data:{mode}"}, timeout=900)
                   for mode in ("rw", "cow")]
        made += writers
        with pytest.raises(SandboxException, match=r"409.*read-write by sandbox"):
            Sandbox.create(volume_mounts={"/mnt/work": "data:rw"}, timeout=900)
        with pytest.raises(VolumeException, match=r"409.*read-write by sandbox"):
            vol.write_file("/refused.txt", "x")
        for sbx, who in zip(writers, "AB", strict=True):
            _run(sbx, f"echo {who} > /mnt/work/who.txt")  # the volume's root is user's
            _run(sbx, f"echo {who} >> /mnt/work/hello.txt", user="root")  # a file of root's
        for sbx, who in zip(writers, "AB", strict=True):
            assert _run(sbx, "cat /mnt/work/who.txt") == f"{who}\n"
            assert _run(sbx, "cat /mnt/work/hello.txt") == f"hello from the volume\n{who}\n"
        assert not vol.exists("/who.txt")
        assert vol.read_file("/hello.txt") == "hello from the volume\n"

        # a pause (memory kept) and resume keep the mount and what was written to it
        first = writers[0]
        first.pause()
        first = Sandbox.connect(first.sandbox_id, timeout=900)
        made.append(first)
        assert _run(first, "cat /mnt/work/who.txt") == "A\n"
        assert " /mnt/work " in _run(first, "cat /proc/mounts")

        # a fork child gets the mount by reference: the parent's writes, then its own
        children = [c for c in writers[1].fork(count=1, timeout=600) if isinstance(c, Sandbox)]
        assert len(children) == 1
        made += children
        assert _run(children[0], "cat /mnt/work/who.txt") == "B\n"
        _run(children[0], "echo C > /mnt/work/who.txt")
        assert _run(writers[1], "cat /mnt/work/who.txt") == "B\n"
        assert Sandbox.get_info(children[0].sandbox_id).volume_mounts == [
            {"name": "data", "path": "/mnt/work"}]
        for sbx in children:
            sbx.kill()

        # a commit makes the read-write sandbox's mount the volume's content (only it may
        # commit while it holds the volume); the next mount sees it
        refused = aenv_inline(volume_node, "volume", "commit", writers[1].sandbox_id, "data")
        assert refused.exit_code == 1 and "read-write by sandbox" in str(refused.exception)
        committed = aenv_inline(volume_node, "volume", "commit", first.sandbox_id, "data")
        assert committed.exit_code == 0, committed.output
        assert vol.read_file("/who.txt") == "A\n"
        assert vol.read_file("/hello.txt") == "hello from the volume\nA\n"
        assert vol.read_file("/dataset/blob.bin", format="bytes") == blob
        later = Sandbox.create(volume_mounts={"/mnt/data": vol}, timeout=900)
        made.append(later)
        assert _run(later, "cat /mnt/data/who.txt") == "A\n"
        later.kill()
        first.kill()  # the volume is the content API's again
        vol.write_file("/after.txt", "written once the sandbox ended")

        # a filesystem-only pause: the guest boots again from its disks and mounts again
        reader = readers[0]
        reader.pause(mode="filesystem")
        reader = Sandbox.connect(reader.sandbox_id, timeout=900)
        made.append(reader)
        assert _run(reader, "cat /mnt/data/hello.txt") == "hello from the volume\n"
        with pytest.raises(CommandExitException):
            _run(reader, "touch /mnt/data/new.txt", user="root")
    finally:
        for sbx in made:
            with contextlib.suppress(Exception):  # killed already; the node goes anyway
                sbx.kill()
        Volume.destroy(vol.volume_id)


def test_a_volume_mounted_rw_shared_is_one_volume_for_all(volume_node: NodeProcess) -> None:
    """`rw-shared` (docs/volumes.md §7.1): two sandboxes mount one volume over NFS, each reads
    what the other writes at once, and so does the content API (and they what it writes); a
    pause and resume keeps the mount; a fork or a snapshot of such a sandbox is a 400 naming
    why."""
    vol = Volume.create("shared")
    made: list[Sandbox] = []
    try:
        vol.write_file("/seed.txt", "from the content API\n")
        vol.update_metadata("/", uid=1000, gid=1000)  # every guest acts as 1000 on the host
        a, b = (Sandbox.create(volume_mounts={"/mnt/s": "shared:rw-shared"}, timeout=900)
                for _ in range(2))
        made += [a, b]
        assert _run(a, "cat /mnt/s/seed.txt") == "from the content API\n"
        _run(a, "echo from-a > /mnt/s/a.txt")
        assert _run(b, "cat /mnt/s/a.txt") == "from-a\n"
        _run(b, "echo from-b > /mnt/s/b.txt", user="root")
        assert _run(a, "cat /mnt/s/b.txt") == "from-b\n"
        assert vol.read_file("/a.txt") == "from-a\n" and vol.read_file("/b.txt") == "from-b\n"
        assert vol.get_info("/b.txt").uid == 1000  # the guest's root, squashed
        vol.write_file("/api.txt", "written meanwhile\n")
        assert _run(b, "cat /mnt/s/api.txt") == "written meanwhile\n"
        assert " /mnt/s nfs4 " in _run(a, "cat /proc/mounts")
        assert Sandbox.get_info(a.sandbox_id).volume_mounts == [
            {"name": "shared", "path": "/mnt/s"}]

        with pytest.raises(SandboxException, match="NFS client identity"):
            a.fork(count=1, timeout=600)
        with pytest.raises(SandboxException, match="NFS client identity"):
            a.create_snapshot()

        a.pause()  # its address leaves the export; the resume's (another slot) joins it
        _run(b, "echo while-paused > /mnt/s/c.txt")
        a = Sandbox.connect(a.sandbox_id, timeout=900)
        made.append(a)
        assert _run(a, "cat /mnt/s/c.txt") == "while-paused\n"
        _run(a, "echo after-resume > /mnt/s/d.txt")
        assert _run(b, "cat /mnt/s/d.txt") == "after-resume\n"
    finally:
        for sbx in made:
            with contextlib.suppress(Exception):
                sbx.kill()
        Volume.destroy(vol.volume_id)
