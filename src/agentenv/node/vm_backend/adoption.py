"""VM manifests and taking VMs over after a node crash.

QEMU runs without PDEATHSIG, so VMs outlive a node killed with SIGKILL. Every running sandbox
VM has a manifest (<state>/vm-backend/sandboxes/<id>.vm.json: pid, QMP socket, slot, blockd
devices, memory lineage, envd token; runtime/adopt.py); a ready-pool VM has one under
<state>/vm-backend/pool/ (node/ready_pool.py writes those). The next start reads them
(Leftovers), kills whatever else of the previous run still names the state directory
(reap_leftovers), takes each sandbox VM over again when its QEMU and its blockd devices are still
there (take_over) and ends the others, and ends every pooled VM (they were not sandboxes yet).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.fsutil import atomic_write_json
from agentenv.runtime.adopt import abandon, adopt_vm, manifest_alive, vm_manifest
from agentenv.runtime.errors import RuntimeError_
from agentenv.runtime.vm import VM, Runtime

log = logging.getLogger("agentenv.node.vm_backend")

#: a manifest as written (JSON): runtime/adopt.py's vm_manifest plus the node's fields
Manifest = dict[str, Any]


class VmManifests:
    """One directory of `<id>.vm.json` manifests."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, vm_key: str) -> Path:
        return self.directory / f"{vm_key}.vm.json"

    def save(self, sandbox_id: str, vm: VM, *, blockd: dict[str, Any] | None,
             guest_token: str | None) -> None:
        """The running VM's manifest, for a node restarted after a crash."""
        atomic_write_json(self.path(sandbox_id),
                          {**vm_manifest(vm),
                           # which blockd served its disks: a later start sees a blockd restart
                           "blockd": blockd,
                           # its disks reconnect when blockd restarts (runtime/qemu.py)
                           "nbd_reconnect": True,
                           "guest_token": guest_token})

    def drop(self, vm_key: str) -> None:
        self.path(vm_key).unlink(missing_ok=True)

    def load(self) -> dict[str, Manifest]:
        """Every readable manifest by key; unreadable ones are deleted."""
        found: dict[str, Manifest] = {}
        for path in self.directory.glob("*.vm.json"):
            try:
                found[path.name.removesuffix(".vm.json")] = json.loads(path.read_text())
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
        return found


@dataclass
class Leftovers:
    """What the previous run of the node left on this state directory."""

    #: manifests of its sandbox VMs, by sandbox id
    sandboxes: dict[str, Manifest]
    #: ready-pool VMs, by VM id: never adopted, always ended
    pooled: dict[str, Manifest]
    #: the sandbox VMs whose QEMU still runs
    alive: dict[str, Manifest] = field(init=False)

    def __post_init__(self) -> None:
        self.alive = {sid: m for sid, m in self.sandboxes.items() if manifest_alive(m)}

    @classmethod
    def read(cls, sandboxes: VmManifests, pool: VmManifests) -> Leftovers:
        """Blocking (it reads files and /proc): run it in a thread."""
        return cls(sandboxes.load(), pool.load())

    def gone(self) -> dict[str, str]:
        """Why the sandbox VMs that no longer run cannot be adopted."""
        return {sid: "its QEMU process is gone" for sid in self.sandboxes if sid not in self.alive}

    def pids(self) -> set[int]:
        return {int(m["pid"]) for m in self.alive.values()}


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a zombie's cmdline reads empty)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return bool(f.read())
    except OSError:
        return False


def reap_leftovers(base: Path, keep_pids: set[int], keep: list[Manifest]) -> None:
    """SIGKILL QEMU and blockd processes a crashed node left running on the state dir `base`,
    except those named in `keep_pids` (VMs to adopt, a reusable blockd); delete the work dirs and
    RAM files of the killed VMs.

    The node holds the state dir's lock, so whatever else still names it is a leftover."""
    needle = str(base.resolve()).encode()
    me = os.getpid()
    killed: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me or int(entry) in keep_pids:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read()
        except OSError:
            continue
        if needle in argv:
            log.warning("killing a leftover of a previous node run",
                        extra={"pid": int(entry), "argv": argv[:200].decode(errors="replace")})
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
    deadline = time.monotonic() + 10
    while killed and time.monotonic() < deadline:
        killed = [pid for pid in killed if _running(pid)]
        time.sleep(0.05)
    kept = {Path(m["workdir"]) for m in keep} | {Path(m["mem_path"]) for m in keep}
    for sub in ("vms", "memory"):
        for stale in (base / "runtime" / sub).glob("*"):
            if stale in kept:
                continue
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def blockd_changed(manifest: Manifest, blockd_now: dict[str, Any] | None) -> str | None:
    """Why a live VM must not be adopted: the blockd serving its disks is not the one it was
    started with (blockd restarted under it: its NBD connections were cut, writes in flight
    failed, the guest's filesystem cannot be trusted). None when it is the same."""
    then = manifest.get("blockd")
    has_devices = any(d.get("device_id") for d in manifest.get("disks", []))
    if manifest.get("nbd_reconnect"):
        return None  # its QEMU reconnected to the new blockd; adopt_vm checks the devices
    if not has_devices or then is None or blockd_now is None or then == blockd_now:
        return None
    return (f"blockd restarted under its running VM (pid {then.get('pid')} -> "
            f"{blockd_now.get('pid')}): its disks' connections were cut, so the VM "
            "cannot go on safely and was ended")


@dataclass(frozen=True)
class Adopted:
    vm: VM
    #: the envd access token its guest holds (None: not secure)
    guest_token: str | None


async def take_over(runtime: Runtime, leftovers: Leftovers, manifests: VmManifests,
                    blockd_now: dict[str, Any] | None, failures: dict[str, str]
                    ) -> dict[str, Adopted]:
    """Adopt the live sandbox VMs of the previous run whose disks blockd (still running, or
    started again: it reopens its devices from their records) serves; end the others and
    drop their manifests. Why a VM was not adopted goes into `failures`."""
    adopted: dict[str, Adopted] = {}
    for sid, manifest in leftovers.sandboxes.items():
        alive = sid in leftovers.alive
        refusal = blockd_changed(manifest, blockd_now) if alive else None
        if alive and refusal is None:
            try:
                vm = await adopt_vm(runtime, manifest)
            except (RuntimeError_, OSError) as exc:
                log.warning("running VM of the previous run not adopted",
                            extra={"sandbox_id": sid, "error": str(exc)})
                failures[sid] = f"its VM could not be taken over: {exc}"
            else:
                adopted[sid] = Adopted(vm, manifest.get("guest_token"))
                log.info("VM adopted", extra={"sandbox_id": sid, "pid": vm.pid})
                continue
        if refusal is not None:
            failures[sid] = refusal
            log.error("running VM of the previous run ended: blockd restarted under it",
                      extra={"sandbox_id": sid, "reason": refusal})
        await abandon(runtime, manifest)
        manifests.drop(sid)
    return adopted


async def end_pooled(runtime: Runtime, pooled: dict[str, Manifest], manifests: VmManifests
                     ) -> None:
    """End the ready-pool VMs of the previous run."""
    for vm_id, manifest in pooled.items():
        await abandon(runtime, manifest)
        manifests.drop(vm_id)
    if pooled:
        log.info("ended the ready-pool VMs of the previous run", extra={"count": len(pooled)})
