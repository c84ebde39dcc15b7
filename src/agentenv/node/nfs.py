"""The node's NFSv4 server for shared read-write volumes: one nfs-ganesha process (VFS FSAL) with
a generated configuration, one export per shared volume directory, each reachable only from the
addresses of the sandboxes that mount it (docs/volumes.md §7).

Why ganesha: the hosts we run on (and CI) have no kernel NFS server (no nfsd module, none in
/proc/filesystems), and virtiofs or 9p would block QEMU migration, which pause, fork and
restore are made of; an NFS client in the guest talks over its network and is carried through a
snapshot like any other connection.

What the configuration says and why:

- NFSv4 over TCP only (`Protocols = 4`, no UDP, no NLM, no RQUOTA): NFSv4 needs one port and
  neither rpcbind, mountd nor statd. Ganesha still tries to register with rpcbind at start
  ("Cannot register NFS V4 on TCP" in its log) and goes on without it.
- NFSv4.1 only (`Minor_Versions = 1`): guests mount `vers=4.1` (sessions; no callback
  connection to the guest), so 4.0's separate code paths (SETCLIENTID, open owners' seqids)
  are not offered to them; a 4.0 client gets NFS4ERR_MINOR_VERS_MISMATCH. Not 4.2: ganesha
  4.3's 4.2 is partial, and the guest kernel's 4.2 client (READ_PLUS) read a file another
  guest had just written as NUL bytes of the right length.
- `Graceless`: no 90 s grace period after a start, in which every open would wait. No client
  state survives a restart of the server anyway (a client reclaiming after it gets
  NO_GRACE and its open files fail; new opens work).
- Numeric owners only: guests and host share no user database; uids travel as numbers.
- Client state (`Max_Client_Ids = MAX_CLIENT_IDS`, `Lease_Lifetime = 60`): a guest can make
  NFSv4 client ids without end (EXCHANGE_ID with a fresh owner), each a few KB of ganesha's
  memory and a recovery record; past the bound EXCHANGE_ID gets NFS4ERR_RESOURCE and clients
  holding one are served on. ganesha 4.3 bounds only all clients together, not one guest's:
  a guest that takes them all and renews them keeps others from mounting until it stops.
  The records are in the jail's capped `run/` tmpfs (RUN_SIZE, RUN_INODES).
- Every export `All_Squash` to the owner of its directory (`NfsExport.anon_uid/anon_gid`):
  root and the user in every sandbox act on the host as that one unprivileged owner, so a
  guest makes neither setuid-root files nor devices on the host, and files written by one
  sandbox's root are writable by another's user. `chown` in the guest fails (EPERM).
- An export lists its clients (`CLIENT { Clients = ...; Access_Type = RW }`) and is closed to
  everyone else (`Access_Type = None`): a client not listed does not even see it in the pseudo
  file system (NFS4ERR_NOENT at mount).

Jail (review of 2026-12-07: ganesha parses every guest's NFS bytes, as root). ganesha starts
as PID 1 of a PID namespace of its own (it sees and signals no process of the node), in a bare
jail of runtime/jail.py (`plan_bare_jail`: own mount, IPC and UTS namespaces, a tmpfs root,
pivot_root). Bare, because ganesha keeps CAP_DAC_READ_SEARCH and open_by_handle_at: with any
mount in its namespace as mount_fd it opens any inode of that mount's file system by a forged
handle (the "shocker" attack; measured on the jail before this one, which bound /usr, /etc
files, `conf/`, `run/` and `exports/` from the host's disks: /etc/hostname and a file beside
the node's state read through each of them). So nothing in its namespace is of a host file
system but each volume's own ext4 (node/shared_fs.py), and every other mount is a tmpfs
instance (a superblock of its own: a handle on it reaches only it) or its proc (no handles):

- `/`: the jail's tmpfs (read-only after the start), holding copies of the program, the
  plugins it dlopens (JAIL_PLUGINS: the VFS FSAL, libnfsidmap's nsswitch), their libraries
  (`ldd`: runtime/jail.py `library_closure`) and JAIL_FILES, at the paths the loader finds
  them (measured with strace -f: nothing else is opened at start); /lib and /lib64 as the
  host's symlinks. About 10 MB, copied at each start (charged to ganesha's cgroup).
- `/dev`: a tmpfs of its own holding /dev/null and /dev/urandom made with mknod, then
  read-only (every other mount is nodev; ganesha has no CAP_MKNOD). Its stdin and stdout are
  reopened there before exec: a descriptor of the host's /dev/null would be a mount_fd on the
  host's devtmpfs. Its stderr is a pipe.
- `conf/`: a tmpfs the node mounts on the host (CONF_TMPFS, 16 MB at most) and writes the
  configuration into before the start and each reload; bound read-only into the jail.
- `exports/`: a tmpfs the node mounts on the host (EXPORTS_TMPFS), a shared mount, bound
  read-only (ganesha cannot plant a symlink there for the node to mount on) and a slave in
  the jail: each export is a bind of the volume's file system root at `exports/<export id>`,
  made on the host before the reload that adds it (and unmounted after the one that drops it),
  and it appears in ganesha's namespace by propagation.
- `run/`: a tmpfs made in the jail (RUN_SIZE, RUN_INODES): its pid file and the NFSv4
  recovery records; nothing of it on the node's disk.

`start` reads ganesha's mountinfo after it listens and refuses to serve from a jail with any
other mount (`_check_jail`); a bare jail refuses to bind a source that is not a tmpfs. The
node's server (`whole_file_systems`, node/nfs_exports.py) exports only directories of a whole
file system of a loop device (a volume's image; the node exports its `data/`): a directory of
another file system, or of a bind of one, is refused before it is bound.
tests/node/test_nfs_jail.py runs the attack with ganesha's capabilities from inside its mount
namespace: no host file is reached through any mount but the volume's, and through that one
only the volume.

Network (red team of 2026-12-07: in the host's network namespace a ganesha taken over connected to
the host's loopback services, its abstract unix sockets, and every sandbox's envd at its guest
address; tests/redteam/test_nfs_server_escape.py). The node's ganesha runs in a network namespace
of its own (runtime/nfs_net.py, `NfsServer(network=...)`): one veth pair to the host on a /31 of
10.11/16, nothing routed there but the link and the guests' range (10.12/16), and its nftables
take only new TCP to its address and port from the guests' range and the packets of those
connections; everything else in or out is refused (what it sends at once, by a reset: its
rpcbind registration at start fails instead of hanging) but its own loopback, where nothing
listens but itself. No IPv6, no forwarding; the abstract unix sockets it sees are its
namespace's own. The namespace is made (a leftover remade) at each
`start`, before ganesha, which enters it in its child before the jail (setns), and removed at
`stop`; the node claims its link at start (runtime/nfs_net.py `claim`: the /31 its leftover had
when still free). The slots' NFS redirect is a DNAT to its address (runtime/network.py
`host_ruleset`, `nfs_address`): the guest's address stays the source, as the exports' client
lists need. ganesha 4.3 listens on every address of its namespace whatever `Bind_addr` says
(its socket is `*:port`); its namespace's input rules take only its link address. Without
`network` (tests of ganesha itself) it runs in the host's namespace, listening there.

Capabilities. They are cut to KEEP_CAPS before exec (the bounding set: root keeps only these
across it): CAP_DAC_READ_SEARCH (open_by_handle_at, which the VFS FSAL is made of), CAP_SETUID and
CAP_SETGID (it acts on files as the squashed owner), CAP_DAC_OVERRIDE, CAP_FOWNER and
CAP_CHOWN (it opens files and sets their attributes as root after checking the client's rights
itself: without them a write to a 0644 file, a chmod by the owner, or a guest's chown, which
ganesha squashes to the owner the file has already and envd makes after every upload, fails;
measured), CAP_NET_BIND_SERVICE (its port). Not CAP_SYS_ADMIN, CAP_FSETID, CAP_KILL,
CAP_SYS_PTRACE, CAP_NET_ADMIN, CAP_MKNOD or any other. It cannot run as the squash uid
instead: exports squash to different owners, and open_by_handle_at needs CAP_DAC_READ_SEARCH
whatever the uid. Then no_new_privs, no core dumps, and a seccomp filter (runtime/qemu.py
`jail_filter`: no namespaces, mounts, ptrace, BPF, keyrings, modules...; it keeps
open_by_handle_at and name_to_handle_at, and refuses io_uring too: GANESHA_DENIED). It runs
in a cgroup of its own with a memory and task limit when the node has cgroups
(`cgroup_procs`).

Port. Below 1024 (`start` refuses another). None at all when the rw-shared mode is off
(`node_nfs_port`: nothing walled, redirected or claimed on the host). The default
(`stable_port`) skips ports another node of the host claims (PORT_CLAIMS: a file per port naming
the claiming node's state directory, live while that state keeps the port) or walls
(`walled_ports`), so two nodes on one host never pick the same one. After ganesha listens,
`start` checks that every listening socket on the port in its network namespace is ganesha's.
With its own namespace (the node's), these rules are kept but carry less: nothing else runs in
that namespace to take the port, so the privileged port and the host-wide claim no longer
guard ganesha's port (two nodes' servers have different addresses); the claim still keeps two
nodes from walling the same port on the host (the host's input wall on it is kept, though
nothing of the host listens there), and the checks of the host's listeners and of
`net.ipv4.ip_unprivileged_port_start` (made for a ganesha listening in the host's namespace,
where a local user could take the port while it restarts) apply only without `network`.

Log and reloads. ganesha logs to its stderr, a pipe the node reads (`_LogSink`): written to
`ganesha.log` up to LOG_CAP bytes, then rotated to `ganesha.log.1`, so it takes at most twice
that whatever ganesha writes; the last lines stay in memory for error messages. When the node
dies, ganesha's writes to the pipe fail with EPIPE (every thread of it blocks SIGPIPE,
measured) and it serves on until the node's next start ends it (`reap_leftover`). Exports change
with `update`: the configuration file is rewritten, then SIGHUP (ganesha 4.x rereads its
exports, adds, removes and changes client lists in place). A reload is judged from ganesha's
own signal thread: its "Received SIGHUP" line, then its "Reread exports complete" line, each
matched whole with its thread and function (`[sigmgr] reread_exports`) as the lines arrive
after our signal, never by counting a substring in the whole file; an error that thread logs
between the two (an export it could not make) fails the update. A probe mount would be a
stronger test but cannot be made: ganesha's namespace takes connections from the guests' range
only (and in the host's namespace, the host's input wall resets every connection to the port
that the slots' redirect did not make), the node's own. `stop` is SIGTERM (ganesha exits in
about 1.5 s), then SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import ipaddress
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from agentenv.runtime import jail
from agentenv.runtime.errors import NetworkError, RuntimeError_
from agentenv.runtime.nfs_net import NfsNet
from agentenv.runtime.qemu import SeccompProgram, jail_filter

GANESHA = "ganesha.nfsd"
DEFAULT_PORT = 2049
PRIVILEGED_PORTS = 1024
# ganesha's signal thread's lines, whole and from their start (date, epoch, host, then the
# thread): a SIGHUP received, a reload done, and what it says went wrong between the two (an
# export it could not make). Anchored, so words of the signal thread inside another line (which
# may carry text a guest chose) never count.
_SIGMGR = (r"^\d\d/\d\d/\d{4} \d\d:\d\d:\d\d : epoch [0-9a-f]+ : [^:]* : "
           r"ganesha\.nfsd-\d+\[sigmgr\] ")
SIGHUP_LINE = re.compile(_SIGMGR + r"sigmgr_thread :MAIN :EVENT :SIGHUP_HANDLER: Received SIGHUP")
RELOAD_LINE = re.compile(_SIGMGR + r"reread_exports :\S+ :EVENT :Reread exports complete$")
RELOAD_ERROR = re.compile(_SIGMGR + r"\S+ :[^:]+ :(CRIT|MAJ|FATAL) :")
LOG_CAP = 1 << 20  # bytes of ganesha.log before it becomes ganesha.log.1
LINE_CAP = 4096
TAIL_LINES = 200
# What ganesha opens of the host's files at start besides its program and libraries (measured
# with strace -f): the loader's cache, libntirpc's netconfig; copied into its jail.
JAIL_FILES = ("/etc/ld.so.cache", "/etc/netconfig")
# The libraries ganesha dlopens (its VFS FSAL; libnfsidmap's nsswitch plugin), wherever the
# distribution puts them (Debian: /usr/lib/<triplet>/...).
JAIL_PLUGINS = ("/usr/lib/*/ganesha/libfsalvfs.so", "/usr/lib*/ganesha/libfsalvfs.so",
                "/usr/lib/*/libnfsidmap/nsswitch.so", "/usr/lib*/libnfsidmap/nsswitch.so")
JAIL_DEVICES = (jail.Device("/dev/null", 1, 3), jail.Device("/dev/urandom", 1, 9))
# The tmpfs instances of ganesha's files: its configuration (the node's, read-only inside), the
# exports' mount points, and `run/` (its pid file, the NFSv4 recovery records: made in the jail).
CONF_TMPFS = "size=16m,nr_inodes=64,mode=0700"  # ganesha.conf: about 400 bytes an export
EXPORTS_TMPFS = "size=1m,nr_inodes=65600,mode=0700"
RUN_SIZE, RUN_INODES = 16 << 20, 4096
# NFSv4 client ids ganesha holds at once, all guests together (module doc, "Client state").
MAX_CLIENT_IDS = 1024
LEASE_LIFETIME = 60  # seconds a client id lives without a renewal
# ganesha finds the exports' file systems in /etc/mtab (its namespace's, through its proc).
JAIL_LINKS = (("/etc/mtab", "../proc/self/mounts"),)
# The system calls of runtime/qemu.py's JAIL_DENIED that ganesha's VFS FSAL is made of.
GANESHA_SYSCALLS = frozenset({"open_by_handle_at", "name_to_handle_at"})
# ...and what ganesha never calls but a ganesha taken over would reach the kernel through:
# io_uring (a large surface, and its operations pass no seccomp filter; ganesha 4.3 and its
# libraries use none of it: no liburing, no io_uring in them).
GANESHA_DENIED = frozenset({"io_uring_setup", "io_uring_enter", "io_uring_register"})
# The capabilities ganesha keeps (module doc, "Jail"); every other one leaves its bounding set.
CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER = 0, 1, 2, 3
CAP_SETGID, CAP_SETUID, CAP_NET_BIND_SERVICE = 6, 7, 10
KEEP_CAPS = frozenset({CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER,
                       CAP_SETGID, CAP_SETUID, CAP_NET_BIND_SERVICE})
_libc = ctypes.CDLL(None, use_errno=True)
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CLONE_NEWNET = 0x40000000
_PSEUDO = re.compile(r"^(/[A-Za-z0-9._-]+)+$")
# What may appear inside a quoted configuration string: no quote, backslash, newline or brace.
_UNSAFE = re.compile(r'["\\\n\r{};#\x00]')


class NfsError(Exception):
    pass


@dataclass(frozen=True)
class NfsExport:
    """One shared volume directory. `clients` are the IPv4 addresses the server sees the
    mounting sandboxes connect from (their slots' guest addresses)."""

    export_id: int  # 1..65535; 0 is ganesha's pseudo root
    path: Path
    pseudo: str  # where clients mount it, e.g. /volumes/<id>
    clients: tuple[str, ...]
    anon_uid: int
    anon_gid: int

    def validate(self) -> None:
        if not 1 <= self.export_id <= 65535:
            raise NfsError(f"export id {self.export_id} is not in 1..65535")
        if not self.path.is_absolute() or _UNSAFE.search(str(self.path)):
            raise NfsError(f"export path {str(self.path)!r} must be absolute and plain")
        if not _PSEUDO.match(self.pseudo):
            raise NfsError(f"pseudo path {self.pseudo!r} must be /name[/name...]")
        for uid in (self.anon_uid, self.anon_gid):
            # 0 would make every client root on the exported file system
            if not 0 < uid < 2**32 - 1:
                raise NfsError(f"anonymous id {uid} is out of range (1 to 2^32-2: never root)")
        for client in self.clients:
            try:
                ipaddress.IPv4Address(client)
            except ValueError:
                raise NfsError(f"client {client!r} is not an IPv4 address") from None


def render_config(exports: Iterable[NfsExport], *, bind_addr: str, port: int,
                  recovery_root: Path, max_client_ids: int = MAX_CLIENT_IDS) -> str:
    """ganesha.conf for these exports. An export without clients is left out."""
    ipaddress.IPv4Address(bind_addr)
    if not 0 < max_client_ids < 2**32:
        raise NfsError(f"max_client_ids {max_client_ids} is not in 1..2^32-1 (0 is no limit)")
    if _UNSAFE.search(str(recovery_root)):
        raise NfsError(f"recovery directory {str(recovery_root)!r} is not plain")
    exports = list(exports)
    ids = [e.export_id for e in exports]
    pseudos = [e.pseudo for e in exports]
    if len(set(ids)) != len(ids) or len(set(pseudos)) != len(pseudos):
        raise NfsError("export ids and pseudo paths must be unique")
    parts = [
        "NFS_CORE_PARAM {",
        "  Protocols = 4;",
        f"  NFS_Port = {int(port)};",
        f"  Bind_addr = {bind_addr};",
        "  Enable_NLM = false;",
        "  Enable_RQUOTA = false;",
        "  Enable_UDP = false;",
        "}",
        "NFSV4 {",
        "  Minor_Versions = 1;",
        "  Graceless = true;",
        f"  Lease_Lifetime = {LEASE_LIFETIME};",
        f"  Max_Client_Ids = {int(max_client_ids)};",
        "  RecoveryBackend = fs;",
        f'  RecoveryRoot = "{recovery_root}";',
        "  Allow_Numeric_Owners = true;",
        "  Only_Numeric_Owners = true;",
        "}",
        "NFS_KRB5 { Active_krb5 = false; }",
        "EXPORT_DEFAULTS { Access_Type = None; }",
        "LOG { Default_Log_Level = EVENT; }",
    ]
    for export in exports:
        export.validate()
        if not export.clients:
            continue
        parts += [
            "EXPORT {",
            f"  Export_Id = {export.export_id};",
            f'  Path = "{export.path}";',
            f'  Pseudo = "{export.pseudo}";',
            "  Protocols = 4;",
            "  Transports = TCP;",
            "  SecType = sys;",
            "  Access_Type = None;",
            "  Squash = All_Squash;",
            f"  Anonymous_Uid = {export.anon_uid};",
            f"  Anonymous_Gid = {export.anon_gid};",
            "  FSAL { Name = VFS; }",
            "  CLIENT {",
            f"    Clients = {', '.join(export.clients)};",
            "    Access_Type = RW;",
            "    Protocols = 4;",
            "  }",
            "}",
        ]
    return "\n".join(parts) + "\n"


def _known_service(port: int) -> bool:
    try:
        socket.getservbyport(port, "tcp")
    except OSError:
        return False
    return True


UNPRIVILEGED_PORT_START = Path("/proc/sys/net/ipv4/ip_unprivileged_port_start")


def unprivileged_port_start() -> int:
    """The lowest port any local user may bind in this network namespace (1024 unless the
    host lowered it: container runtimes set it to 0)."""
    try:
        return int(UNPRIVILEGED_PORT_START.read_text().strip())
    except (OSError, ValueError):
        return PRIVILEGED_PORTS


# Host-wide claims of NFS ports, one file per port naming the state directory of the node that
# keeps it (on /run: gone at reboot, as the walls are): two nodes on a host never pick the same.
PORT_CLAIMS = Path("/run/aenv/nfs-ports")
_WALL = re.compile(r"tcp dport (\d+) ct status")


def walled_ports() -> set[int]:
    """The ports a node's host rules wall on this host (runtime/network.py `host_ruleset`:
    every connection to its NFS port that a slot's redirect did not make is reset)."""
    try:
        rules = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True,
                               timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {int(port) for port in _WALL.findall(rules)}


def _claimant(claims: Path, port: int) -> Path | None:
    """The state directory whose node keeps `port` (its claim, and its `port` file still
    names it), else None (no claim, or a stale one)."""
    try:
        owner = Path((claims / str(port)).read_text().strip())
        if int((owner / "port").read_text().strip()) == port:
            return owner
    except (OSError, ValueError):
        pass
    return None


def _claim(claims: Path, port: int, state_dir: Path) -> bool:
    """Claim `port` for `state_dir` (or keep its claim); False when another node holds it."""
    owner = _claimant(claims, port)
    if owner is not None and owner.resolve() != state_dir.resolve():
        return False
    claims.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = claims / f".{port}.{os.getpid()}.tmp"
    tmp.write_text(f"{state_dir.resolve()}\n")
    os.replace(tmp, claims / str(port))
    return True


def stable_port(state_dir: Path, first: int = PRIVILEGED_PORTS - 1, last: int = 600,
                claims: Path = PORT_CLAIMS) -> int:
    """The node's NFS port: the one kept in `<state_dir>/port`, else the first port from
    `first` down to `last` that no socket is bound to, /etc/services names no service for, no
    node walls (`walled_ports`) and no other node of the host claims (`claims`), kept there
    from then on (the same port at every start of the node: the slots' redirect and the
    guests' reconnects after a restart find it). A kept port another node claimed meanwhile
    is given up for a new one."""
    state_dir = Path(state_dir)
    kept = state_dir / "port"
    with contextlib.suppress(OSError, ValueError):
        port = int(kept.read_text().strip())
        if 0 < port < PRIVILEGED_PORTS and _claim(claims, port, state_dir):
            return port
    walled = walled_ports()
    # only ports no local user may bind (`start` refuses the others)
    for port in range(min(first, unprivileged_port_start() - 1), last - 1, -1):
        if _known_service(port) or port in walled or listeners(port) or \
                _claimant(claims, port) is not None:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name("port.tmp")
        tmp.write_text(f"{port}\n")
        os.replace(tmp, kept)
        if not _claim(claims, port, state_dir):
            continue  # another node claimed it just now
        return port
    raise NfsError(f"no free TCP port in {last}..{first} for the NFS server (set AENV_NFS_PORT "
                   "to one below 1024)")


def node_nfs_port(state_dir: Path, *, shared_rw: bool, configured: int | None,
                  claims: Path = PORT_CLAIMS) -> int | None:
    """The port of the node's NFS server, or None when the rw-shared mode is off: then the node
    has no NFS server, and its host rules neither redirect to nor wall a port."""
    if not shared_rw:
        return None
    port = configured or stable_port(state_dir, claims=claims)
    if port >= PRIVILEGED_PORTS:
        raise NfsError(f"AENV_NFS_PORT={port}: the NFS server's port must be below "
                       f"{PRIVILEGED_PORTS} (a local user could take another while ganesha "
                       "restarts)")
    return port


def _socket_inodes(pid: int) -> set[str] | None:
    owned: set[str] = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                owned.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
    except OSError:
        return None
    return owned


def listeners(port: int, net: str = "/proc/net") -> list[str]:
    """The inodes (`socket:[N]`) of this network namespace's TCP sockets listening on `port`
    (any address); with `net` /proc/<pid>/net, those of that process's network namespace."""
    found = []
    for table in (f"{net}/tcp", f"{net}/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is ADDR:PORT in hex; state 0A is LISTEN
            if len(fields) > 9 and fields[3] == "0A" and \
                    int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.append(f"socket:[{fields[9]}]")
    return found


def listening(port: int, pid: int | None = None) -> bool:
    """Whether a TCP socket of this network namespace listens on `port` (any address); with
    `pid`, one of that process's, in its network namespace (another program holding the port
    is not ganesha)."""
    found = listeners(port, f"/proc/{pid}/net" if pid is not None else "/proc/net")
    if pid is None:
        return bool(found)
    owned = _socket_inodes(pid)
    return owned is not None and any(inode in owned for inode in found)


def foreign_listeners(port: int, pid: int) -> list[str]:
    """Sockets listening on `port` in `pid`'s network namespace that are not `pid`'s (a
    squatter beside or before it)."""
    owned = _socket_inodes(pid) or set()
    return [inode for inode in listeners(port, f"/proc/{pid}/net") if inode not in owned]


def _published_mounts(directory: Path) -> dict[str, str]:
    """What is mounted directly under `directory` (name -> the mount's root within its file
    system), from the node's mountinfo."""
    prefix = str(directory) + "/"
    found = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4].startswith(prefix) and \
                    "/" not in fields[4][len(prefix):]:
                found[fields[4][len(prefix):]] = fields[3]
    return found


def _mount_fields(path: Path) -> list[str] | None:
    with open("/proc/self/mountinfo") as f:
        for line in reversed(f.readlines()):  # the topmost mount at a path is listed last
            fields = line.split()
            if len(fields) > 4 and fields[4] == str(path):
                return fields
    return None


def _on_a_file_system_of_its_own(path: Path) -> bool:
    """Whether `path` (no symlink on the way) lies in a whole file system of a loop device (a
    shared volume's image, node/shared_fs.py), at its root or below: a forged handle through
    an export there reaches that file system only, never the host's."""
    text = str(path)
    if os.path.realpath(text) != text:
        return False
    with open("/proc/self/mountinfo") as f:
        lines = [line.split() for line in f]
    best: list[str] | None = None
    for fields in lines:  # the topmost mount at a path is listed last: it wins ties
        under = len(fields) > 4 and (text == fields[4]
                                     or text.startswith(fields[4].rstrip("/") + "/"))
        if under and (best is None or len(fields[4]) >= len(best[4])):
            best = fields
    if best is None or best[3] != "/" or "-" not in best:
        return False
    fstype, source = best[best.index("-") + 1:best.index("-") + 3]
    return fstype == "ext4" and source.startswith("/dev/loop")


def _fstype(fields: list[str]) -> str:
    return fields[fields.index("-") + 1] if "-" in fields else "?"


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NfsError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")


def _own_tmpfs(path: Path, options: str) -> bool:
    """`path` the mount point of a tmpfs of its own (mounted there now unless one is there
    already); whatever else was mounted there (an older node's bind of a directory) is
    unmounted first. True when it was mounted now."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fields = _mount_fields(path)
    if fields is not None and _fstype(fields) == "tmpfs" and fields[3] == "/":
        return False
    while _mount_fields(path) is not None:
        _run("umount", "-l", str(path))
    _run("mount", "-t", "tmpfs", "-o", f"nosuid,nodev,noexec,{options}", "tmpfs", str(path))
    return True


@functools.lru_cache(maxsize=4)
def _jail_copies(binary: str, stamp: float) -> tuple[str, ...]:
    """What ganesha's jail holds of the host: the program, its plugins, the libraries of both,
    JAIL_FILES (module doc, "Jail"). `stamp` (the program's mtime) renews it after an
    upgrade."""
    plugins = sorted({os.path.realpath(found) for pattern in JAIL_PLUGINS
                      for found in glob.glob(pattern)})
    if not any(p.endswith("/libfsalvfs.so") for p in plugins):
        raise NfsError("ganesha's VFS FSAL (libfsalvfs.so) is missing: install "
                       "nfs-ganesha-vfs (scripts/install-system.sh)")
    try:
        libraries = jail.library_closure([binary, *plugins])
    except RuntimeError_ as exc:
        raise NfsError(str(exc)) from exc
    return (binary, *plugins, *libraries, *JAIL_FILES)


def jail_mounts(pid: int) -> list[tuple[str, str, str, str]]:
    """ganesha's mounts, from inside its mount namespace: (mount point, file system type,
    source, root within the file system) of every entry of its mountinfo."""
    found = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        found.append((fields[4], _fstype(fields), fields[fields.index("-") + 2], fields[3]))
    return found


class _LogSink:
    """ganesha's log (its stderr, a pipe) read by a thread of the node: written to `path` up to
    `cap` bytes, then that file becomes `path`.1 (the one before it is dropped), so the log
    takes at most twice `cap` of the node's disk whatever ganesha writes; the last lines are
    kept in memory for error messages. Counts the reloads ganesha reports (RELOAD_LINE)."""

    def __init__(self, pipe: IO[bytes], path: Path, cap: int) -> None:
        self.pipe, self.path, self.cap = pipe, path, cap
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.reloads = 0
        #: what the signal thread reported wrong in the last reload (RELOAD_ERROR lines)
        self.reload_errors: list[str] = []
        self._errors: list[str] = []
        self.changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ganesha-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        out = open(self.path, "ab")  # noqa: SIM115 (replaced at each rotation)
        try:
            # A line is read whole up to LINE_CAP bytes; a longer one is cut into pieces, and
            # only a piece that starts a line is judged (a guest's text padded to the cut would
            # start a "line" of its own).
            starts_line = True
            while line := self.pipe.readline(LINE_CAP):
                judged, starts_line = starts_line, line.endswith(b"\n")
                if out.tell() + len(line) > self.cap:
                    out.close()
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                    out = open(self.path, "ab")  # noqa: SIM115 (replaced at each rotation)
                out.write(line)
                out.flush()
                text = line.decode(errors="replace").rstrip("\n")
                with self.changed:
                    self.tail.append(text)
                    if not judged:
                        pass
                    elif SIGHUP_LINE.search(text):
                        self._errors = []
                    elif RELOAD_LINE.search(text):
                        self.reload_errors, self._errors = self._errors, []
                        self.reloads += 1
                    elif RELOAD_ERROR.search(text) and len(self._errors) < 20:
                        self._errors.append(text.rpartition(" :")[2][:300])
                    self.changed.notify_all()
        except (OSError, ValueError):
            pass
        finally:
            out.close()
            with self.changed:
                self.changed.notify_all()

    def text(self) -> str:
        with self.changed:
            return "\n".join(self.tail)

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)


def _last_cap() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 40


def _preexec(plan: jail.JailPlan, seccomp: SeccompProgram, last_cap: int,
             cgroup_procs: tuple[str, ...], netns: int | None = None) -> Callable[[], None]:
    """In ganesha's child before exec, as root, PID 1 of its own PID namespace: its own
    session, its cgroup, its network namespace (`netns`, an fd of it: module doc, "Network"),
    the jail, no core dumps, the capabilities it keeps (KEEP_CAPS: the bounding set loses every
    other one, so the exec leaves root with only these), no new privileges, the seccomp
    filter. Exits 120 with the failed step on stderr (the log)."""

    def fail(what: str) -> None:
        with contextlib.suppress(OSError):
            os.write(2, f"aenv: before starting ganesha: {what}\n".encode())
        os._exit(120)

    def run() -> None:
        try:
            os.setsid()
            for procs in cgroup_procs:
                with open(procs, "w") as f:
                    f.write("0")
            if netns is not None and _libc.setns(netns, _CLONE_NEWNET) != 0:
                fail(f"entering its network namespace: {os.strerror(ctypes.get_errno())}")
            jail.enter(plan)
            # stdin and stdout were the host's /dev/null (devtmpfs: a mount_fd for handles of
            # the host's device nodes); now the jail's own
            null = os.open("/dev/null", os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.close(null)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            for cap in range(last_cap + 1):
                if cap not in KEEP_CAPS and _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                    fail(f"dropping capability {cap}: {os.strerror(ctypes.get_errno())}")
            if _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 or \
                    _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
                    _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER,
                                ctypes.byref(seccomp.fprog), 0, 0) != 0:
                fail(f"no_new_privs or seccomp: {os.strerror(ctypes.get_errno())}")
        except BaseException as exc:
            fail(f"{type(exc).__name__}: {exc}")

    return run


class NfsServer:
    """One ganesha for the node, its files under `state_dir` (module doc, "Jail")."""

    def __init__(self, state_dir: Path, *, bind_addr: str = "0.0.0.0", port: int = DEFAULT_PORT,
                 binary: str = GANESHA, log_cap: int = LOG_CAP,
                 cgroup_procs: tuple[str, ...] = (),
                 max_client_ids: int = MAX_CLIENT_IDS, whole_file_systems: bool = False,
                 network: NfsNet | None = None) -> None:
        self.state_dir = Path(state_dir)
        #: ganesha's own network namespace (module doc, "Network"), made at each start and
        #: removed at its stop; it then listens on its address there (`bind_addr` unused).
        #: None: the host's namespace (tests of ganesha itself; never the node's server).
        self.network = network
        #: export only the roots of file systems of their own (the node's shared volumes,
        #: node/shared_fs.py): a handle through an export reaches only its file system
        self.whole_file_systems = whole_file_systems
        self.max_client_ids = max_client_ids
        if network is not None and network.port != port:
            raise NfsError(f"the NFS server's port {port} is not its namespace's "
                           f"({network.port})")
        self.bind_addr = network.server_address if network is not None else bind_addr
        self.port = port
        self.binary = binary
        self.log_cap = log_cap
        self.cgroup_procs = cgroup_procs
        self.config_dir = self.state_dir / "conf"
        self.config_path = self.config_dir / "ganesha.conf"
        self.run_dir = self.state_dir / "run"
        self.exports_dir = self.state_dir / "exports"
        self.jail_root = self.state_dir / "jail-root"
        self.log_path = self.state_dir / "ganesha.log"
        self.pid_path = self.state_dir / "ganesha.hostpid"
        self.recovery_root = self.run_dir / "recovery"
        self.start_seconds = 0.0  # how long the last start took, until ganesha listened
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: _LogSink | None = None
        self.exports: tuple[NfsExport, ...] = ()

    @property
    def pid(self) -> int | None:
        """ganesha's pid in the node's PID namespace (it is 1 in its own)."""
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- the exports directory: what ganesha sees of the volumes ----------------------------

    def published(self, export: NfsExport) -> Path:
        """Where ganesha sees `export`: a bind mount of its directory in the exports
        directory (its id: a volume keeps it for good, so a path stays the same)."""
        return self.exports_dir / str(export.export_id)

    def _share_exports_dir(self) -> None:
        """The exports directory a tmpfs of its own and a shared mount on the host, so the
        binds made in it later reach ganesha's namespace (its copy is a slave of this one).
        A tmpfs, not a bind of the state directory: ganesha's handles on it reach only it."""
        _own_tmpfs(self.exports_dir, EXPORTS_TMPFS)
        fields = _mount_fields(self.exports_dir)
        if fields is None or not any(f.startswith("shared:") for f in fields[6:]):
            _run("mount", "--make-shared", str(self.exports_dir))

    def _publish(self, exports: Iterable[NfsExport]) -> None:
        """Bind each export's directory at its published path (once: a bind in place is
        kept)."""
        mounted = _published_mounts(self.exports_dir)
        for export in exports:
            if not export.clients:
                continue
            target = self.published(export)
            if target.name in mounted:
                continue
            if self.whole_file_systems and not _on_a_file_system_of_its_own(export.path):
                raise NfsError(f"{export.path} is not on a file system of its own (a loop "
                               "mounted image, node/shared_fs.py): not exported")
            if target.is_symlink():  # the node made none; ganesha's view of it is read-only
                raise NfsError(f"{target} is a symlink: not mounting on it")
            target.mkdir(mode=0o700, exist_ok=True)
            _run("mount", "--bind", str(export.path), str(target))
            _run("mount", "-o", "remount,bind,nosuid,nodev,noexec", str(target))

    def unpublish(self, keep: Iterable[NfsExport] = ()) -> None:
        """Unmount the binds of exports not in `keep` (lazily: ganesha may hold files of an
        export it just dropped; the unmount reaches its namespace too)."""
        names = {self.published(e).name for e in keep if e.clients}
        for name in _published_mounts(self.exports_dir):
            if name not in names:
                with contextlib.suppress(NfsError):
                    _run("umount", "-l", str(self.exports_dir / name))
                with contextlib.suppress(OSError):
                    (self.exports_dir / name).rmdir()

    def _write_config(self, exports: tuple[NfsExport, ...]) -> None:
        shown = tuple(dataclasses.replace(e, path=self.published(e)) for e in exports)
        text = render_config(shown, bind_addr=self.bind_addr, port=self.port,
                             recovery_root=self.recovery_root,
                             max_client_ids=self.max_client_ids)
        tmp = self.config_path.with_name(self.config_path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.config_path)

    def _log_text(self) -> str:
        return self._log.text() if self._log is not None else ""

    def _plan(self, binary: str) -> jail.JailPlan:
        copies = _jail_copies(binary, os.stat(binary).st_mtime)
        return jail.plan_bare_jail(
            self.jail_root, copies=copies, devices=JAIL_DEVICES,
            tmpfs=[jail.Tmpfs(str(self.run_dir), RUN_SIZE, RUN_INODES)],
            read_only=[self.config_dir], following=[self.exports_dir], links=JAIL_LINKS)

    def _check_jail(self, pid: int) -> None:
        """Every mount in ganesha's namespace is a tmpfs, its proc, or an export's bind
        (module doc, "Jail"): nothing else of a host file system, whose every inode a forged
        handle would open."""
        exports = str(self.exports_dir) + "/"
        for point, kind, source, _ in jail_mounts(pid):
            # an export: a directory of a volume's own file system (_on_a_file_system_of_its_own)
            own = kind == "ext4" and source.startswith("/dev/loop")
            if point.startswith(exports) and (own or not self.whole_file_systems):
                continue
            if kind not in ("tmpfs", "proc") or point.startswith(exports):
                raise NfsError(f"ganesha's jail has {point} of a host file system ({kind}, "
                               f"{source})")

    def start(self, exports: Iterable[NfsExport] = (), timeout: float = 20.0) -> None:
        """Start ganesha in its jail (and its network namespace, made now) and wait until it
        listens on its port (read from its /proc/<pid>/net/tcp, not by connecting: its
        namespace takes connections from the guests' range only, and in the host's namespace
        the node's input wall resets every connection to the port that the slots' redirect did
        not make; runtime/network.py). Refused when another socket listens on the port, before
        or beside ganesha's."""
        if self.running():
            raise NfsError("the NFS server is already running")
        if not 0 < self.port < PRIVILEGED_PORTS:
            raise NfsError(f"the NFS server's port {self.port} is not below "
                           f"{PRIVILEGED_PORTS}: a local user could take it while ganesha "
                           "restarts")
        if self.network is None and self.port >= (floor := unprivileged_port_start()):
            raise NfsError(f"the NFS server's port {self.port} is one any local user may bind "
                           f"here (net.ipv4.ip_unprivileged_port_start is {floor}): one could "
                           "take it while ganesha restarts and receive the guests' NFS "
                           "connections; raise that sysctl above the port or set AENV_NFS_PORT "
                           "below it")
        if self.network is None and (held := listeners(self.port)):
            raise NfsError(f"port {self.port} is held by another program ({held[0]}): "
                           "the NFS server does not start beside it")
        path = shutil.which(self.binary)
        if path is None:
            raise NfsError(f"{self.binary} is missing: install nfs-ganesha and nfs-ganesha-vfs "
                           "(scripts/install-system.sh)")
        path = os.path.realpath(path)
        started = time.monotonic()
        for directory in (self.state_dir, self.jail_root):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        _own_tmpfs(self.config_dir, CONF_TMPFS)
        self.exports = tuple(exports)
        self._share_exports_dir()
        self.unpublish(self.exports)
        self._publish(self.exports)
        self._write_config(self.exports)
        try:
            plan = self._plan(path)
            seccomp = jail_filter(GANESHA_SYSCALLS, GANESHA_DENIED)
        except RuntimeError_ as exc:
            raise NfsError(str(exc)) from exc
        netns: int | None = None
        if self.network is not None:
            try:
                self.network.create()
                netns = os.open(self.network.path, os.O_RDONLY | os.O_CLOEXEC)
            except (NetworkError, OSError) as exc:
                self.stop()
                raise NfsError(f"ganesha's network namespace: {exc}") from exc
        try:
            proc = jail.spawn_in_new_pid_namespace(
                [path, "-F", "-f", str(self.config_path), "-L", "STDERR",
                 "-p", str(self.run_dir / "ganesha.pid"), "-N", "NIV_EVENT"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                env=jail.ENVIRONMENT,
                preexec_fn=_preexec(plan, seccomp, _last_cap(), self.cgroup_procs, netns))
        finally:
            if netns is not None:
                os.close(netns)
        assert proc.stderr is not None
        self._proc = proc
        self._log = _LogSink(proc.stderr, self.log_path, self.log_cap)
        tmp = self.pid_path.with_name(self.pid_path.name + ".tmp")
        tmp.write_text(f"{proc.pid}\n")
        os.replace(tmp, self.pid_path)
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                self._log.join()
                tail = self._log_text()[-2000:]
                self.stop()
                raise NfsError(f"ganesha exited at start: {tail}")
            if listening(self.port, proc.pid):
                break
            if time.monotonic() > deadline:
                self.stop()
                raise NfsError(f"ganesha did not listen on port {self.port} in {timeout} s")
            time.sleep(0.05)
        if other := foreign_listeners(self.port, proc.pid):
            self.stop()
            raise NfsError(f"port {self.port} is also held by another program ({other[0]}): "
                           "the NFS server does not serve beside it")
        try:
            self._check_jail(proc.pid)
        except (NfsError, OSError) as exc:
            self.stop()
            raise NfsError(f"ganesha's jail is not as planned: {exc}") from exc
        self.start_seconds = time.monotonic() - started

    def update(self, exports: Iterable[NfsExport], timeout: float = 20.0) -> None:
        """Replace the exports: publish the new ones, rewrite the configuration, SIGHUP, wait
        for ganesha's own report of the reload (RELOAD_LINE, from its signal thread), then
        unpublish the ones gone."""
        if self._proc is None or self._log is None or not self.running():
            raise NfsError("the NFS server is not running")
        exports = tuple(exports)
        self._publish(exports)
        self._write_config(exports)
        sink = self._log
        with sink.changed:
            before = sink.reloads
        self._proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        with sink.changed:
            while sink.reloads <= before:
                if not self.running():
                    raise NfsError("ganesha exited while reloading its exports")
                if time.monotonic() > deadline:
                    raise NfsError(f"ganesha did not reload its exports in {timeout} s")
                sink.changed.wait(0.1)
            errors = list(sink.reload_errors)
        self.exports = exports
        self.unpublish(exports)
        if errors:
            raise NfsError(f"ganesha reloaded its exports with errors: {'; '.join(errors)}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; the exports' binds go."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if self._log is not None:
                self._log.join()
            self.pid_path.unlink(missing_ok=True)
        if self.exports_dir.is_dir():
            self.unpublish()
            while _mount_fields(self.exports_dir) is not None:
                _run("umount", "-l", str(self.exports_dir))
        while self.config_dir.is_dir() and _mount_fields(self.config_dir) is not None:
            _run("umount", "-l", str(self.config_dir))
        if self.network is not None:
            try:
                self.network.remove()
            except NetworkError as exc:
                raise NfsError(f"ganesha's network namespace: {exc}") from exc
