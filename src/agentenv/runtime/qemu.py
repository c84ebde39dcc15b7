"""One QEMU process: its command line, its QMP connection, its exit.

Device layout (identical for a boot and for every restore of its snapshots, which the
migration stream requires):

- `-M q35` with the accelerator, `-cpu max` (TCG) or `host` (KVM), guest RAM from
  `memory-backend-file,share=off` whose mem-path is an empty sparse file (a boot) or the
  snapshot's materialised memory file shared by every VM restored from it: pages are read
  lazily from the shared page cache and copied into private memory on write.
- virtio-blk disks at fixed PCI addresses, each `raw` format node over a swappable file child
  (`<name>-file`), so a pre-spawned QEMU can get its real disk (NBD from blockd) with
  `blockdev-add` + `blockdev-reopen` when it is taken from the pool. A disk whose config says
  `bus="virtio-scsi"` (at most one) is a `scsi-hd` on a virtio-scsi controller at its own fixed
  PCI address instead: the guest then gets ENOSPC, not EIO, when blockd refuses a write at the
  disk's upper cap (see build_argv).
- volume disks (`DiskConfig.volume_slot`, docs/volumes.md §6) are virtio-blk disks like the
  others, with a serial the guest finds them by; an empty one is a `null-co` node reading
  zeros, so every snapshot has them and a restore can put a volume's device in their place.
- virtio-net on `tap0` (QEMU runs inside the network slot's namespace), no option ROM.
- virtio-balloon with free-page reporting; vmgenid with a fresh GUID for every process.
- `-kernel`/`-initrd`/`-append` only for a boot: a restore (`-incoming defer`) has no use for
  them and QEMU would keep both files in private memory.

Free-page reporting and the shared memory file. For each 2 MiB+ block the guest reports free,
QEMU's `ram_block_discard_range` (system/physmem.c) first punches a hole in the RAM file
(`fallocate(PUNCH_HOLE|KEEP_SIZE)` on its fd; refused outright with "Discarding RAM with
readonly files is not supported" if the file was opened `readonly=on`, and if the fallocate
fails it stops there), then `madvise(MADV_DONTNEED)`s the mapping, which for our private
mapping drops the guest's copy-on-write pages. Punching the shared file would zero those pages
for every sibling and for the snapshot, so QEMU runs with the file opened `readonly=off` under
a seccomp filter (installed before exec) that turns every `fallocate` with PUNCH_HOLE into a
no-op returning 0: the madvise then runs and the host gets the memory back, while the file is
never changed. A reported page reads back the snapshot's content (or zeros for a boot), which
is fine for a page the guest holds free, and is exactly what a later capture assumes for a
page that is not privately written (the lower layers). Nothing else QEMU does here needs
punch-hole: writable disks are NBD exports (discards go over the socket), the only file disks
are read-only (`build_argv` refuses a writable one, whose write-zeroes would trust the punch).

The RAM file is read-only to QEMU. `readonly=off` makes QEMU open it read-write, though it
never writes it, and a RAM file is shared: by every VM restored from a snapshot (one page
cache: a `pwrite` to a FUSE file reaches the cached page even when memfs refuses it) and by
every boot of a size (the zero file). A QEMU taken over by its guest could then write into
other VMs' memory (red team of 2026-12-07). So QEMU runs with `_ramopen.c` preloaded
(`ram_open_environment`), which turns its open of exactly that path into a read-only one:
MAP_PRIVATE mappings and madvise need no more, and the punch-hole no-op does not look at the
descriptor. The file is 0640/0440 to the VM group (`privilege.grant_ram_file`, memfs), its
bind in the jail is read-only, and memfs refuses every open for writing: no new writable open
either. tests/redteam/test_memfs_shared_pages.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agentenv.runtime import jail, privilege
from agentenv.runtime.cgroup import Cgroup, remove_cgroup_async
from agentenv.runtime.errors import QMPError, RuntimeError_, VMDiedError
from agentenv.runtime.privilege import VMUser
from agentenv.runtime.qmp import QMPClient
from agentenv.snapshot.record import VOLUME_SERIAL_PREFIX, MachineConfig

log = logging.getLogger(__name__)
_libc = ctypes.CDLL(None, use_errno=True)
SPAWN_TRIES = 3
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_PR_SET_SECCOMP = 22
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_THP_DISABLE = 41
_SECCOMP_MODE_FILTER = 2
_FALLOC_FL_PUNCH_HOLE = 0x02
#: built from _ramopen.c by the project's build (pyproject.toml), beside this module
RAM_OPEN_LIBRARY = str(next(
    iter(sorted(Path(__file__).parent.glob("_ramopen*.so"))),
    Path(__file__).parent / "_ramopen.so"))
# Exit statuses of the child between fork and exec (see _preexec).
_EXIT_SETNS = 121
_EXIT_SECCOMP = 122
_EXIT_PREEXEC = 123  # anything else raised there (its message goes to qemu.stderr)
_EXIT_CGROUP = 124
_EXIT_PRIVILEGE = 125
_EXIT_JAIL = 120
_PREEXEC_EXITS = (_EXIT_SETNS, _EXIT_SECCOMP, _EXIT_PREEXEC, _EXIT_CGROUP, _EXIT_PRIVILEGE,
                  _EXIT_JAIL)

DISK_PCI_BASE = 0x10
# Seconds QEMU holds a disk's I/O while it reconnects to blockd (restart within this or the
# guest sees EIO), and keeps retrying the first connection of a disk.
NBD_RECONNECT_DELAY = 60
NBD_OPEN_TIMEOUT = 30
NET_PCI_ADDR = 0x08
BALLOON_PCI_ADDR = 0x09
SCSI_PCI_ADDR = 0x0a


@dataclass
class DiskAttachment:
    """Where a disk's data comes from for one process: an NBD export or a local file."""

    name: str
    read_only: bool
    nbd_socket: str | None = None
    nbd_export: str | None = None
    file: str | None = None
    #: an empty volume slot: a null device of this many bytes reading zeros (no file, no
    #: export), writable like the volume disk a later restore puts in its place
    null_size: int | None = None

    def file_node(self, node_name: str) -> dict[str, Any]:
        if self.nbd_socket:
            return {
                "driver": "nbd", "node-name": node_name,
                "server": {"type": "unix", "path": self.nbd_socket},
                "export": self.nbd_export or "", "read-only": self.read_only,
                # blockd restarts (crash, upgrade) must not fail the guest's I/O: QEMU
                # reconnects, holds requests for up to this long and resends the ones in
                # flight; the restarted blockd reopens the same device at the same socket.
                "reconnect-delay": NBD_RECONNECT_DELAY,
                # A VM started while blockd restarts waits for it instead of failing.
                "open-timeout": NBD_OPEN_TIMEOUT,
            }
        if self.file:
            return {
                "driver": "file", "node-name": node_name, "filename": self.file,
                "read-only": self.read_only,
            }
        if self.null_size is not None:
            return {"driver": "null-co", "node-name": node_name, "size": self.null_size,
                    "read-zeroes": True}
        raise ValueError(f"disk {self.name}: neither an NBD export nor a file")


