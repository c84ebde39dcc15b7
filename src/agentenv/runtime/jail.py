"""A jail per VM, after Firecracker's jailer: QEMU runs as a uid and gid of its own, as PID 1
of its own PID namespace, in a mount namespace whose root holds only that VM's files, with an
environment that names nothing of the node's.

Identity. Each QEMU gets a uid (gid = the same number) from `RuntimeConfig.vm_uid_range`; no
/etc/passwd entry is needed. A uid is leased by a file `<vm_uid_lease_dir>/<uid>` (made with
O_EXCL; on /run, so host-wide: two runtimes on one host never hand out the same uid) and
given back when its QEMU has exited. Leases survive a crash of the node: the next start
(`UidPool.sweep`) keeps every lease whose uid still runs a process (a QEMU the node adopts,
runtime/adopt.py) or whose runtime is alive, and drops the rest. The only group a jailed QEMU
shares with others is the VM group (`qemu_user`'s, e.g. aenv-vm) as a supplementary group: it
opens the files that are shared by design (a snapshot's memory file, read-only disks' NBD
sockets, the NBD socket directory), which the jail shows only its own of. Its own files
(serial log, device state, workdir, writable disks' NBD sockets) are its uid's alone, so one
VM's QEMU cannot ptrace, signal or read another's (`/proc/PID/mem` needs the same uid).

Root. `enter` runs in the child between fork and exec, as root, after the network namespace,
the cgroup and the TAP fd (runtime/qemu.py `_preexec`): new IPC and UTS namespaces, a new
mount namespace (private propagation), a tmpfs as the new root, into which every path QEMU opens is bind-mounted at its
host path (so QMP commands that name files, /proc/PID/maps and adopt.py see the same paths),
the read-only ones (kernel, initramfs, RAM file, read-only disk files, /usr) read-only; the device nodes
/dev/null, /dev/urandom (and /dev/kvm under KVM; the TAP is an fd opened before); a proc of the
VM's PID namespace with only its process directories (`subset=pid`); then pivot_root, the old
root detached, and the tmpfs made read-only. The node's state directory, database, logs and
secrets are not in it.

Seccomp. On top of QEMU's own `-sandbox`, a jailed QEMU's filter (runtime/qemu.py
`qemu_filter`) refuses namespaces (no unprivileged user namespace), mounts, ptrace and
process_vm_*, BPF, keyrings, userfaultfd, modules, and calls of another architecture.

Resource limits (`ProcessLimits`, set by `apply_limits` in the child before it drops root,
soft = hard so QEMU cannot raise them): RLIMIT_FSIZE bounds every file QEMU writes or grows
(`qemu.stderr`, `serial.log`, a snapshot's device state; a `fallocate` or write past it fails
with EFBIG, SIGXFSZ being ignored, instead of filling the host's disk), RLIMIT_NOFILE is a fixed
number of descriptors whatever the node's own limit, and no core dumps (a QEMU's core is its
guest's memory, on the host's disk).

Bare jails (`plan_bare_jail`, node/nfs.py's ganesha). A server that keeps CAP_DAC_READ_SEARCH
and open_by_handle_at opens any inode of every file system one of its mounts is on, by a forged
handle with that mount as mount_fd (the "shocker" attack): a bind of /usr or of a directory of
the node's disk hands it the whole of that disk. Its jail binds nothing of the host's disks:
the program, the libraries it loads (`library_closure`) and its few files are copied into the
jail's own tmpfs root (a superblock of its own: a handle on it reaches only those copies); its
device nodes are made with mknod in a tmpfs of their own at /dev (read-only once made; every
other mount stays nodev); its writable directories are tmpfs instances made for it of bounded
size; the only binds are of tmpfs mounts the caller made for it (checked: `enter` refuses a bind
whose source is not a tmpfs) and what the caller mounts beneath a followed one later.

PID namespace. The runtime forks QEMU with the forking thread's PID namespace for children
set to a fresh one (`spawn_in_new_pid_namespace`), so QEMU is PID 1 there while the runtime
keeps its host pid as its child (exit status, pidfd, process_vm_readv, adoption).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import grp
import os
import platform
import pwd
import resource
import signal
import stat
import subprocess
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.runtime.errors import RuntimeError_

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_SLAVE = 0x80000
MNT_DETACH = 0x2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
# What QEMU (a dynamically linked binary, its firmware and keymaps) needs of the host's root:
# read-only, nothing of the node's in it.
SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/etc/ld.so.cache")
DEVICES = ("/dev/null", "/dev/urandom")
# QEMU's environment: nothing of the node's (its secrets, its settings).
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "LANG": "C"}


@dataclass(frozen=True)
class ProcessLimits:
    """The rlimits of one QEMU (module doc): `file_size` bytes of any file it writes,
    `open_files` descriptors."""

    file_size: int
    open_files: int


def apply_limits(limits: ProcessLimits) -> None:
    """Set `limits` (soft = hard) and no core dumps on the calling process; a write past the
    file size then fails with EFBIG rather than killing it with SIGXFSZ (ignored signals stay
    ignored across exec). In the child before exec, as root (raising a hard limit needs it)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size, limits.file_size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


