"""Red team of the node's NFS server (node/nfs.py "Jail"; docs/security.md "Shared volumes"),
after the bare jail of f8ef9a5.

Part 1, a ganesha taken over by a guest (a bug in its NFS parsing, which it runs as root for
every guest that mounts a shared volume): NfsServer starts tests/redteam/ganesha_stand_in.c in
ganesha's place, so the attacker's code runs exactly as ganesha would (the same plan, jail, PID
namespace, network namespace as the node makes it (runtime/nfs_net.py), capabilities,
no_new_privs, seccomp filter, argv, environment), listens on ganesha's port and runs what the
test sends it.

Part 2, a guest against real ganesha (tests/node/nfs41.py as the guest's client; 127.0.0.1 and
127.0.0.2 stand for two sandboxes' guest addresses)."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.node.nfs import NfsExport, NfsServer
from agentenv.runtime import nfs_net
from tests.node.nfs41 import OP_EXCHANGE_ID, Nfs4Error, Nfs41Client, _Packer, unwalled_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="ganesha's jail and VFS FSAL need root")

STAND_IN = Path(__file__).with_name("ganesha_stand_in.c")
_libc = ctypes.CDLL(None, use_errno=True)
_AT_EMPTY_PATH = 0x1000
OP_GETFH, OP_PUTFH, OP_OPEN = 10, 22, 18


def _handle_of_fd(fd: int) -> str:
    """'TYPE HEX' of the file `fd` is open on (name_to_handle_at with AT_EMPTY_PATH)."""
    buf = ctypes.create_string_buffer(struct.pack("=Ii", 128, 0) + b"\0" * 128, 136)
    mount_id = ctypes.c_int()
    if _libc.name_to_handle_at(fd, b"", buf, ctypes.byref(mount_id), _AT_EMPTY_PATH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    size, kind = struct.unpack("=Ii", buf.raw[:8])
    return f"{kind} {buf.raw[8:8 + size].hex()}"


class TakenOver:
    """The stand-in, as ganesha, and a line to it."""

    def __init__(self, server: NfsServer) -> None:
        self.server = server
        self.sock = socket.create_connection((server.bind_addr, server.port), timeout=10)
        self.lines = self.sock.makefile("rw")

    def ask(self, line: str) -> str:
        self.lines.write(line + "\n")
        self.lines.flush()
        answer = self.lines.readline().strip()
        return errno.errorcode.get(int(answer), answer) if answer.isdigit() else answer

    def close(self) -> None:
        self.lines.close()
        self.sock.close()


@pytest.fixture
def taken_over(tmp_path: Path) -> Iterator[TakenOver]:
    if shutil.which("gcc") is None:
        pytest.fail("gcc is missing: the stand-in for a taken-over ganesha is built with it")
    binary = tmp_path / "ganesha.nfsd"
    subprocess.run(["gcc", "-O1", "-o", str(binary), str(STAND_IN)], check=True)
    port = unwalled_port(tmp_path)
    # The node's namespace for ganesha, but open to this test (on the host's end of the link)
    # instead of the slots' guests.
    net = nfs_net.claim("rtnfs", port, clients=(str(nfs_net.LINK_RANGE),))
    srv = NfsServer(tmp_path / "nfs", port=port, binary=str(binary), whole_file_systems=True,
                    network=net)
    try:
        srv.start([])  # its jail was checked (_check_jail): as ganesha's
        line = TakenOver(srv)
        try:
            yield line
        finally:
            line.close()
    finally:
        srv.stop()
        net.remove()


def test_a_taken_over_ganesha_reaches_no_socket_of_the_host(taken_over: TakenOver) -> None:
    """Fixed: ganesha runs in a network namespace of its own (runtime/nfs_net.py); before, in
    the host's, it reached every service of the host (node API, blockd, every sandbox's envd
    at its guest address) and held abstract unix socket names of the host's."""
    # Stand-ins: a service on loopback (the node API, blockd's metrics), one on every address
    # of the host (reached at the host's end of ganesha's link; a non-secure sandbox's envd
    # at its guest address is routed the same way) and an abstract unix socket of the node's.
    service = socket.create_server(("127.0.0.1", 0))
    everywhere = socket.create_server(("0.0.0.0", 0))
    abstract = socket.socket(socket.AF_UNIX)
    name = f"aenv-redteam-{os.getpid()}"
    abstract.bind("\0" + name)
    abstract.listen()
    net = os.open("/proc/self/ns/net", os.O_RDONLY)
    link = taken_over.server.network
    host_end = link.host_address if link is not None else "127.0.0.1"
    try:
        reached = {
            "TCP to a loopback service": taken_over.ask(
                f"tcp 127.0.0.1 {service.getsockname()[1]}"),
            "TCP to the host's end of its link": taken_over.ask(
                f"tcp {host_end} {everywhere.getsockname()[1]}"),
            "an abstract unix socket of the host's": taken_over.ask(f"abstract {name}"),
            "the host's network namespace by handle": taken_over.ask(
                f"handle nsfs {_handle_of_fd(net)}"),
        }
        # the name a runtime holds for its prefix (runtime/network.py): taken while the node
        # is down (ganesha outlives it), the node's runtime would not start. A name ganesha
        # binds is bound in its own namespace only: the host's stays free.
        taken_over.ask(f"bindabstract {name}-taken")
        mine = socket.socket(socket.AF_UNIX)
        try:
            mine.bind(f"\0{name}-taken")
            reached["an abstract name of the host's"] = "free"
        except OSError as exc:
            reached["an abstract name of the host's"] = f"ok ({exc})"
        finally:
            mine.close()
    finally:
        os.close(net)
        service.close()
        everywhere.close()
        abstract.close()
    assert not {what: how for what, how in reached.items()
                if how in ("ok", "opened") or how.startswith("ok ")}, reached


