"""Least privilege for QEMU: an unprivileged user, QEMU's own seccomp sandbox, and the few
files that user may open.

QEMU runs under `-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,
resourcecontrol=deny`. `elevateprivileges=deny` kills any set*id call, and QEMU's own
`-run-with user=` (the former `-runas`) drops its privileges with setuid after it installed the
filter (measured: "Bad system call"). So, like libvirt, the runtime drops to the VM user in the
child before exec (`drop_privileges` in qemu._preexec, after entering the network namespace
and the cgroup, which need root), and QEMU opens everything as that user:

| what | how the VM user gets it |
|---|---|
| RAM file (`<state>/memory/*.mem`) | group = the VM user's group, mode 0640 (`grant_ram_file`): shared by VMs, never writable by one; QEMU opens it read-only even for free-page reporting (runtime/qemu.py, `_ramopen.c`) |
| state dir, `vms/`, `memory/` | group search permission only (`prepare_dirs`), nothing listable |
| VM workdir | root-owned, group search; QEMU creates nothing in it: the QMP socket is bound by the runtime and passed as a listening fd, `serial.log` and `devstate.raw` are created for it (`precreate`) |
| device state of a restore | copied into the workdir (`stage_devstate`, ~80 KB), the snapshot directory stays root-only |
| TAP | opened by the child as root after entering the slot's namespace, passed as `fd=` (`/dev/net/tun` is root's) |
| NBD sockets | blockd makes them group-connectable for the VM group (blockd/access.py) |
| /dev/kvm | the device's group is added as a supplementary group |

The runtime (root) still reads QEMU's memory (`process_vm_readv`, pagemap) with CAP_SYS_PTRACE.

With the jail (runtime/jail.py, `RuntimeConfig.qemu_jail`, the default) each QEMU runs as a
uid of its own instead (`VMUser.jailed`), with this user's group as a supplementary group for
the files shared by design, and reaches its files through its jail's bind mounts: the state
directory then gives the VM group nothing (`withdraw`, `unreach`).
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import pwd
import shutil
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from agentenv.runtime.errors import RuntimeError_

SANDBOX_ARG = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000


@dataclass(frozen=True)
class VMUser:
    """The unprivileged identity QEMU runs as."""

    name: str
    uid: int
    gid: int
    extra_groups: tuple[int, ...] = ()
    # The group the files shared by design are granted to (a snapshot's RAM file): `gid` for
    # the one shared VM user; the VM group for a jailed QEMU's own uid (runtime/jail.py).
    shared_gid: int | None = None

    @property
    def file_gid(self) -> int:
        return self.gid if self.shared_gid is None else self.shared_gid

    def jailed(self, uid: int) -> VMUser:
        """The identity of one jailed QEMU: uid and gid `uid` (no passwd entry), this user's
        group and the KVM group as supplementary groups (runtime/jail.py)."""
        return VMUser(f"vm uid {uid}", uid, uid, (self.gid, *self.extra_groups),
                      shared_gid=self.gid)

    @classmethod
    def lookup(cls, name: str, *, kvm: bool = False) -> VMUser:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise RuntimeError_(
                f"QEMU is configured to run as user {name!r}, which does not exist: run "
                "scripts/install-system.sh (creates it with useradd --system) or set "
                "qemu_user to None (AENV_QEMU_USER=root) to run QEMU as root") from None
        if entry.pw_uid == 0:
            raise RuntimeError_(f"qemu_user {name!r} is root: pick an unprivileged user")
        extra: tuple[int, ...] = ()
        if kvm:
            with_kvm = _device_group("/dev/kvm")
            if with_kvm not in (None, 0, entry.pw_gid):
                extra = (with_kvm,)
        return cls(name, entry.pw_uid, entry.pw_gid, extra)

    def can_traverse(self, path: Path) -> str | None:
        """Why this user cannot reach `path` by name (None: it can): the first ancestor
        without search permission for it."""
        groups = {self.gid, *self.extra_groups}
        for parent in [*reversed(path.parents), path]:
            try:
                st = parent.stat()
            except FileNotFoundError:
                return None  # created later by root with the modes prepare_dirs gives
            if st.st_uid == self.uid:
                ok = bool(st.st_mode & stat.S_IXUSR)
            elif st.st_gid in groups:
                ok = bool(st.st_mode & stat.S_IXGRP)
            else:
                ok = bool(st.st_mode & stat.S_IXOTH)
            if not ok:
                return (f"{parent} (mode {stat.filemode(st.st_mode)}, owner "
                        f"{st.st_uid}:{st.st_gid}) gives user {self.name} no search permission")
        return None


def _device_group(path: str) -> int | None:
    try:
        return os.stat(path).st_gid
    except OSError:
        return None


def group_searchable(path: Path, user: VMUser) -> None:
    """Let the VM group search (not list) a root-owned directory: group = VM group, g=x."""
    path.mkdir(parents=True, exist_ok=True)
    st = path.stat()
    if st.st_gid != user.gid:
        os.chown(path, -1, user.gid)
    mode = (stat.S_IMODE(st.st_mode) & ~stat.S_IRWXG) | stat.S_IXGRP
    if mode != stat.S_IMODE(st.st_mode):
        os.chmod(path, mode)


def reach(user: VMUser, target: Path, base: Path) -> None:
    """Give the VM group search permission on every directory from `base` down to `target`
    (a directory under `base`, e.g. the node's state dir down to blockd's NBD sockets);
    nothing outside `base` is touched."""
    try:
        relative = target.relative_to(base)
    except ValueError:
        return
    directory = base
    for part in ("", *relative.parts):
        directory = directory / part if part else directory
        if directory.is_dir():
            group_searchable(directory, user)


def unreach(user: VMUser, target: Path, base: Path) -> None:
    """Undo `reach` above `target`: the directories from `base` down to target's parent lose
    the VM group (jailed QEMUs need no path through them); `target` keeps what its owner
    gave it (blockd's NBD directory stays searchable for the VM group)."""
    try:
        relative = target.relative_to(base)
    except ValueError:
        return
    directory = base
    for part in ("", *relative.parts[:-1]):
        directory = directory / part if part else directory
        with contextlib.suppress(FileNotFoundError):
            st = directory.stat()
            if st.st_gid == user.gid:
                os.chown(directory, -1, os.getegid())
                os.chmod(directory, stat.S_IMODE(st.st_mode) & ~stat.S_IRWXG)


def prepare_dirs(user: VMUser, state_dir: Path, dirs: list[Path]) -> None:
    """The directories QEMU reaches by path; fails clearly when an ancestor blocks it."""
    for directory in [state_dir, *dirs]:
        group_searchable(directory, user)
    why = user.can_traverse(state_dir)
    if why:
        raise RuntimeError_(f"QEMU runs as {user.name} and cannot reach the state directory: "
                            f"{why}")


def withdraw(user: VMUser, state_dir: Path, dirs: list[Path]) -> None:
    """Jailed QEMUs (runtime/jail.py) reach their files through bind mounts: take back the
    group search `prepare_dirs` gave the VM group on the state directory and `dirs`, and make
    the state directory the owner's alone."""
    state_dir.mkdir(parents=True, exist_ok=True)
    for directory in (state_dir, *(d for d in dirs if d.is_dir())):
        st = directory.stat()
        if st.st_gid == user.gid:
            os.chown(directory, -1, os.getegid())
            os.chmod(directory, stat.S_IMODE(st.st_mode) & ~stat.S_IRWXG)
    os.chmod(state_dir, stat.S_IMODE(state_dir.stat().st_mode) & ~(stat.S_IRWXG | stat.S_IRWXO))


def grant_ram_file(path: Path, user: VMUser) -> None:
    """The RAM file QEMU maps: group-readable for the VM group, writable by no VM (a RAM file
    is shared by every VM of a snapshot or of a boot size; QEMU opens it read-only:
    runtime/qemu.py), nobody else."""
    st = path.stat()
    if st.st_gid != user.file_gid:
        os.chown(path, -1, user.file_gid)
    current = stat.S_IMODE(st.st_mode)
    wanted = (current & 0o600) | 0o040  # the owner's bits kept, the VM group's read only
    # blockd's memory device (a FUSE file, no chmod) is 0440 with the VM group already.
    if current != wanted:
        os.chmod(path, wanted)


def precreate(path: Path, user: VMUser) -> None:
    """An empty file owned by the VM user, for QEMU to open by name in a directory it cannot
    write (it opens with O_CREAT|O_TRUNC, which needs no directory write on an existing file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchown(fd, user.uid, user.gid)
    finally:
        os.close(fd)


def stage_devstate(devstate: Path, workdir: Path, user: VMUser | None) -> Path:
    """The device state a restore loads, where QEMU may read it (see the module doc)."""
    if user is None:
        return devstate
    staged = workdir / "devstate.in"
    staged.unlink(missing_ok=True)
    shutil.copyfile(devstate, staged)
    os.chown(staged, -1, user.gid)
    os.chmod(staged, 0o640)
    return staged


def open_tap(name: str = "tap0") -> int:
    """Attach to the persistent TAP `name` of the current network namespace and return the fd
    (in the child before exec, after setns, as root: /dev/net/tun is root's). QEMU gets the fd
    (`-netdev tap,fd=N`); the flags are the ones QEMU itself attaches with, vnet header
    included, so the virtio-net features and thus the device state are unchanged."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH22x", name.encode(), _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR)
        fcntl.ioctl(fd, _TUNSETIFF, ifr)
    except BaseException:
        os.close(fd)
        raise
    return fd


def drop_privileges(user: VMUser) -> None:
    """Become the VM user for good (in the child before exec): groups, then gid, then uid."""
    os.setgroups(list(user.extra_groups))
    os.setresgid(user.gid, user.gid, user.gid)
    os.setresuid(user.uid, user.uid, user.uid)


def vm_group(name: str | None) -> int | None:
    """The gid of a group by name, None when there is none."""
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None