@dataclass(frozen=True)
class Bind:
    """A host path shown at the same path inside the jail; `link` (a symlink's target) is
    recreated instead of bound (e.g. /lib -> usr/lib on a merged-/usr host)."""

    path: str
    read_only: bool
    directory: bool
    link: str | None = None
    #: with the mounts beneath it, and what the host mounts there later shows up inside too
    #: (the jail's root is then a slave of the host's mounts: nothing goes the other way)
    recursive: bool = False


@dataclass(frozen=True)
class Copy:
    """A host file (symlinks followed) copied into the jail's root at `path`."""

    source: str
    path: str
    mode: int


@dataclass(frozen=True)
class Device:
    """A character device node made in the jail (mknod) at `path`."""

    path: str
    major: int
    minor: int


@dataclass(frozen=True)
class Tmpfs:
    """A tmpfs instance made for the jail at `path`: `size` bytes, `inodes` files at most."""

    path: str
    size: int
    inodes: int
    mode: int = 0o700


@dataclass(frozen=True)
class JailPlan:
    """Everything `enter` mounts, prepared in the parent (the child only makes syscalls)."""

    mountpoint: str  # an empty host directory the tmpfs root is mounted on (per namespace)
    binds: tuple[Bind, ...]
    #: the jail's copy of the host's mounts: MS_PRIVATE (nothing propagates either way) or
    #: MS_SLAVE (mounts the host makes under a `recursive` bind's shared source appear inside)
    propagation: int = MS_PRIVATE
    #: a bare jail (module doc): copies instead of the system's paths, devices made, writable
    #: tmpfs instances; every bind's source must be a tmpfs
    bare: bool = False
    root_size: int = 1 << 20
    root_inodes: int = 4096
    copies: tuple[Copy, ...] = ()
    devices: tuple[Device, ...] = ()
    tmpfs: tuple[Tmpfs, ...] = ()


def plan_jail(mountpoint: Path, *, writable: Iterable[str | Path],
              read_only: Iterable[str | Path], devices: Iterable[str],
              following: Iterable[str | Path] = (),
              links: Iterable[tuple[str, str]] = ()) -> JailPlan:
    """The jail of one QEMU: `writable` and `read_only` host paths (files or directories) it
    opens, the device nodes it needs, and the system's read-only parts (SYSTEM_PATHS).
    `following`: writable directories bound with what is mounted beneath them, now and later
    (each should be a shared mount on the host: node/nfs.py's exports directory). `links`:
    (path, target) symlinks made in the jail (e.g. /etc/mtab -> /proc/self/mounts)."""
    binds: list[Bind] = []
    seen: set[str] = set()

    def add(path: str | Path, ro: bool) -> None:
        text = os.path.abspath(str(path))
        if text in seen:
            return
        seen.add(text)
        if os.path.islink(text) and text in SYSTEM_PATHS:
            binds.append(Bind(text, True, False, link=os.readlink(text)))
            return
        try:
            os.stat(text)
        except OSError as exc:  # not only ENOENT: a FUSE file (memfs) can fail with EIO/ENOTCONN
            raise RuntimeError_(f"the VM's jail needs {text}, which cannot be reached: "
                                f"{exc.strerror or exc}") from None
        binds.append(Bind(text, ro, os.path.isdir(text)))

    for path in SYSTEM_PATHS:
        if os.path.lexists(path):
            add(path, True)
    for path in writable:
        add(path, False)
    for path in read_only:
        add(path, True)
    for device in devices:
        add(device, False)
    for path, target in links:
        binds.append(Bind(os.path.abspath(path), True, False, link=target))
    follow = [os.path.abspath(str(p)) for p in following]
    for text in follow:
        if text in seen or not os.path.isdir(text):
            raise RuntimeError_(f"the jail cannot follow {text}: not a directory, or bound twice")
        seen.add(text)
        binds.append(Bind(text, False, True, recursive=True))
    return JailPlan(str(mountpoint), tuple(binds), MS_SLAVE if follow else MS_PRIVATE)