def test_a_taken_over_ganesha_opens_no_host_namespace_process_or_file(
        taken_over: TakenOver) -> None:
    """What held: the host's mount and PID namespaces and the node's processes by handle (nsfs
    and pidfs handles, kernel 6.18: FD_NSFS_ROOT and FD_PIDFS_ROOT need no mount in the jail),
    and writes to its configuration, its root and its exports directory with
    CAP_DAC_OVERRIDE."""
    results = {}
    for ns in ("mnt", "pid"):
        fd = os.open(f"/proc/self/ns/{ns}", os.O_RDONLY)
        try:
            results[f"host {ns} namespace"] = taken_over.ask(f"handle nsfs {_handle_of_fd(fd)}")
        finally:
            os.close(fd)
    pidfd = os.pidfd_open(os.getpid())
    try:
        results["the node's process"] = taken_over.ask(f"handle pidfs {_handle_of_fd(pidfd)}")
    finally:
        os.close(pidfd)
    srv = taken_over.server
    results["its configuration"] = taken_over.ask(f"append {srv.config_path}")
    results["its root"] = taken_over.ask("append /etc/netconfig")
    results["its exports"] = taken_over.ask(f"append {srv.exports_dir}")
    assert results == {"host mnt namespace": "ESTALE", "host pid namespace": "ESTALE",
                       "the node's process": "ESTALE", "its configuration": "EROFS",
                       "its root": "EROFS", "its exports": "EISDIR"}, results
    # and a handle of its own pid namespace's process opens (the probe works)
    own = os.pidfd_open(srv.pid or 0)
    try:
        assert taken_over.ask(f"handle pidfs {_handle_of_fd(own)}") == "opened"
    finally:
        os.close(own)


def test_a_taken_over_ganesha_has_no_io_uring(taken_over: TakenOver) -> None:
    """io_uring, a large kernel surface (and one whose operations no seccomp filter sees), was
    open to ganesha, which uses none of it: now its filter refuses io_uring_setup."""
    assert taken_over.ask("io_uring") == "EPERM"


# -- part 2: a guest against real ganesha ------------------------------------------------------


def _volume(tmp_path: Path, name: str) -> Path:
    """A shared volume's own file system, as node/shared_fs.py makes it."""
    image, mountpoint = tmp_path / f"{name}.ext4", tmp_path / name
    mountpoint.mkdir()
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    subprocess.run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noexec", str(image),
                    str(mountpoint)], check=True, capture_output=True)
    os.chown(mountpoint, 4321, 4321)
    (mountpoint / "data.txt").write_text(f"{name}'s data\n")
    os.chown(mountpoint / "data.txt", 4321, 4321)
    return mountpoint