class _SockFprog(ctypes.Structure):
    """struct sock_fprog: a classic-BPF program for prctl(PR_SET_SECCOMP)."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


@dataclass(frozen=True)
class SeccompProgram:
    """A compiled filter, kept in memory the forked child can load without allocating."""

    code: ctypes.Array[ctypes.c_char]
    fprog: _SockFprog


# What a jailed QEMU (runtime/jail.py) never does and a QEMU taken over by its guest would
# need to widen its reach: namespaces (an unprivileged user namespace gives it capabilities
# over new mounts), mounts, other processes' memory, kernel keyrings, BPF, modules.
JAIL_DENIED = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount",
    "fsconfig", "fspick", "move_mount", "open_tree", "mount_setattr", "ptrace",
    "process_vm_readv", "process_vm_writev", "bpf", "keyctl", "add_key", "request_key",
    "userfaultfd", "perf_event_open", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "open_by_handle_at", "name_to_handle_at", "acct",
    "swapon", "swapoff", "reboot", "syslog",
)
_MAP_SHARED = 0x01  # also set in MAP_SHARED_VALIDATE (0x03)
_CLONE_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                     0x40000000, 0x00000080)  # NEWNS CGROUP UTS IPC USER PID NET TIME


@functools.cache
def qemu_filter(punch_hole: bool = True, jailed: bool = False) -> SeccompProgram | None:
    """The seccomp filter QEMU runs under (None: none). punch_hole: `fallocate` with
    FALLOC_FL_PUNCH_HOLE in its mode returns 0 without running (SECCOMP_RET_ERRNO with errno
    0 skips the call). jailed: JAIL_DENIED and `clone` with a namespace flag fail with EPERM,
    `clone3` (whose flags a filter cannot see) with ENOSYS (glibc then uses `clone`), and a
    call of another architecture (i386's int 0x80) kills QEMU. Always: no shared mapping (mmap
    with MAP_SHARED fails with EPERM), and no `fallocate` that allocates (a mode without
    PUNCH_HOLE fails with EOPNOTSUPP: QEMU needs none, and one on a sparse file it holds open,
    such as the RAM file, would take host disk within the file's size, where RLIMIT_FSIZE does
    not reach). Everything else is allowed.
    Compiled once by libseccomp (pyseccomp is a ctypes binding to Debian's libseccomp2) and
    exported as BPF, so the child between fork and exec only makes one prctl."""
    if not (punch_hole or jailed):
        return None
    try:
        import pyseccomp
    except (ImportError, RuntimeError) as exc:  # RuntimeError: libseccomp2 not installed
        raise RuntimeError_(
            f"cannot build QEMU's seccomp filter ({exc}): install libseccomp2 "
            "(scripts/install-system.sh) and pyseccomp") from exc
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    rules.set_attr(pyseccomp.Attr.ACT_BADARCH,
                   pyseccomp.KILL_PROCESS if jailed else pyseccomp.ALLOW)
    if punch_hole:
        rules.add_rule(pyseccomp.ERRNO(0), "fallocate",
                       pyseccomp.Arg(1, pyseccomp.MASKED_EQ, _FALLOC_FL_PUNCH_HOLE,
                                     _FALLOC_FL_PUNCH_HOLE))
    rules.add_rule(pyseccomp.ERRNO(errno.EOPNOTSUPP), "fallocate",
                   pyseccomp.Arg(1, pyseccomp.MASKED_EQ, _FALLOC_FL_PUNCH_HOLE, 0))
    # No shared mapping at all: QEMU maps guest RAM (and everything else here) private. A
    # shared writable mapping of the snapshot's memory file, which QEMU opens read-write for
    # free-page reporting, would change the page cache every VM of that snapshot reads (memfs
    # refuses the write-back, but the cached page is already changed). Without a shared
    # mapping, mprotect and remap_file_pages have nothing to widen either.
    rules.add_rule(pyseccomp.ERRNO(errno.EPERM), "mmap",
                   pyseccomp.Arg(3, pyseccomp.MASKED_EQ, _MAP_SHARED, _MAP_SHARED))
    rules.add_rule(pyseccomp.ERRNO(errno.EPERM), "remap_file_pages")
    if jailed:
        for name in JAIL_DENIED:
            rules.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
        rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
        for flag in _CLONE_NAMESPACES:
            rules.add_rule(pyseccomp.ERRNO(errno.EPERM), "clone",
                           pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    return _compile(rules)


def _compile(rules: Any) -> SeccompProgram:
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise RuntimeError_(f"libseccomp exported a malformed filter ({len(program)} bytes)")
    code = ctypes.create_string_buffer(program, len(program))
    return SeccompProgram(code, _SockFprog(len(program) // 8, ctypes.addressof(code)))


@functools.cache
def jail_filter(allowed: frozenset[str] = frozenset(),
                denied: frozenset[str] = frozenset()) -> SeccompProgram:
    """The jailed part of `qemu_filter` alone, for another jailed server (node/nfs.py's
    ganesha): JAIL_DENIED but `allowed`, and `denied`, fail with EPERM, `clone` with a
    namespace flag too, `clone3` with ENOSYS, a call of another architecture kills the
    process."""
    try:
        import pyseccomp
    except (ImportError, RuntimeError) as exc:
        raise RuntimeError_(f"cannot build a seccomp filter ({exc}): install libseccomp2 "
                            "(scripts/install-system.sh) and pyseccomp") from exc
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    rules.set_attr(pyseccomp.Attr.ACT_BADARCH, pyseccomp.KILL_PROCESS)
    for name in sorted({n for n in JAIL_DENIED if n not in allowed} | denied):
        rules.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
    rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NAMESPACES:
        rules.add_rule(pyseccomp.ERRNO(errno.EPERM), "clone",
                       pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    return _compile(rules)


def file_tail(path: Path, limit: int) -> str:
    """The last `limit` characters (about) of a file QEMU writes, stripped: read from the end,
    never whole (QEMU's uid owns the file descriptor: a QEMU taken over can make the file any
    size, sparse, at no cost)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 4 * limit))
        return f.read(4 * limit).decode(errors="replace").strip()[-limit:]