def library_closure(programs: Iterable[str | Path]) -> list[str]:
    """The shared libraries `programs` (executables or libraries a program dlopens) load, with
    their dynamic loader, as the loader finds them here (`ldd`: the paths it opens)."""
    found: list[str] = []
    for program in programs:
        proc = subprocess.run(["ldd", str(program)], capture_output=True, text=True,
                              env=ENVIRONMENT)
        if proc.returncode != 0:
            raise RuntimeError_(f"ldd {program} failed: {proc.stderr.strip()}")
        for line in proc.stdout.splitlines():
            name, arrow, rest = line.strip().partition(" => ")
            path = (rest if arrow else name).split(" (", 1)[0].strip()
            if arrow and path == "not found":
                raise RuntimeError_(f"{program} needs {name}, which is not found")
            if path.startswith("/") and path not in found:
                found.append(path)
    return found


def _placed(path: str, links: dict[str, str]) -> str:
    """Where a copy of the host's `path` goes in a bare jail so that `path` finds it there: the
    symlinks among its parent directories (e.g. /lib -> usr/lib on a merged-/usr host) are
    recorded in `links`, to be made in the jail, and the file goes to the resolved directory."""
    current = "/"
    for part in Path(os.path.dirname(os.path.abspath(path))).parts[1:]:
        step = os.path.join(current, part)
        if os.path.islink(step):
            links.setdefault(step, os.readlink(step))
            step = os.path.realpath(step)
        current = step
    return os.path.join(current, os.path.basename(path))


def plan_bare_jail(mountpoint: Path, *, copies: Iterable[str | Path],
                   devices: Iterable[Device], tmpfs: Iterable[Tmpfs],
                   read_only: Iterable[str | Path] = (), following: Iterable[str | Path] = (),
                   links: Iterable[tuple[str, str]] = ()) -> JailPlan:
    """A bare jail (module doc): `copies` (host files, e.g. a program and its
    `library_closure`) copied to where their host paths find them, `devices` made, `tmpfs`
    instances made; `read_only` binds of host tmpfs mounts (directories), `following`
    read-only binds of host tmpfs mounts with what is mounted beneath them, now and later
    (shared mounts on the host: their new mounts appear inside; the jail writes nothing into
    them); `links`: (path, target) symlinks made in the jail."""
    made: dict[str, str] = {}
    placed: dict[str, Copy] = {}
    for source in copies:
        text = os.path.abspath(str(source))
        if not os.path.isfile(text):
            raise RuntimeError_(f"the jail needs {text}, which is not a file")
        target = _placed(text, made)
        mode = os.stat(text).st_mode & 0o555
        placed.setdefault(target, Copy(text, target, mode))
    binds: list[Bind] = []
    seen: set[str] = set()
    for paths, recursive in ((read_only, False), (following, True)):
        for path in paths:
            text = os.path.abspath(str(path))
            if text in seen or not os.path.isdir(text):
                raise RuntimeError_(f"the jail cannot bind {text}: not a directory, or twice")
            seen.add(text)
            binds.append(Bind(text, True, True, recursive=recursive))
    for path, target in [*made.items(), *links]:
        binds.append(Bind(os.path.abspath(path), True, False, link=target))
    size = sum(os.stat(c.source).st_size for c in placed.values())
    return JailPlan(str(mountpoint), tuple(binds), MS_SLAVE if following else MS_PRIVATE,
                    bare=True, root_size=size + (2 << 20), copies=tuple(placed.values()),
                    devices=tuple(devices), tmpfs=tuple(tmpfs))


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    _check(_libc.mount(source.encode() if source else None, target.encode(),
                       fstype.encode() if fstype else None, flags,
                       data.encode() if data else None), f"mount {source or fstype} on {target}")


def _under_system_path(path: str) -> bool:
    return any(path.startswith(p + "/") for p in SYSTEM_PATHS)