@pytest.fixture
def two_teams(tmp_path: Path) -> Iterator[tuple[NfsServer, NfsExport, NfsExport]]:
    """Two volumes, each exported to one guest: 127.0.0.1 mounts a, 127.0.0.2 mounts b."""
    if shutil.which("ganesha.nfsd") is None:
        pytest.fail("ganesha.nfsd is missing: run scripts/install-system.sh")
    mounts = []
    srv = NfsServer(tmp_path / "nfs", bind_addr="127.0.0.1", port=unwalled_port(tmp_path),
                    whole_file_systems=True, max_client_ids=8)
    try:
        a, b = (_volume(tmp_path, n) for n in "ab")
        mounts = [a, b]
        exports = (NfsExport(1, a, "/volumes/a", ("127.0.0.1",), 4321, 4321),
                   NfsExport(2, b, "/volumes/b", ("127.0.0.2",), 4321, 4321))
        srv.start(exports)
        yield srv, *exports
    finally:
        srv.stop()
        for mountpoint in mounts:
            subprocess.run(["umount", "-l", str(mountpoint)], check=False, capture_output=True)


def test_a_handle_of_another_team_s_export_opens_nothing(
        two_teams: tuple[NfsServer, NfsExport, NfsExport]) -> None:
    """What held: a guest presenting the file handle of an export it is not a client of (its
    bytes are predictable: export id, ext4's root inode) reads and lists nothing there, and
    does not see that export's pseudo path."""
    srv, _, _ = two_teams
    with Nfs41Client("127.0.0.1", srv.port) as owner:
        u = owner._call([owner._sequence(), *owner._walk("/volumes/a"), (OP_GETFH, b"")])
        owner._skip_results(u, [0x35, 24, 15, 15])
        assert u.u32() == OP_GETFH and u.u32() == 0
        handle = u.opaque()
        assert owner.read("/volumes/a/data.txt") == b"a's data\n"
    with Nfs41Client("127.0.0.1", srv.port, source="127.0.0.2") as other:
        other.read("/volumes/b/data.txt")  # its own export serves it
        assert other.listdir("/volumes") == ["b"]  # the other is not even in its pseudo fs
        with pytest.raises(Nfs4Error):
            other.lookup("/volumes/a")
        put = (OP_PUTFH, _Packer().opaque(handle).bytes())
        lookup = (15, _Packer().opaque(b"data.txt").bytes())
        read = (25, _Packer().u32(0).fixed(b"\0" * 12).u64(0).u32(4096).bytes())
        readdir = (26, _Packer().u64(0).fixed(b"\0" * 8).u32(8192).u32(32768).u32(0).bytes())
        for ops in ([put, lookup, read], [put, readdir]):
            with pytest.raises(Nfs4Error) as refused:
                other._call([other._sequence(), *ops])
            assert refused.value.name in ("NFS4ERR_ACCESS", "NFS4ERR_WRONGSEC",
                                          "NFS4ERR_PERM", "NFS4ERR_STALE", "NFS4ERR_NOENT")


@pytest.mark.xfail(strict=True, reason="Max_Client_Ids bounds all guests together (ganesha "
                   "4.3 has no bound per client address): one guest holding every client id "
                   "keeps every other team's sandbox from mounting its shared volume (report)")
def test_one_guest_cannot_take_the_client_ids_of_all(
        two_teams: tuple[NfsServer, NfsExport, NfsExport]) -> None:
    srv, _, _ = two_teams
    held = []
    try:
        for _ in range(3 * srv.max_client_ids):  # guest a makes client ids (each a new owner)
            try:
                held.append(Nfs41Client("127.0.0.1", srv.port).connect())
            except Nfs4Error:
                break
        assert len(held) >= srv.max_client_ids
        with Nfs41Client("127.0.0.1", srv.port, source="127.0.0.2") as other:
            assert other.read("/volumes/b/data.txt") == b"b's data\n"
    finally:
        for client in held:
            client.close()


def _open_only(client: Nfs41Client, directory: str, name: str, owner: bytes) -> None:
    """OPEN (create) `name` as `owner` and keep it open: an open state, and a descriptor of
    ganesha's (one for each owner that opens the file)."""
    p = _Packer().u32(0).u32(2).u32(0).u64(client.clientid).opaque(owner)
    p.u32(1).u32(0)  # OPEN4_CREATE, UNCHECKED4
    p.u32(2).u32(0).u32(2).opaque(struct.pack(">I", 0o644))  # FATTR4_MODE
    p.u32(0).opaque(name.encode())  # CLAIM_NULL
    client._call([client._sequence(), *client._walk(directory), (OP_OPEN, p.bytes())])