@dataclass(frozen=True)
class FileStamp:
    """Size, mtime and allocated blocks of a file: a punched hole or a write changes them."""

    size: int
    mtime_ns: int
    blocks: int

    @classmethod
    def of(cls, path: str | Path) -> FileStamp:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_blocks)


def _blockdev_arg(node: dict[str, Any]) -> str:
    """Render a flat blockdev dict in QEMU's key=value syntax (nested keys dotted)."""
    parts: list[str] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, bool):
            parts.append(f"{prefix}={'on' if value else 'off'}")
        else:
            parts.append(f"{prefix}={str(value).replace(',', ',,')}")

    walk("", node)
    return ",".join(parts)


def build_argv(
    machine: MachineConfig,
    *,
    mem_path: str,
    qmp_socket: Path,
    serial_log: Path,
    disks: list[DiskAttachment],
    vmgenid: str,
    incoming: bool,
    qemu_binary: str = "qemu-system-x86_64",
    tb_size_mib: int = 64,
    tcg_single_thread: bool = False,
    return_free_memory: bool = True,
    qmp_fd: int | None = None,
    sandbox: bool = False,
    tap_fd: int | None = None,
) -> list[str]:
    """The QEMU command line; `disks` in the order of machine.disks.

    qmp_fd: QMP on an inherited listening socket instead of binding `qmp_socket` (QEMU,
    running unprivileged, cannot create files in its workdir). sandbox: QEMU's own seccomp
    filter (privilege.SANDBOX_ARG), stacked on qemu_filter(); both apply. tap_fd: the
    slot's tap0 already open (an unprivileged QEMU cannot open /dev/net/tun).

    return_free_memory: open the RAM file `readonly=off` so free-page reporting can drop
    the guest's freed private pages; only safe under `qemu_filter()` (QemuProcess.spawn
    installs it). False: `readonly=on`, QEMU refuses every discard (the RAM file is safe
    without a filter, freed memory stays with the process until it ends)."""
    if [d.name for d in disks] != [d.name for d in machine.disks]:
        raise RuntimeError_(f"disks {[d.name for d in disks]} do not match the machine's "
                            f"{[d.name for d in machine.disks]}")
    if return_free_memory:
        for attach in disks:
            if attach.file and not attach.read_only:
                raise RuntimeError_(
                    f"disk {attach.name}: a writable file disk cannot run under the filter that "
                    "ignores punch-hole (QEMU's write-zeroes would trust the punch)")
    cpu = machine.cpu_model if machine.accel == "tcg" else "host"
    size = machine.memory_bytes
    # TCG's translation cache is private memory of every VM: a bounded buffer keeps it small
    # (a restored test guest answering /init fills ~18 MiB; a full buffer is flushed).
    accel = f"tcg,tb-size={tb_size_mib}" if machine.accel == "tcg" else "kvm"
    if machine.accel == "tcg" and tcg_single_thread:
        accel += ",thread=single"
    argv = [
        qemu_binary,
        "-accel", accel,
        "-M", f"{machine.machine_type},memory-backend=ram0",
        "-cpu", cpu,
        "-smp", str(machine.vcpus),
        "-m", f"{machine.memory_mib}M",
        "-object",
        f"memory-backend-file,id=ram0,size={size},mem-path={mem_path},"
        f"share=off,readonly={'off' if return_free_memory else 'on'},rom=off,prealloc=off",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-chardev", (f"socket,id=qmp,fd={qmp_fd},server=on,wait=off" if qmp_fd is not None
                     else f"socket,id=qmp,path={qmp_socket},server=on,wait=off"),
        "-mon", "chardev=qmp,mode=control",
        # append: the runtime trims the log from outside (runtime/serial.py), QEMU writes on
        # at its new end
        "-chardev", f"file,id=serial0,path={serial_log},append=on",
        "-serial", "chardev:serial0",
        "-device", f"vmgenid,id=vmgenid0,guid={vmgenid}",
        # page-poison=off: QEMU discards a reported page believing it then reads as zero, and a
        # guest zeroing pages on free (init_on_free) negotiates PAGE_POISON to rely on that. Ours
        # read back the snapshot's content, so such a guest must not report: without the
        # feature it turns reporting off itself. Guests that zero on allocation (the default
        # kernels) do not care and report; their snapshots restore unchanged either way.
        "-device",
        f"virtio-balloon-pci,id=balloon0,free-page-reporting=on,page-poison=off,"
        f"deflate-on-oom=on,addr={BALLOON_PCI_ADDR:#x}",
    ]
    if not incoming:
        # Only a boot needs the kernel: QEMU reads it and the initramfs into private memory
        # for fw_cfg (13 MiB per process here) that a restored guest never reads again. The
        # device state has no RAM section, so the option ROM -kernel adds is not missed.
        argv += ["-kernel", machine.kernel, "-append", machine.cmdline]
        if machine.initramfs:
            argv += ["-initrd", machine.initramfs]
    if machine.network:
        argv += [
            "-netdev", (f"tap,id=net0,fd={tap_fd},vhost=off" if tap_fd is not None
                        else "tap,id=net0,ifname=tap0,script=no,downscript=no,vhost=off"),
            "-device",
            f"virtio-net-pci,id=nic0,netdev=net0,mac={machine.mac},romfile=,addr={NET_PCI_ADDR:#x}",
        ]
    scsi = [d.name for d in machine.disks if d.bus == "virtio-scsi"]
    if len(scsi) > 1:
        # sd probes asynchronously: two SCSI disks could swap sda/sdb from one boot to the next.
        raise RuntimeError_(f"disks {scsi}: at most one disk can be on virtio-scsi")
    if scsi:
        argv += ["-device", f"virtio-scsi-pci,id=scsi0,addr={SCSI_PCI_ADDR:#x}"]
    for index, disk in enumerate(machine.disks):
        file_node_name = f"{disk.name}-file0"
        argv += [
            "-blockdev", _blockdev_arg(disks[index].file_node(file_node_name)),
            "-blockdev",
            _blockdev_arg({"driver": "raw", "node-name": disk.name, "file": file_node_name,
                           "read-only": disk.read_only}),
        ]
        # werror/rerror=report: an error goes to the guest (QEMU's default for ENOSPC pauses
        # the whole VM). virtio-blk has no ENOSPC status, so blockd's ENOSPC at a disk's cap
        # becomes IOERR (EIO); scsi-hd reports it as sense DATA PROTECT / SPACE ALLOCATION
        # FAILED (27/07), which Linux's SCSI layer completes as BLK_STS_NOSPC: ENOSPC.
        if disk.bus == "virtio-scsi":
            argv += ["-device", f"scsi-hd,id=dev-{disk.name},drive={disk.name},bus=scsi0.0,"
                                "channel=0,scsi-id=0,lun=0,werror=report,rerror=report"]
        else:
            # a volume disk is found by its serial in the guest (envd mounts it)
            serial = f",serial={VOLUME_SERIAL_PREFIX}{disk.name}" if disk.volume_slot else ""
            argv += ["-device", f"virtio-blk-pci,id=dev-{disk.name},drive={disk.name},"
                                f"addr={DISK_PCI_BASE + index:#x},werror=report,rerror=report"
                                f"{serial}"]
    if incoming:
        argv += ["-incoming", "defer"]
    if sandbox:
        argv += ["-sandbox", privilege.SANDBOX_ARG]
    return argv