def enter(plan: JailPlan) -> None:
    """Make the calling process's root the jail (module doc). In the child before exec, as
    root, in the VM's fresh PID namespace; raises OSError naming the step that failed."""
    # Its own System V IPC and POSIX message queues, and its own host name.
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS),
           "unshare(CLONE_NEWNS|CLONE_NEWIPC|CLONE_NEWUTS)")
    # Nothing mounted from here on reaches the host (or another jail).
    _mount(None, "/", None, MS_REC | plan.propagation)
    root = plan.mountpoint
    _mount("tmpfs", root, "tmpfs", MS_NOSUID,
           f"mode=0755,size={plan.root_size},nr_inodes={plan.root_inodes}")
    os.umask(0o022)
    for copy in plan.copies:
        os.makedirs(os.path.dirname(root + copy.path), mode=0o755, exist_ok=True)
        _copy_file(copy.source, root + copy.path, copy.mode)
    _make_devices(root, plan.devices)
    for bind in plan.binds:
        target = root + bind.path
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if bind.link is not None:
            os.symlink(bind.link, target)
            continue
        if plan.bare and _fstype(bind.path) != "tmpfs":
            raise OSError(errno.EPERM, f"a bare jail binds only tmpfs mounts: {bind.path} "
                                       f"is on {_fstype(bind.path)}")
        if bind.directory:
            os.makedirs(target, mode=0o755, exist_ok=True)
        elif not os.path.exists(target):
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        # A directory under /usr etc. is already inside its read-only bind.
        if not plan.bare and _under_system_path(bind.path) and bind.read_only:
            continue
        _mount(bind.path, target, None, MS_BIND | (MS_REC if bind.recursive else 0))
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID
        if bind.read_only:
            flags |= MS_RDONLY | MS_NODEV
        elif not bind.path.startswith("/dev/"):
            flags |= MS_NODEV
        if plan.bare:
            flags |= MS_NOEXEC
        _mount(None, target, None, flags)
    for fs in plan.tmpfs:
        os.makedirs(root + fs.path, mode=0o755, exist_ok=True)
        _mount("tmpfs", root + fs.path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               f"mode={fs.mode:o},size={fs.size},nr_inodes={fs.inodes}")
    os.makedirs(root + "/proc", mode=0o555, exist_ok=True)
    # This PID namespace's proc, its process directories only (no /proc/sys, no sysrq).
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "subset=pid")
    os.chdir(root)
    number = _SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown architecture {platform.machine()}")
    # pivot_root(".", "."): the old root ends up stacked on the new one; detach it.
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detaching the host's root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _copy_file(source: str, target: str, mode: int) -> None:
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(src).st_size
            offset = 0
            while offset < size:
                sent = os.sendfile(dst, src, offset, size - offset)
                if sent == 0:
                    break
                offset += sent
            os.fchmod(dst, mode)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _make_devices(root: str, devices: tuple[Device, ...]) -> None:
    """Each directory of `devices` (e.g. /dev) a tmpfs of its own, the nodes made in it, then
    read-only: the jail's other mounts stay nodev, and nothing is added here later."""
    for directory in sorted({os.path.dirname(d.path) for d in devices}):
        target = root + directory
        os.makedirs(target, mode=0o755, exist_ok=True)
        _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=4k,nr_inodes=64")
        for device in devices:
            if os.path.dirname(device.path) == directory:
                os.mknod(root + device.path, 0o666 | stat.S_IFCHR,
                         os.makedev(device.major, device.minor))
                os.chmod(root + device.path, 0o666)
        _mount(None, target, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def _fstype(path: str) -> str:
    """The type of the file system mounted topmost at or above `path` (this namespace)."""
    best, kind = "", "?"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].replace("\\040", " ")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and \
                    len(point) >= len(best):
                best, kind = point, fields[fields.index("-") + 1]
    return kind


_fork_lock = threading.Lock()
_host_pid_ns: int | None = None


