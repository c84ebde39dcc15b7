"""ganesha's jail against a ganesha taken over by a guest (node/nfs.py "Jail"; docs/security.md,
"Shared volumes"): ganesha keeps CAP_DAC_READ_SEARCH and open_by_handle_at, so every mount in
its namespace hands it every inode of the file system that mount is on. With real nfs-ganesha
started by NfsServer and a shared volume as the node makes it (its own ext4 image,
loop-mounted), from inside ganesha's mount namespace: every mount is a tmpfs, its proc, or the
volume's ext4; and the open_by_handle_at attack (tests/node/handle_attack.py, with ganesha's
capabilities only) reaches no host file through any of them, only the volume through its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.node.nfs import KEEP_CAPS, NfsError, NfsExport, NfsServer
from tests.node import handle_attack
from tests.node.nfs41 import Nfs41Client, unwalled_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="ganesha's VFS FSAL needs root (open_by_handle_at)")

ATTACK = Path(handle_attack.__file__)


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    """A shared volume's file system as node/shared_fs.py makes it: an ext4 image of its own,
    loop-mounted nosuid,nodev,noexec, its root owned by the volume's owner."""
    image, mountpoint = tmp_path / "fs.ext4", tmp_path / "fs"
    mountpoint.mkdir()
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    subprocess.run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noexec", str(image),
                    str(mountpoint)], check=True, capture_output=True)
    try:
        os.chown(mountpoint, 4321, 4321)
        (mountpoint / "data.txt").write_text("volume data\n")
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False, capture_output=True)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NfsServer]:
    if shutil.which("ganesha.nfsd") is None:
        pytest.fail("ganesha.nfsd is missing: run scripts/install-system.sh")
    srv = NfsServer(tmp_path / "nfs", bind_addr="127.0.0.1", port=unwalled_port(tmp_path),
                    whole_file_systems=True)  # as the node's (node/nfs_exports.py)
    try:
        yield srv
    finally:
        srv.stop()


def _relative_to_its_fs(path: Path) -> str:
    """`path` relative to the root of the file system it is on (the host's mountinfo)."""
    real = os.path.realpath(path)
    best, root = "", "/"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4]
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, root = point, fields[3]
    return os.path.join(root, real[len(best):].lstrip("/")).lstrip("/")


def _mountinfo(pid: int) -> list[tuple[str, str, str, str]]:
    entries = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        entries.append((fields[4], fields[sep + 1], fields[sep + 2], fields[3]))
    return entries


def test_ganesha_s_mounts_and_handles_reach_no_host_file(
        server: NfsServer, volume: Path, tmp_path: Path) -> None:
    # Stand-ins for what an attacker wants: the node's database (on the node's state file
    # system, beside ganesha's directories) and a file of the host's root file system.
    secret = tmp_path / "node.db"
    secret.write_text("the node's secrets\n")
    host_files = {"node.db": secret, "hostname": Path("/etc/hostname")}
    export = NfsExport(1, volume, "/volumes/v", ("127.0.0.1",), 4321, 4321)
    server.start([export])
    pid = server.pid
    assert pid is not None
    with Nfs41Client("127.0.0.1", server.port) as client:  # it serves from its jail
        assert client.read("/volumes/v/data.txt") == b"volume data\n"
    published = str(server.published(export))

    # 1. Every mount in its namespace is a tmpfs, its proc, or the volume's own ext4.
    mounts = _mountinfo(pid)
    loop = next(src for point, kind, src, _ in mounts if point == published)
    assert loop.startswith("/dev/loop"), mounts
    for point, kind, source, root in mounts:
        if point == published:
            assert (kind, source, root) == ("ext4", loop, "/"), (point, kind, source)
        else:
            assert kind in ("tmpfs", "proc"), f"{point} is {kind} from {source} ({root})"

    # ...and so is every file it holds open (a descriptor is a mount_fd too): its stdin and
    # stdout are the jail's /dev/null, not the host's
    allowed = {os.stat(f"/proc/{pid}/root{point}").st_dev for point, *_ in mounts}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.split(":", 1)[0] in ("pipe", "socket", "anon_inode"):
            continue
        assert os.stat(f"/proc/{pid}/fd/{fd}").st_dev in allowed, (fd, target)

    # 2. The attack, with each of those mounts as mount_fd.
    spec = {"targets": {name: _relative_to_its_fs(path) for name, path in host_files.items()},
            "handles": {name: handle_attack.handle_of(str(path))
                        for name, path in host_files.items()},
            "caps": sorted(KEEP_CAPS)}
    run = subprocess.run([sys.executable, str(ATTACK), str(pid), json.dumps(spec)],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    results: dict[str, dict[str, str]] = json.loads(run.stdout)
    assert set(results) == {point for point, *_ in mounts}
    reached = {f"{point}: {what}": outcome for point, attempts in results.items()
               for what, outcome in attempts.items() if outcome.startswith("read:")}
    assert not reached, f"host files reached from ganesha's namespace: {reached}"
    # The volume's own file system: its root opens (that is what the VFS FSAL does), and it
    # holds nothing of the host's.
    assert results[published]["forged root"] == "opened"
    with Nfs41Client("127.0.0.1", server.port) as client:  # and it still serves
        client.write("/volumes/v/after.txt", b"after\n")
    assert (volume / "after.txt").read_bytes() == b"after\n"


def test_a_directory_of_a_host_file_system_is_not_exported(tmp_path: Path, volume: Path) -> None:
    """The node's server exports only roots of file systems of their own (a shared volume's):
    a directory of another file system (or of a bind of one) is refused before ganesha sees
    it; a subdirectory of the volume's own file system is served."""
    if shutil.which("ganesha.nfsd") is None:
        pytest.fail("ganesha.nfsd is missing: run scripts/install-system.sh")
    plain = tmp_path / "plain"
    (volume / "sub").mkdir()
    plain.mkdir()
    srv = NfsServer(tmp_path / "nfs", bind_addr="127.0.0.1", port=unwalled_port(tmp_path),
                    whole_file_systems=True)
    try:
        bound = tmp_path / "bound"  # a bind of the host's directory: its root is not "/"
        bound.mkdir()
        subprocess.run(["mount", "--bind", str(plain), str(bound)], check=True)
        try:
            for path in (plain, bound):
                with pytest.raises(NfsError, match="not on a file system of its own"):
                    srv.start([NfsExport(1, path, "/volumes/v", ("127.0.0.1",), 4321, 4321)])
                assert not srv.running()
        finally:
            subprocess.run(["umount", str(bound)], check=True)
        # a directory of the volume's own file system (the node exports its data/)
        srv.start([NfsExport(1, volume / "sub", "/volumes/v", ("127.0.0.1",), 4321, 4321)])
        srv.stop()
        srv.start([NfsExport(1, volume, "/volumes/v", ("127.0.0.1",), 4321, 4321)])
        with Nfs41Client("127.0.0.1", srv.port) as client:
            assert client.read("/volumes/v/data.txt") == b"volume data\n"
    finally:
        srv.stop()