def _preexec(netns: str | None, die_with_parent: bool = True, thp: bool = True,
             seccomp: SeccompProgram | None = None, *, user: VMUser | None = None,
             cgroup_procs: list[str] | None = None, tap_fd: int | None = None,
             jail_plan: jail.JailPlan | None = None,
             limits: jail.ProcessLimits | None = None) -> Any:
    def fail(code: int, what: str) -> None:
        # Runs between fork and exec: stderr is already qemu.stderr, where the parent reads it.
        with contextlib.suppress(OSError):
            os.write(2, f"aenv: before starting QEMU: {what}\n".encode())
        os._exit(code)

    def steps() -> None:
        os.setsid()
        if not thp:
            # QEMU asks for huge pages on its TCG code buffer, so each part of it a vCPU
            # thread starts writing costs 2 MiB; 4 KiB pages make the cache cost what it uses.
            _libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0)
        if netns:
            fd = os.open(netns, os.O_RDONLY)
            if _libc.setns(fd, _CLONE_NEWNET) != 0:
                fail(_EXIT_SETNS, f"setns({netns}): {os.strerror(ctypes.get_errno())}")
            os.close(fd)
        # Join the VM's cgroup before exec, so every page and thread of QEMU is charged there.
        for procs in cgroup_procs or ():
            try:
                with open(procs, "w") as f:
                    f.write("0")
            except OSError as exc:
                fail(_EXIT_CGROUP, f"joining cgroup {procs}: {exc}")
        if user is not None:
            try:
                if tap_fd is not None:
                    # Onto the number the parent reserved in pass_fds (subprocess closes
                    # every other fd after this function).
                    opened = privilege.open_tap()
                    os.dup2(opened, tap_fd)
                    os.close(opened)
            except OSError as exc:
                fail(_EXIT_PRIVILEGE, f"opening the TAP: {exc}")
            if jail_plan is not None:
                try:
                    jail.enter(jail_plan)
                except OSError as exc:
                    fail(_EXIT_JAIL, f"entering the VM's jail: {exc}")
        # After the TAP's dup2 (its number may be above the new descriptor limit), before the
        # drop (raising a hard limit needs root).
        if limits is not None:
            try:
                jail.apply_limits(limits)
            except (OSError, ValueError) as exc:
                fail(_EXIT_PRIVILEGE, f"setting QEMU's resource limits: {exc}")
        if user is not None:
            try:
                privilege.drop_privileges(user)
            except OSError as exc:
                fail(_EXIT_PRIVILEGE, f"becoming {user.name}: {exc}")
        # After the drop: changing credentials clears the parent-death signal.
        if die_with_parent:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The filter goes last, so nothing above runs under it. Root could load it without
        # no_new_privs (CAP_SYS_ADMIN); QEMU execs nothing setuid, so setting it costs nothing.
        if seccomp is not None and (
                _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                or _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER,
                               ctypes.byref(seccomp.fprog), 0, 0) != 0):
            fail(_EXIT_SECCOMP, f"seccomp: {os.strerror(ctypes.get_errno())}")

    def run() -> None:
        # Never let an exception out: subprocess would only say "Exception occurred in
        # preexec_fn" (seen about once in 500 spawns on a loaded host); exit with its message.
        try:
            steps()
        except BaseException as exc:
            fail(_EXIT_PREEXEC, f"{type(exc).__name__}: {exc}")

    return run