def spawn_in_new_pid_namespace(argv: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """subprocess.Popen with the child as PID 1 of a new PID namespace. unshare(CLONE_NEWPID)
    moves only the calling thread's future children; the thread is set back to the node's own
    namespace right after the fork, so nothing else it forks lands there."""
    global _host_pid_ns
    with _fork_lock:
        if _host_pid_ns is None:
            _host_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
        child: subprocess.Popen[bytes] | None = None
        try:
            child = subprocess.Popen(argv, **popen)
        finally:
            back = _libc.setns(_host_pid_ns, CLONE_NEWPID)
            if back != 0 and child is not None:
                child.kill()  # no QEMU we could not account for
                child.wait()
            _check(back, "setns back to the node's PID namespace")
        return child


class UidPool:
    """Per-VM uids from [low, high], leased by files in `lease_dir` (module doc)."""

    def __init__(self, low: int, high: int, lease_dir: Path) -> None:
        if not 0 < low <= high:
            raise RuntimeError_(f"VM uid range {low}-{high} is empty or includes root")
        self.low, self.high = low, high
        self.lease_dir = Path(lease_dir)
        self._next = low
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, text: str, lease_dir: Path) -> UidPool:
        low, sep, high = text.partition("-")
        try:
            pool = cls(int(low), int(high if sep else low), lease_dir)
        except ValueError:
            raise RuntimeError_(f"VM uid range {text!r} is not FIRST-LAST, e.g. 200000-265535") \
                from None
        pool.check_unused()
        return pool

    def check_unused(self) -> None:
        """A VM must share its uid or gid with no one: refuse a range that holds a user or
        group of the host, or a subordinate range of /etc/subuid or /etc/subgid (the ids of
        user namespaces' containers)."""
        for entry in pwd.getpwall():
            if self.contains(entry.pw_uid):
                raise RuntimeError_(f"VM uid range {self.low}-{self.high} holds user "
                                    f"{entry.pw_name} ({entry.pw_uid}): pick a range no one uses")
        for entry in grp.getgrall():
            if self.contains(entry.gr_gid):
                raise RuntimeError_(f"VM uid range {self.low}-{self.high} holds group "
                                    f"{entry.gr_name} ({entry.gr_gid}): pick a range no one uses")
        for table in ("/etc/subuid", "/etc/subgid"):
            with contextlib.suppress(FileNotFoundError):
                for line in Path(table).read_text().splitlines():
                    fields = line.strip().split(":")
                    if len(fields) != 3 or not (fields[1].isdigit() and fields[2].isdigit()):
                        continue
                    first, count = int(fields[1]), int(fields[2])
                    if first <= self.high and self.low < first + count:
                        raise RuntimeError_(
                            f"VM uid range {self.low}-{self.high} overlaps {table}'s "
                            f"{first}-{first + count - 1} of {fields[0]}: pick another range")

    def _lease(self, uid: int) -> Path:
        return self.lease_dir / str(uid)

    def allocate(self, owner: str) -> int:
        """A uid no VM holds; round robin, so a uid given back is the last to be reused."""
        self.lease_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        size = self.high - self.low + 1
        with self._lock:
            for step in range(size):
                uid = self.low + (self._next - self.low + step) % size
                try:
                    fd = os.open(self._lease(uid), os.O_WRONLY | os.O_CREAT | os.O_EXCL
                                 | os.O_CLOEXEC, 0o600)
                except FileExistsError:
                    continue
                with os.fdopen(fd, "w") as f:
                    f.write(f"{os.getpid()} {owner}\n")
                self._next = uid + 1 if uid < self.high else self.low
                return uid
        raise RuntimeError_(f"no free VM uid in {self.low}-{self.high}: every one is leased "
                            f"in {self.lease_dir}")

    def release(self, uid: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._lease(uid).unlink()

    def contains(self, uid: int) -> bool:
        return self.low <= uid <= self.high

    def leased(self) -> set[int]:
        try:
            names = os.listdir(self.lease_dir)
        except FileNotFoundError:
            return set()
        return {int(n) for n in names if n.isdigit() and self.contains(int(n))}

    def sweep(self) -> list[int]:
        """Drop the leases of VMs that are gone (their uid runs nothing and the runtime that
        leased it is dead); returns the uids freed."""
        running = _uids_running()
        freed = []
        for uid in sorted(self.leased()):
            if uid in running:
                continue
            try:
                owner = int(self._lease(uid).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                owner = 0
            if owner > 0 and owner != os.getpid() and _pid_alive(owner):
                continue  # another runtime on this host, between lease and QEMU start
            self.release(uid)
            freed.append(uid)
        return freed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _uids_running() -> set[int]:
    """The real uids of every process on the host."""
    uids: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            uids.add(os.stat(f"/proc/{name}").st_uid)
    return uids
