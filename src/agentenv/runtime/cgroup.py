"""One cgroup per QEMU process: memory, CPU, I/O and task limits.

    manager = CgroupManager.detect(config)          # at Runtime.start
    group = manager.create("vmid", limits_for(...))  # before spawn; QEMU joins it in _preexec
    manager.remove(group)                            # after QEMU exited

Layout. cgroup v2 (`/sys/fs/cgroup` is cgroup2 with the memory, cpu, io and pids controllers):
`<parent>/<vm>` with memory.max, cpu.weight, cpu.max, io.max, pids.max; the parent
(default `<prefix>-<hash of the state dir>.slice`, default_parent) gets the controllers in its
subtree_control and is removed at the runtime's close when empty. A relative parent lies under
the node's own cgroup, an absolute one under the hierarchy's root. The v2 parent keeps the
default weight (100), as systemd's machine.slice does for libvirt's VMs: all VMs together weigh
what the node's own service group does, never more (see "CPU weight" below).
A hybrid host (cgroup v1 controllers, an empty cgroup2 at `unified`, as on this build host)
gets the same limits through v1: memory.limit_in_bytes, cpu.shares, cpu.cfs_quota_us,
blkio.throttle.*, pids.max, one directory per controller hierarchy: `<parent>/<vm>` in the
memory, blkio and pids hierarchies, but in the cpu hierarchy each VM's group sits directly
beside the parent's place (`<parent stem>-<vm>`, flat): a peer of the node's, blockd's and
memfs's processes, as an uncontained QEMU is.

CPU weight, the measured cause of "fork of 16 misses its envd deadline under v1" (2026-12-03,
tests/runtime/test_lifecycle.py fork of 16, /proc/<pid>/task/*/schedstat of the test's process
tree and every VM group's memory.stat/cpu.stat sampled each 0.5 s; bench/RESULTS.md "Per-VM
cgroups on by default"). The parent used to weigh the SUM of its VMs' weights (17 VMs x 2 vCPUs:
cpu.shares 34816, 34 normal tasks). A group's weight counts in full whenever ANY of its tasks
is runnable, so 17 mostly idle VMs outweighed blockd (NBD disks), memfs (the RAM file, FUSE) and
the runtime's event loop (QMP, envd /init) 17:1 per CPU, where uncontained each runnable QEMU
thread weighs one task. Over 39 s of the fork: the runtime's process waited 36 s for a CPU
and ran 0.17 s, blockd waited 27.5 s; every VM waited on them, the fork took 34.4 s and the test
165 s, against 11.4 s / 24 s without cgroups. With the parent at its default weight (same
run, nothing else changed): fork 9.6 s, test 15.6 s. Ruled out by the same sampling: the memory
limit (memory.failcnt 0 in every group; the page cache of the shared RAM file is charged to
whichever VM faults a page first: up to 83 MiB in one child, none in most, 151 MiB in the
source's group, which peaked at 357 of its 392 MiB), the CPU quota (nr_throttled 0), blkio (no
throttle set by default), cpuset (not used), swap (the host has none).

When none is usable: `cgroups="auto"` (default) logs a warning once and VMs run without
limits (`CgroupManager.enabled` is False); `"on"` fails at start with the missing controllers
named; `"off"` never touches cgroups; `"v1"` (the former opt-in) is the same as "auto".

Leftovers: at start every empty VM group of this runtime is removed (a VM whose runtime
crashed); a group with processes is a QEMU that outlived its runtime (adopt.py) and stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.errors import RuntimeError_
from agentenv.snapshot.record import MachineConfig

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
V2_CONTROLLERS = ("memory", "cpu", "io", "pids")
# v1 hierarchy names: memory and cpu are required, blkio and pids are used when mounted.
V1_REQUIRED = ("memory", "cpu")
V1_OPTIONAL = ("blkio", "pids")
CPU_PERIOD_US = 100_000


class CgroupError(RuntimeError_):
    """cgroups are required and not usable, or a VM's cgroup could not be made."""


@dataclass(frozen=True)
class IOLimit:
    """Per-device throttle ("MAJ:MIN"); 0 means unlimited."""

    device: str
    read_bps: int = 0
    write_bps: int = 0
    read_iops: int = 0
    write_iops: int = 0

    def any(self) -> bool:
        return bool(self.read_bps or self.write_bps or self.read_iops or self.write_iops)