class PidfdProcess:
    """The parts of asyncio.subprocess.Process QemuProcess uses, for a process watched through
    a pidfd: a jailed QEMU (our child, forked outside asyncio: jail.spawn_in_new_pid_namespace)
    or one a restarted node adopts (runtime/adopt.py)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)
        self._exited = asyncio.Event()
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    def _exit_status(self) -> int:
        raise NotImplementedError

    def _on_exit(self) -> None:
        if self._exited.is_set():
            return
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self.returncode = self._exit_status()
        os.close(self._pidfd)
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self._exited.is_set():
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ChildProcess(PidfdProcess):
    """A child started with subprocess.Popen: reaped here when it exits (with its status)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen  # held so that subprocess never reaps it behind our back
        super().__init__(popen.pid)

    def _exit_status(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        self._popen.returncode = code
        return code


def ram_open_environment(mem_path: str) -> dict[str, str]:
    """QEMU's environment: the jail's, and the library that makes its open of `mem_path`
    read-only (module doc, "The RAM file is read-only to QEMU")."""
    if not os.path.exists(RAM_OPEN_LIBRARY):
        raise RuntimeError_(f"{RAM_OPEN_LIBRARY} is missing: the project's build makes it "
                            "(make venv, or pip install -e .)")
    return {**jail.ENVIRONMENT, "LD_PRELOAD": RAM_OPEN_LIBRARY, "AENV_RAM_FILE": mem_path}


def _jail_plan(mountpoint: Path, machine: MachineConfig, workdir: Path, mem_path: str,
               disks: list[DiskAttachment], incoming: bool, qemu_binary: str) -> jail.JailPlan:
    """What one QEMU opens by path: its workdir (QMP socket, serial log, device state), its RAM
    file, its disks (a file, or the directory of the NBD socket: blockd makes it again there
    after a restart), the kernel and initramfs of a boot, the binary if not under /usr."""
    writable: list[str] = [str(workdir)]
    read_only: list[str] = [mem_path]  # opened read-only (ram_open_environment)
    if not RAM_OPEN_LIBRARY.startswith("/usr/"):
        read_only.append(RAM_OPEN_LIBRARY)
    for disk in disks:
        if disk.nbd_socket:
            writable.append(os.path.dirname(disk.nbd_socket))
        elif disk.file:
            read_only.append(disk.file)
    if not incoming:
        read_only += [p for p in (machine.kernel, machine.initramfs) if p]
    binary = shutil.which(qemu_binary) or qemu_binary
    if not binary.startswith("/usr/"):
        read_only.append(binary)
    devices = [*jail.DEVICES, *(["/dev/kvm"] if machine.accel == "kvm" else [])]
    return jail.plan_jail(mountpoint, writable=writable, read_only=read_only, devices=devices)


@dataclass
class QemuProcess:
    """A running QEMU; `died` is set when it exits (for whatever reason)."""

    machine: MachineConfig
    workdir: Path
    process: asyncio.subprocess.Process
    qmp: QMPClient
    netns: str | None
    vmgenid: str
    stderr_log: Path
    mem_path: str = ""
    mem_stamp: FileStamp | None = None
    cgroup: Cgroup | None = None
    user: VMUser | None = None
    # Called once QEMU has exited (the jail's uid lease goes back to the pool).
    on_exit: Callable[[], None] | None = None
    died: asyncio.Event = field(default_factory=asyncio.Event)
    expected_exit: bool = False
    _watch: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def spawn(
        cls,
        machine: MachineConfig,
        workdir: Path,
        *,
        mem_path: str,
        disks: list[DiskAttachment],
        incoming: bool,
        netns: str | None = None,
        qemu_binary: str = "qemu-system-x86_64",
        die_with_parent: bool = True,
        tb_size_mib: int = 64,
        tcg_single_thread: bool = False,
        thp: bool = True,
        return_free_memory: bool = True,
        user: VMUser | None = None,
        sandbox: bool = False,
        cgroup: Cgroup | None = None,
        jail_root: Path | None = None,
        on_exit: Callable[[], None] | None = None,
        limits: jail.ProcessLimits | None = None,
    ) -> QemuProcess:
        """die_with_parent=False: QEMU outlives a crash of this process, so a restarted node
        can take it over again (agentenv.runtime.adopt). return_free_memory: see build_argv;
        True runs QEMU under qemu_filter()'s punch-hole rule. user: run QEMU as that unprivileged user
        (runtime/privilege.py); sandbox: QEMU's -sandbox; cgroup: QEMU starts inside it, and
        it is removed once QEMU has exited (before `died` is set). jail_root: run QEMU in a
        jail (runtime/jail.py) whose tmpfs root is mounted on this empty directory (in its own
        mount namespace); needs `user`. on_exit: called once a QEMU that started has exited.
        limits: QEMU's rlimits (runtime/jail.py ProcessLimits)."""
        seccomp = qemu_filter(return_free_memory, jail_root is not None)
        try:
            mem_stamp: FileStamp | None = FileStamp.of(mem_path)
        except FileNotFoundError:
            mem_stamp = None  # QEMU reports the missing file itself
        workdir.mkdir(parents=True, exist_ok=True)
        if user is not None:
            privilege.group_searchable(workdir, user)
            if jail_root is not None:
                os.chmod(workdir, 0o710)  # its own uid's group only (bound into its jail)
            privilege.precreate(workdir / "serial.log", user)
            with contextlib.suppress(FileNotFoundError):
                privilege.grant_ram_file(Path(mem_path), user)
        try:
            plan = None
            if jail_root is not None:
                if user is None:
                    raise RuntimeError_("a jailed QEMU needs an unprivileged user")
                plan = _jail_plan(jail_root, machine, workdir, mem_path, disks, incoming,
                                  qemu_binary)
            return await cls._spawn(machine, workdir, mem_path, mem_stamp, disks, incoming, netns,
                                    qemu_binary, die_with_parent, tb_size_mib, tcg_single_thread,
                                    thp, return_free_memory, user, sandbox, cgroup, seccomp, plan,
                                    on_exit, limits)
        except BaseException:
            await remove_cgroup_async(cgroup)  # its QEMU never started or has exited
            raise

    @classmethod
    async def _spawn(cls, machine: MachineConfig, workdir: Path, mem_path: str,
                     mem_stamp: FileStamp | None, disks: list[DiskAttachment], incoming: bool,
                     netns: str | None, qemu_binary: str, die_with_parent: bool,
                     tb_size_mib: int, tcg_single_thread: bool, thp: bool,
                     return_free_memory: bool, user: VMUser | None, sandbox: bool,
                     cgroup: Cgroup | None, seccomp: SeccompProgram | None,
                     plan: jail.JailPlan | None,
                     on_exit: Callable[[], None] | None,
                     limits: jail.ProcessLimits | None) -> QemuProcess:
        qmp_socket = workdir / "qmp.sock"
        vmgenid = str(uuid.uuid4())
        stderr_log = workdir / "qemu.stderr"
        for attempt in range(SPAWN_TRIES):
            # The runtime binds QMP's socket and QEMU inherits it listening: QEMU (maybe
            # unprivileged) needs no write access to its workdir, and the path stays where
            # adopt.py looks. The parent's copy is closed at once, so a QEMU that dies leaves
            # no listener behind and the connection fails instead of waiting.
            listener = _bind_qmp(qmp_socket)
            # A number for the TAP fd the child opens (see _preexec), held by /dev/null here.
            tap_slot = (os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
                        if user is not None and netns and machine.network else None)
            preexec = _preexec(netns, die_with_parent, thp, seccomp, user=user,
                               cgroup_procs=cgroup.procs_files if cgroup else None,
                               tap_fd=tap_slot, jail_plan=plan, limits=limits)
            keep = (listener.fileno(),) + ((tap_slot,) if tap_slot is not None else ())
            try:
                argv = build_argv(
                    machine, mem_path=mem_path, qmp_socket=qmp_socket,
                    serial_log=workdir / "serial.log", disks=disks, vmgenid=vmgenid,
                    incoming=incoming, qemu_binary=qemu_binary, tb_size_mib=tb_size_mib,
                    tcg_single_thread=tcg_single_thread, return_free_memory=return_free_memory,
                    qmp_fd=listener.fileno(), sandbox=sandbox, tap_fd=tap_slot,
                )
                (workdir / "argv").write_text("\n".join(argv) + "\n")
                # appended to (O_APPEND), so that the runtime can trim it from outside as it
                # trims the serial log (runtime/serial.py): QEMU writes on at the new end
                err_fd = os.open(stderr_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
                                 | os.O_CLOEXEC, 0o600)
                with open(err_fd, "wb") as err:
                    # pass_fds keeps the listener open (same number) across exec.
                    popen_args: dict[str, Any] = dict(
                        stdin=subprocess.DEVNULL, stdout=err, stderr=err, preexec_fn=preexec,
                        pass_fds=keep, env=ram_open_environment(mem_path))
                    process: asyncio.subprocess.Process | ChildProcess
                    if plan is not None:
                        process = ChildProcess(
                            jail.spawn_in_new_pid_namespace(argv, **popen_args))
                    else:
                        process = await asyncio.create_subprocess_exec(*argv, **popen_args)
            finally:
                listener.close()
                if tap_slot is not None:
                    os.close(tap_slot)
            try:
                qmp = await _connect_or_fail(qmp_socket, process, stderr_log)
                break
            except VMDiedError as exc:
                # The child failed between fork and exec (_preexec): nothing was started,
                # so another try is clean.
                if process.returncode not in _PREEXEC_EXITS or attempt == SPAWN_TRIES - 1:
                    raise
                log.warning("QEMU spawn failed before exec, trying again",
                            extra={"workdir": str(workdir), "error": str(exc)})
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
                raise
        vm = cls(machine, workdir, process, qmp, netns, vmgenid, stderr_log, mem_path,  # type: ignore[arg-type]
                 mem_stamp, cgroup, user, on_exit)
        vm._watch = asyncio.create_task(vm._watch_exit())
        return vm

    async def _watch_exit(self) -> None:
        await self.process.wait()
        try:
            await remove_cgroup_async(self.cgroup)
        finally:
            if self.on_exit is not None:
                self.on_exit()
            self.died.set()

    def exit_reason(self) -> str:
        try:
            tail = file_tail(self.stderr_log, 500)
        except OSError:
            tail = ""
        code = self.process.returncode
        return (f"QEMU pid {self.pid} exited with status {code}{_status_meaning(code)}"
                + (f": {tail}" if tail else ""))

    def mem_file_changed(self) -> str | None:
        """Why the RAM file is not what it was when QEMU started (None: unchanged). The file
        is shared by every VM of a snapshot and must never change (see the module doc)."""
        if self.mem_stamp is None:
            return None
        try:
            now = FileStamp.of(self.mem_path)
        except FileNotFoundError:
            return None  # released and removed after its last user: not a change
        if now != self.mem_stamp:
            return f"RAM file {self.mem_path} changed while QEMU ran: {self.mem_stamp} -> {now}"
        return None

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float = 60.0) -> Any:
        try:
            return await self.qmp.execute(command, arguments, timeout=timeout)
        except QMPError as exc:
            if self.died.is_set() or self.qmp.closed.is_set():
                try:
                    await asyncio.wait_for(self.died.wait(), 5)
                except TimeoutError:
                    raise QMPError(f"{exc}, and QEMU has not exited 5 s after its QMP "
                                   f"connection closed; {_stuck_where(self.pid)}") from None
                raise VMDiedError(self.exit_reason()) from None
            raise

    async def stop_process(self, timeout: float = 3.0) -> None:
        """Quit QEMU (quit over QMP, then SIGKILL) and wait for it."""
        self.expected_exit = True
        if self.process.returncode is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.qmp.execute("quit"), 1.0)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        await self.qmp.close()
        if self._watch is not None:
            with contextlib.suppress(Exception):
                await self._watch
        changed = self.mem_file_changed()
        if changed:
            log.error("shared RAM file modified", extra={"pid": self.pid, "reason": changed})


