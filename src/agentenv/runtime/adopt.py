"""Taking running VMs over again after the process that ran them died (kill -9, crash).

A VM outlives its runtime's process when the runtime spawns QEMU without PDEATHSIG
(`RuntimeConfig.qemu_die_with_parent=False`). Everything needed to drive it again is small and
is written by the owner next to its own records as a manifest (`vm_manifest`, plain JSON):

- the QEMU pid and its start time (a recycled pid is never mistaken for the VM),
- the QMP socket (QEMU's QMP server accepts a new client once the old one is gone),
- the network slot index (its namespace and veth stay up while QEMU holds the TAP),
- the blockd device of every disk and the sealed layers under it (blockd devices outlive
  their clients),
- the memory lineage (memory layers, the RAM file QEMU maps, its cache key).

`adopt_vm(runtime, manifest)` checks all of that, reconnects QMP, claims the slot and the RAM
file in the runtime's pools and registers the VM with `Runtime.track`: it can then be paused,
snapshotted, forked and killed like a VM the runtime started. `AdoptedProcess` stands in for
the asyncio subprocess handle of a QEMU that is not our child (its exit is seen via a pidfd).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import signal
from pathlib import Path
from typing import Any

from agentenv.runtime import privilege
from agentenv.runtime.cgroup import Cgroup
from agentenv.runtime.disks import AttachedDisk
from agentenv.runtime.errors import QMPError, RuntimeError_
from agentenv.runtime.privilege import VMUser
from agentenv.runtime.qemu import PidfdProcess, QemuProcess
from agentenv.runtime.qmp import QMPClient
from agentenv.runtime.vm import VM, Runtime
from agentenv.snapshot.record import DiskConfig, LayerRef, MachineConfig

MANIFEST_FORMAT = 1


class AdoptError(RuntimeError_):
    """A VM left by an earlier process cannot be taken over (gone, replaced, or unreachable)."""


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot): with the pid, names one process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def vm_manifest(vm: VM) -> dict[str, Any]:
    """What a later process needs to take `vm` over; JSON-serialisable. Write it again after
    every snapshot of a VM that keeps running (its disks gain a sealed layer)."""
    return {
        "format": MANIFEST_FORMAT,
        "id": vm.id,
        "pid": vm.pid,
        "pid_start": process_start_time(vm.pid),
        "machine": vm.machine.model_dump(mode="json"),
        "workdir": str(vm.workdir),
        "qmp_socket": str(vm.workdir / "qmp.sock"),
        "stderr_log": str(vm.process.stderr_log),
        "netns": vm.process.netns,
        "vmgenid": vm.vmgenid,
        "slot": None if vm.slot is None else {"index": vm.slot.index, "prefix": vm.slot.prefix,
                                              "outbound": vm.slot.outbound},
        "memory_layers": [x.model_dump(mode="json") for x in vm.memory_layers],
        "mem_key": vm.mem_key,
        "mem_path": str(vm.mem_path),
        "disks": [{"config": d.config.model_dump(mode="json"),
                   "layers": [x.model_dump(mode="json") for x in d.layers],
                   "device_id": d.device_id, "file": str(d.file) if d.file else None}
                  for d in vm.disks],
        "parent_snapshot": vm.parent_snapshot,
        "started_at": vm.started_at,
        # Removed once the adopted QEMU exits (else by the next start's clean-up).
        "cgroup": ([str(d) for d in vm.process.cgroup.dirs] if vm.process.cgroup else []),
    }


def manifest_alive(manifest: dict[str, Any]) -> bool:
    """True while the manifest's QEMU process still runs (same pid, same start time)."""
    pid = int(manifest.get("pid") or 0)
    if pid <= 0 or process_start_time(pid) != manifest.get("pid_start"):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read()
    except OSError:
        return False
    # The QMP socket is an inherited fd (`fd=N`); the serial log names the VM's workdir.
    workdir = str(manifest.get("workdir") or "")
    return bool(workdir) and f"{workdir}/serial.log".encode() in argv


class AdoptedProcess(PidfdProcess):
    """A QEMU that is not our child: its exit status cannot be known."""

    def _exit_status(self) -> int:
        return -signal.SIGKILL  # the status is the reaper's; -9 says "ended from outside"


def _running_as(pid: int, runtime: Runtime) -> VMUser | None:
    """The unprivileged identity a QEMU runs as (None: root), from /proc: QEMU writes the
    device state of a snapshot into files made for it (runtime/privilege.py). A jailed QEMU's
    uid has no passwd entry; its shared group is the runtime's VM group."""
    ids: dict[str, list[int]] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("Uid", "Gid", "Groups"):
                ids[key] = [int(x) for x in value.split()]
    except (OSError, ValueError):
        return None
    uid, gid = ids.get("Uid", [0])[0], ids.get("Gid", [0])[0]
    if uid == 0:
        return None
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = f"vm uid {uid}"
    shared = privilege.vm_group(runtime.config.qemu_user)
    groups = tuple(ids.get("Groups", []))
    return VMUser(name, uid, gid, groups,
                  shared_gid=shared if shared is not None and shared in groups else None)