@dataclass(frozen=True)
class Limits:
    memory_max: int  # bytes
    cpu_weight: int  # v2 scale, 1..10000 (100 = one default share)
    cpu_quota_us: int | None  # per CPU_PERIOD_US; None: no cap
    pids_max: int | None = None
    io: IOLimit | None = None


@dataclass
class Cgroup:
    """A VM's cgroup: one directory (v2) or one per controller hierarchy (v1)."""

    name: str
    dirs: list[Path] = field(default_factory=list)

    @property
    def procs_files(self) -> list[str]:
        """cgroup.procs of each directory: the child writes "0" there before exec."""
        return [str(d / "cgroup.procs") for d in self.dirs]


def default_parent(prefix: str, state_dir: Path) -> str:
    """The VMs' parent cgroup when none is configured: named after the runtime's network
    prefix AND its state directory. A prefix is unique per network namespace only, and cgroupfs
    is host-wide: runtimes in different namespaces (scripts/isolated.sh runs, every checkout's
    tests/runtime using the same prefix) would otherwise share one parent, each writing its own
    VMs' weight sum into the parent's cpu.shares / cpu.weight over the others' (a parent holding
    17 VMs then weighed what another runtime's 1 VM did). The state directory stays the same
    across restarts, so a restarted runtime finds its leftovers and adopted VMs' groups again."""
    digest = hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:8]
    return f"{prefix}-{digest}.slice"