@pytest.mark.xfail(strict=True, reason="ganesha 4.3 bounds no guest's open files: each open "
                   "state holds a descriptor of ganesha's (RLIMIT_NOFILE 20000 here), one "
                   "guest takes them all in about 2 s, and then another team's guest cannot "
                   "even connect (ganesha's accept fails) until the hog's lease ends, never "
                   "while it renews (report)")
def test_one_guest_cannot_take_every_descriptor_of_the_server(
        two_teams: tuple[NfsServer, NfsExport, NfsExport]) -> None:
    srv, _, _ = two_teams
    limit = int(next(line.split()[3] for line in Path(f"/proc/{srv.pid}/limits").read_text()
                     .splitlines() if line.startswith("Max open files")))
    with Nfs41Client("127.0.0.1", srv.port) as hog:
        for i in range(limit + 16):
            try:
                _open_only(hog, "/volumes/a", "data.txt", f"owner{i}".encode())
            except Nfs4Error:
                break
        with Nfs41Client("127.0.0.1", srv.port, source="127.0.0.2") as other:
            other.write("/volumes/b/mine.txt", b"mine\n")
            assert other.read("/volumes/b/mine.txt") == b"mine\n"


def _rss_kb(pid: int) -> int:
    return int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text()
                    .splitlines() if line.startswith("VmRSS:")))


@pytest.mark.xfail(strict=True, reason="ganesha 4.3 (ntirpc) buffers a TCP record whole "
                   "whatever length its record mark announces (up to 2 GiB a connection, "
                   "before any RPC is parsed; MaxRPCRecvBufferSize does not bound it): a guest "
                   "with 8 connections holds 16 GiB of ganesha's memory, past its cgroup's "
                   "512 MiB (OOM, every team's NFS state lost) or the host's (report)")
def test_a_guest_cannot_make_the_server_buffer_a_huge_record(
        two_teams: tuple[NfsServer, NfsExport, NfsExport]) -> None:
    srv, _, _ = two_teams
    pid = srv.pid or 0
    before = _rss_kb(pid)
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    try:
        sock.sendall(struct.pack(">I", 0x80000000 | 0x7FFFFFFF))  # one 2 GiB fragment
        chunk = b"\0" * (1 << 20)
        with pytest.raises(OSError):  # refused (reset) or stalled (the window stays shut)
            for _ in range(128):
                sock.sendall(chunk)
            time.sleep(0.5)
            grown = (_rss_kb(pid) - before) >> 10
            if grown > 32:
                pytest.fail(f"ganesha buffers the record: {grown} MiB more for 128 MiB sent")
            raise OSError("bounded")
    finally:
        sock.close()
    with Nfs41Client("127.0.0.1", srv.port, source="127.0.0.2") as other:  # serves on
        assert other.read("/volumes/b/data.txt") == b"b's data\n"


@pytest.mark.xfail(strict=True, reason="Max_Client_Ids counts confirmed client ids only: "
                   "EXCHANGE_ID without CREATE_SESSION makes unconfirmed records without bound "
                   "(about 1.6 KB each, 14000 a second from one connection, kept for a lease): "
                   "one guest takes ganesha past its cgroup's 512 MiB in well under a lease "
                   "(report)")
def test_unconfirmed_client_ids_are_bounded(
        two_teams: tuple[NfsServer, NfsExport, NfsExport]) -> None:
    srv, _, _ = two_teams
    pid = srv.pid or 0
    before = _rss_kb(pid)
    guest = Nfs41Client("127.0.0.1", srv.port)
    guest.sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    made = 0
    try:
        for _ in range(30000):
            owner = os.urandom(16).hex().encode()
            args = _Packer().fixed(os.urandom(8)).opaque(owner).u32(0x00010000).u32(0).u32(0)
            try:
                guest._call([(OP_EXCHANGE_ID, args.bytes())])
            except Nfs4Error:
                break
            made += 1
    finally:
        guest.close()
    grown = (_rss_kb(pid) - before) >> 10
    assert made <= 16 * srv.max_client_ids and grown < 24, (made, f"{grown} MiB")