async def adopt_vm(runtime: Runtime, manifest: dict[str, Any]) -> VM:
    """Take over the running VM `manifest` describes; AdoptError when it cannot be (the caller
    then ends it with `abandon`)."""
    if manifest.get("format") != MANIFEST_FORMAT:
        raise AdoptError(f"VM manifest format {manifest.get('format')!r} is not {MANIFEST_FORMAT}")
    if not manifest_alive(manifest):
        raise AdoptError(f"QEMU pid {manifest.get('pid')} of VM {manifest.get('id')} is gone")
    machine = MachineConfig.model_validate(manifest["machine"])
    disks = [AttachedDisk(DiskConfig.model_validate(d["config"]),
                           [LayerRef.model_validate(x) for x in d["layers"]],
                           device_id=d.get("device_id"),
                           file=Path(d["file"]) if d.get("file") else None)
             for d in manifest["disks"]]
    wanted = {d.device_id for d in disks if d.device_id is not None}
    if wanted:
        if runtime.blockd is None:
            raise AdoptError(f"VM {manifest['id']} has blockd disks and the runtime has no blockd")
        served = {info.id for info in await runtime.blockd.list()}
        if wanted - served:
            raise AdoptError(f"blockd no longer serves the disks {sorted(wanted - served)} "
                             f"of VM {manifest['id']}")
    process = AdoptedProcess(int(manifest["pid"]))
    user = _running_as(process.pid, runtime)
    try:
        qmp = await QMPClient.connect(Path(manifest["qmp_socket"]), timeout=5)
    except (QMPError, OSError, TimeoutError) as exc:
        process._on_exit()
        raise AdoptError(f"QMP of VM {manifest['id']} does not answer: {exc}") from exc
    qemu = QemuProcess(machine, Path(manifest["workdir"]), process, qmp,  # type: ignore[arg-type]
                       manifest.get("netns"), str(manifest["vmgenid"]),
                       Path(manifest["stderr_log"]),
                       cgroup=(Cgroup(str(manifest["id"]), [Path(d) for d in manifest["cgroup"]])
                               if manifest.get("cgroup") else None),
                       user=user, on_exit=runtime.uid_releaser(user))
    qemu._watch = asyncio.create_task(qemu._watch_exit())
    try:
        status = await qemu.execute("query-status")
        if status.get("status") == "paused":
            # The earlier process died inside a snapshot (after `stop`): let the guest go on.
            await qemu.execute("cont")
        elif not status.get("running"):
            raise AdoptError(f"VM {manifest['id']} is in QEMU state {status.get('status')!r}")
    except BaseException:
        await qmp.close()
        raise
    slot = None
    if manifest.get("slot"):
        raw = manifest["slot"]
        slot = runtime.slots.claim(int(raw["index"]), bool(raw.get("outbound", True)))
    mem_key = manifest.get("mem_key")
    mem_path = Path(manifest["mem_path"])
    layers = [LayerRef.model_validate(x) for x in manifest["memory_layers"]]
    if mem_key:
        # One more reference on the RAM file (it is rebuilt if it was removed meanwhile).
        mem_path = await asyncio.to_thread(runtime.memory.acquire, mem_key,
                                           [Path(x.path) for x in layers], machine.memory_bytes)
    vm = VM(str(manifest["id"]), machine, qemu, slot, Path(manifest["workdir"]), layers,
            mem_key, mem_path, disks, state="running",
            started_at=float(manifest.get("started_at") or 0.0),
            parent_snapshot=manifest.get("parent_snapshot"))
    runtime.track(vm)
    return vm


async def abandon(runtime: Runtime, manifest: dict[str, Any]) -> None:
    """End what is left of a VM that cannot be adopted: its QEMU (if this manifest's process
    still runs), its blockd devices, its slot's namespace and its work directory."""
    import shutil

    from agentenv.runtime.network import NetworkSlot

    if manifest_alive(manifest):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(manifest["pid"]), signal.SIGKILL)
        for _ in range(200):
            if not manifest_alive(manifest):
                break
            await asyncio.sleep(0.025)
    if runtime.blockd is not None:
        for disk in manifest.get("disks", []):
            if disk.get("device_id"):
                with contextlib.suppress(Exception):
                    await runtime.blockd.release(disk["device_id"])
    raw = manifest.get("slot")
    if raw:
        with contextlib.suppress(Exception):
            await NetworkSlot(int(raw["index"]), str(raw["prefix"])).destroy()
    if manifest.get("workdir"):
        shutil.rmtree(manifest["workdir"], ignore_errors=True)