def _own_cgroup(controller: str | None) -> str:
    """The node's own cgroup path in a hierarchy (`controller` None: the v2 one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller is None and names == "":
            return path
        if controller is not None and controller in names.split(","):
            return path
    return "/"


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class CgroupManager:
    def __init__(self, version: Literal[1, 2] | None, parents: dict[str, Path],
                 flat: dict[str, str] | None = None) -> None:
        """`parents`: hierarchy name ("" for v2) -> the directory holding the VM cgroups.
        `flat`: hierarchy name -> name prefix, for the hierarchies whose VM groups sit flat in
        that directory as `<prefix><vm>` (v1 cpu: module doc) instead of in a parent of
        their own; the directory is then not this manager's to remove."""
        self.version = version
        self.parents = parents
        self.flat = flat or {}

    @property
    def enabled(self) -> bool:
        return self.version is not None

    @classmethod
    def detect(cls, mode: Literal["auto", "on", "off", "v1"], parent: str,
               root: Path = CGROUP_ROOT) -> CgroupManager:
        if mode == "off":
            return cls(None, {})
        problems: list[str] = []
        manager = cls._try_v2(root, parent, problems)
        if manager is None:
            manager = cls._try_v1(root, parent, problems)
        if manager is not None:
            manager._clean_leftovers()
            log.info("cgroups", extra={"version": manager.version, "flat": manager.flat,
                                        "parents": {k: str(v) for k, v in manager.parents.items()}})
            return manager
        why = "; ".join(problems)
        if mode == "on":
            raise CgroupError(f"per-VM cgroups are required (cgroups=on) but not usable: {why}")
        log.warning("per-VM cgroups unavailable, VMs run without memory/CPU/IO limits: %s", why,
                    extra={"reason": why})
        return cls(None, {})

    @classmethod
    def _try_v2(cls, root: Path, parent: str, problems: list[str]) -> CgroupManager | None:
        controllers_file = root / "cgroup.controllers"
        if not controllers_file.exists():
            problems.append(f"{root} is not a cgroup2 mount")
            return None
        available = set(controllers_file.read_text().split())
        missing = [c for c in ("memory", "cpu") if c not in available]
        if missing:
            problems.append(f"cgroup2 at {root} lacks the {', '.join(missing)} controller(s)")
            return None
        base = root / (parent.lstrip("/") if parent.startswith("/")
                       else f"{_own_cgroup(None).strip('/')}/{parent}".lstrip("/"))
        wanted = [c for c in V2_CONTROLLERS if c in available]
        try:
            base.mkdir(parents=True, exist_ok=True)
            # Every cgroup from the root down to the parent passes the controllers on.
            enable = " ".join(f"+{c}" for c in wanted)
            relative = base.relative_to(root).parts
            for depth in range(len(relative) + 1):
                _write(root.joinpath(*relative[:depth]) / "cgroup.subtree_control", enable)
        except OSError as exc:
            hint = (" (a cgroup with processes cannot pass controllers on: set the parent to an"
                    " absolute path such as /aenv.slice, AENV_CGROUP_PARENT)"
                    if exc.errno == errno.EBUSY else "")
            problems.append(f"cannot enable {wanted} under {base}: {exc.strerror or exc}{hint}")
            return None
        return cls(2, {"": base})

    @classmethod
    def _try_v1(cls, root: Path, parent: str, problems: list[str]) -> CgroupManager | None:
        parents: dict[str, Path] = {}
        flat: dict[str, str] = {}
        for controller in (*V1_REQUIRED, *V1_OPTIONAL):
            mount = root / controller
            if not (mount / "cgroup.procs").exists() or (mount / "cgroup.controllers").exists():
                if controller in V1_REQUIRED:
                    problems.append(f"no cgroup v1 {controller} hierarchy at {mount}")
                    return None
                continue
            base = mount / (parent.lstrip("/") if parent.startswith("/")
                            else f"{_own_cgroup(controller).strip('/')}/{parent}".lstrip("/"))
            if controller == "cpu" and base != mount:
                # Flat: the VMs' cpu groups are peers of the node's processes (module doc).
                flat[controller] = f"{base.name.removesuffix('.slice')}-"
                base = base.parent
            try:
                base.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                if controller in V1_REQUIRED:
                    problems.append(f"cannot create {base}: {exc.strerror or exc}")
                    return None
                continue
            parents[controller] = base
        return cls(1, parents, flat)

    def close(self) -> None:
        """At the runtime's end: its parent directories go when no VM group is left in them
        (a VM that outlives the runtime keeps its parent)."""
        for controller, base in self.parents.items():
            if controller not in self.flat:
                with contextlib.suppress(OSError):
                    base.rmdir()

    def _clean_leftovers(self) -> None:
        for controller, base in self.parents.items():
            prefix = self.flat.get(controller, "")
            for child in base.iterdir():
                if child.is_dir() and child.name.startswith(prefix) and not _has_procs(child):
                    with contextlib.suppress(OSError):
                        child.rmdir()

    # -- per VM ---------------------------------------------------------------------------

    def create(self, name: str, limits: Limits) -> Cgroup | None:
        """The VM's cgroup with its limits set (None when cgroups are off)."""
        if self.version is None:
            return None
        group = Cgroup(name)
        try:
            if self.version == 2:
                directory = self.parents[""] / name
                directory.mkdir(exist_ok=True)
                group.dirs.append(directory)
                _write(directory / "memory.max", str(limits.memory_max))
                if (directory / "memory.swap.max").exists():
                    _write(directory / "memory.swap.max", "0")
                _write(directory / "cpu.weight", str(max(1, min(10000, limits.cpu_weight))))
                _write(directory / "cpu.max", f"{limits.cpu_quota_us or 'max'} {CPU_PERIOD_US}")
                if limits.pids_max and (directory / "pids.max").exists():
                    _write(directory / "pids.max", str(limits.pids_max))
                if limits.io is not None and limits.io.any() and (directory / "io.max").exists():
                    io = limits.io
                    _write(directory / "io.max",
                           f"{io.device} rbps={io.read_bps or 'max'} wbps={io.write_bps or 'max'}"
                           f" riops={io.read_iops or 'max'} wiops={io.write_iops or 'max'}")
            else:
                for controller, base in self.parents.items():
                    directory = base / f"{self.flat.get(controller, '')}{name}"
                    directory.mkdir(exist_ok=True)
                    group.dirs.append(directory)
                    self._set_v1(controller, directory, limits)
        except OSError as exc:
            self.remove(group)
            raise CgroupError(f"cgroup {name}: cannot set limits: {exc}") from exc
        return group

    @staticmethod
    def _set_v1(controller: str, directory: Path, limits: Limits) -> None:
        if controller == "memory":
            _write(directory / "memory.limit_in_bytes", str(limits.memory_max))
        elif controller == "cpu":
            # cpu.weight 100 <-> cpu.shares 1024
            _write(directory / "cpu.shares", str(max(2, limits.cpu_weight * 1024 // 100)))
            _write(directory / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(directory / "cpu.cfs_quota_us", str(limits.cpu_quota_us or -1))
        elif controller == "pids" and limits.pids_max:
            _write(directory / "pids.max", str(limits.pids_max))
        elif controller == "blkio" and limits.io is not None and limits.io.any():
            io = limits.io
            for key, value in (("read_bps", io.read_bps), ("write_bps", io.write_bps),
                               ("read_iops", io.read_iops), ("write_iops", io.write_iops)):
                if value:
                    _write(directory / f"blkio.throttle.{key}_device", f"{io.device} {value}")

    def remove(self, group: Cgroup | None) -> None:
        remove_cgroup(group)

    def memory_peak(self, group: Cgroup) -> int | None:
        """Highest memory charge of the cgroup so far (bytes), if the kernel reports it."""
        for directory in group.dirs:
            for name in ("memory.peak", "memory.max_usage_in_bytes"):
                with contextlib.suppress(OSError, ValueError):
                    return int((directory / name).read_text())
        return None

    def oom_kills(self, group: Cgroup) -> int:
        """OOM kills in the cgroup (QEMU killed for passing its memory limit)."""
        for directory in group.dirs:
            for name, key in (("memory.events", "oom_kill"), ("memory.oom_control", "oom_kill")):
                with contextlib.suppress(OSError):
                    for line in (directory / name).read_text().splitlines():
                        parts = line.split()
                        if len(parts) == 2 and parts[0] == key:
                            return int(parts[1])
        return 0


def remove_cgroup(group: Cgroup | None) -> bool:
    """Remove a VM's cgroup whose processes are gone; False if some directory stays (still
    busy: the kernel empties a cgroup a moment after its last task is reaped)."""
    if group is None:
        return True
    done = True
    for directory in group.dirs:
        try:
            directory.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            done = False
            if exc.errno != errno.EBUSY:
                log.warning("cgroup not removed", extra={"cgroup": str(directory),
                                                         "error": str(exc)})
    return done


async def remove_cgroup_async(group: Cgroup | None) -> None:
    """remove_cgroup, retried for up to a second while the cgroup is still busy."""
    for _ in range(100):
        if remove_cgroup(group):
            return
        await asyncio.sleep(0.01)
    log.warning("cgroup still busy, left for the next start's clean-up",
                extra={"cgroup": group.name if group else ""})


# QEMU's own memory besides guest RAM under TCG, measured (bench/RESULTS.md, "Least
# privilege"): RSS of an idle restored VM minus the guest RAM it touched. The TCG translation
# buffer (tcg_tb_size_mib) comes on top, as the guest's code fills it.
QEMU_BASE_OVERHEAD_MIB = 64


def vm_memory_overhead_mib(machine: MachineConfig, config: RuntimeConfig) -> int:
    if config.vm_memory_overhead_mib is not None:
        return config.vm_memory_overhead_mib
    tb = config.tcg_tb_size_mib if machine.accel == "tcg" else 0
    return QEMU_BASE_OVERHEAD_MIB + tb + 4 * machine.vcpus


def limits_for(machine: MachineConfig, config: RuntimeConfig, io: IOLimit | None,
               vcpu_threads: int | None = None) -> Limits:
    """A VM's cgroup limits from its machine (vCPUs, memory) and the runtime's settings.
    `vcpu_threads`: the host threads running its vCPUs when fewer than its vCPUs (1 under
    single-threaded TCG): the weight is per such thread, as each weighed one task uncontained
    (a weight per vCPU made such a VM twice the runtime's own process: a fork of 16 on a quiet
    host took 10.0-10.7 s instead of 6.5-7.9 s). The CPU cap stays per vCPU."""
    quota = (int(machine.vcpus * config.cpu_max_per_vcpu * CPU_PERIOD_US)
             if config.cpu_max_per_vcpu > 0 else None)
    return Limits(
        memory_max=machine.memory_bytes + (vm_memory_overhead_mib(machine, config) << 20),
        cpu_weight=config.cpu_weight_per_vcpu * min(machine.vcpus, vcpu_threads or machine.vcpus),
        cpu_quota_us=quota,
        pids_max=config.qemu_pids_max or None, io=io)


def _has_procs(directory: Path) -> bool:
    try:
        return bool((directory / "cgroup.procs").read_text().strip())
    except OSError:
        return True


def io_device(path: Path) -> str | None:
    """MAJ:MIN of the block device holding `path` (None for a filesystem without one)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:
        return None  # tmpfs, overlay, ...: no block device to throttle
    return f"{major}:{minor}"
