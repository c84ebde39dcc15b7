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
- NFSv4.0 and 4.1, not 4.2 (`Minor_Versions`): ganesha 4.3's 4.2 is partial, and the guest
  kernel's 4.2 client (READ_PLUS) read a file another guest had just written as NUL bytes of
  the right length. Guests mount `vers=4.1` (sessions; no callback connection to the guest).
- `Graceless`: no 90 s grace period after a start, in which every open would wait. No client
  state survives a restart of the server anyway (a client reclaiming after it gets
  NO_GRACE and its open files fail; new opens work).
- Numeric owners only: guests and host share no user database; uids travel as numbers.
- Every export `All_Squash` to the owner of its directory (`NfsExport.anon_uid/anon_gid`):
  root and the user in every sandbox act on the host as that one unprivileged owner, so a
  guest makes neither setuid-root files nor devices on the host, and files written by one
  sandbox's root are writable by another's user. `chown` in the guest fails (EPERM).
- An export lists its clients (`CLIENT { Clients = ...; Access_Type = RW }`) and is closed to
  everyone else (`Access_Type = None`): a client not listed does not even see it in the pseudo
  file system (NFS4ERR_NOENT at mount).

Exports change with `update` (the configuration file is rewritten, then SIGHUP: ganesha 4.x
rereads its exports, adds, removes and changes client lists in place, and logs "Reread exports
complete", which `update` waits for). `stop` is SIGTERM (ganesha exits in about 1.5 s).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

GANESHA = "ganesha.nfsd"
DEFAULT_PORT = 2049
RELOADED = "Reread exports complete"
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
                  recovery_root: Path) -> str:
    """ganesha.conf for these exports. An export without clients is left out."""
    ipaddress.IPv4Address(bind_addr)
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
        "  Minor_Versions = 0, 1;",
        "  Graceless = true;",
        "  Lease_Lifetime = 60;",
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


def listening(port: int, pid: int | None = None) -> bool:
    """Whether a TCP socket of this network namespace listens on `port` (any address); with
    `pid`, one of that process's (another program holding the port is not ganesha)."""
    owned: set[str] | None = None
    if pid is not None:
        owned = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    owned.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
        except OSError:
            return False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is ADDR:PORT in hex; state 0A is LISTEN
            if len(fields) > 9 and fields[3] == "0A" and \
                    int(fields[1].rsplit(":", 1)[1], 16) == port and \
                    (owned is None or f"socket:[{fields[9]}]" in owned):
                return True
    return False


class NfsServer:
    """One ganesha for the node, its files under `state_dir` (config, log, pid, recovery)."""

    def __init__(self, state_dir: Path, *, bind_addr: str = "0.0.0.0", port: int = DEFAULT_PORT,
                 binary: str = GANESHA) -> None:
        self.state_dir = Path(state_dir)
        self.bind_addr = bind_addr
        self.port = port
        self.binary = binary
        self.config_path = self.state_dir / "ganesha.conf"
        self.log_path = self.state_dir / "ganesha.log"
        self.pid_path = self.state_dir / "ganesha.pid"
        self.recovery_root = self.state_dir / "recovery"
        self._proc: subprocess.Popen[bytes] | None = None
        self.exports: tuple[NfsExport, ...] = ()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _write_config(self, exports: tuple[NfsExport, ...]) -> None:
        text = render_config(exports, bind_addr=self.bind_addr, port=self.port,
                             recovery_root=self.recovery_root)
        tmp = self.config_path.with_name(self.config_path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.config_path)

    def _log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start(self, exports: Iterable[NfsExport] = (), timeout: float = 20.0) -> None:
        """Start ganesha and wait until it listens on its port (read from /proc/net/tcp, not
        by connecting: the node's input wall resets every connection to that port that the
        slots' redirect did not make, a local one too; runtime/network.py)."""
        if self.running():
            raise NfsError("the NFS server is already running")
        path = shutil.which(self.binary)
        if path is None:
            raise NfsError(f"{self.binary} is missing: install nfs-ganesha and nfs-ganesha-vfs "
                           "(scripts/install-system.sh)")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.recovery_root.mkdir(exist_ok=True)
        self.exports = tuple(exports)
        self._write_config(self.exports)
        self._proc = subprocess.Popen(
            [path, "-F", "-f", str(self.config_path), "-L", str(self.log_path),
             "-p", str(self.pid_path), "-N", "NIV_EVENT"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                tail = self._log_text()[-2000:]
                self._proc = None
                raise NfsError(f"ganesha exited at start: {tail}")
            if listening(self.port, self._proc.pid):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise NfsError(f"ganesha did not listen on port {self.port} in {timeout} s")
            time.sleep(0.05)

    def update(self, exports: Iterable[NfsExport], timeout: float = 20.0) -> None:
        """Replace the exports: rewrite the configuration, SIGHUP, wait for the reload."""
        if self._proc is None or not self.running():
            raise NfsError("the NFS server is not running")
        exports = tuple(exports)
        self._write_config(exports)
        before = self._log_text().count(RELOADED)
        self._proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while self._log_text().count(RELOADED) <= before:
            if not self.running():
                raise NfsError("ganesha exited while reloading its exports")
            if time.monotonic() > deadline:
                raise NfsError(f"ganesha did not reload its exports in {timeout} s")
            time.sleep(0.05)
        self.exports = exports

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