def _bind_qmp(path: Path) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(4)
    except BaseException:
        listener.close()
        raise
    return listener


def _status_meaning(code: int | None) -> str:
    if code == _EXIT_SETNS:
        return " (could not enter the network slot's namespace)"
    if code == _EXIT_SECCOMP:
        return " (could not install the seccomp filter)"
    if code == _EXIT_PREEXEC:
        return " (failed before exec)"
    if code == _EXIT_CGROUP:
        return " (could not join its cgroup)"
    if code == _EXIT_PRIVILEGE:
        return " (could not drop to its unprivileged user)"
    if code == _EXIT_JAIL:
        return " (could not enter its jail)"
    return ""


T = TypeVar("T")


class _Exited(Exception):
    pass


async def _unless_exited(process: asyncio.subprocess.Process, call: Awaitable[T]) -> T:
    """`call`, unless the process exits first (_Exited): a connection the kernel accepted for
    a QEMU that then died before exec would wait for a greeting until its timeout."""
    work = asyncio.ensure_future(call)
    exited = asyncio.ensure_future(process.wait())
    try:
        await asyncio.wait({work, exited}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        exited.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    raise _Exited


async def _connect_or_fail(
    qmp_socket: Path, process: asyncio.subprocess.Process, stderr_log: Path
) -> QMPClient:
    # QMP's socket exists from the start (the runtime bound it), so the wait for the greeting
    # covers QEMU's whole start-up.
    deadline = time.monotonic() + 30
    while True:
        if process.returncode is not None:
            tail = file_tail(stderr_log, 800)
            raise VMDiedError(f"QEMU exited at start with status {process.returncode}"
                              f"{_status_meaning(process.returncode)}: {tail}")
        if qmp_socket.exists():
            try:
                return await _unless_exited(process, QMPClient.connect(
                    qmp_socket, timeout=max(1.0, deadline - time.monotonic())))
            except _Exited:
                continue  # reported by the check above
            except (QMPError, OSError, TimeoutError) as exc:
                # A QEMU that died is reported by the check above on the next turn.
                if process.returncode is not None or time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                    continue
                raise QMPError(f"{exc or type(exc).__name__}; {_stuck_where(process.pid)}"
                               ) from exc
        if time.monotonic() > deadline:
            raise QMPError("QEMU did not answer on its QMP socket within 30 s; "
                           f"{_stuck_where(process.pid)}")
        await asyncio.sleep(0.002)


def _stuck_where(pid: int) -> str:
    """Where a QEMU that does not answer is (its state and kernel wait channel, of it and of
    its threads): a start held in the kernel (a FUSE file of the jail, a lock) shows here."""
    def of(task: str) -> str:
        try:
            with open(f"{task}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
            with open(f"{task}/wchan") as f:
                wchan = f.read().strip() or "-"
            with open(f"{task}/comm") as f:
                comm = f.read().strip()
        except OSError:
            return "?"
        return f"{comm} {state} {wchan}"

    try:
        tasks = sorted(os.listdir(f"/proc/{pid}/task"), key=int)[:8]
    except OSError:
        return f"QEMU pid {pid} is gone"
    return f"QEMU pid {pid} threads: " + ", ".join(of(f"/proc/{pid}/task/{t}") for t in tasks)
