"""The VM backend: every sandbox is a QEMU VM run by `agentenv.runtime`.

- start(): a block daemon (the one at $AENV_BLOCKD_SOCKET, else a private `aenv blockd` child
  under <state>/vm-backend/blockd/), the guest assets (kernel, initramfs, tools disk), the runtime.
- default_templates(): the built-in `base` template (base_template.py), built on first start.
- create = restore the template's boot snapshot; pause = runtime.pause (memory kept);
  resume = restore the pause snapshot; snapshot = snapshot with the VM kept running;
  fork = one snapshot, then one restore per child.

Snapshots are directories under <state>/vm-backend/runtime/snapshots/; a later snapshot names
the layer files of the ones it grew from (memory and disk lineages), so a snapshot directory
is only deleted once it is released (killed sandbox, deleted snapshot) AND no remaining
snapshot names a file in it (`_collect`).

Not done yet: adopt() returns {}, so a node crash (or kill -9) loses its running VMs (their
QEMU processes are left behind and must be killed by hand); a graceful stop pauses them all
first. A sandbox's cpu_count/memory_mb/disk_size_mb are the template's: a restore cannot change
the machine a snapshot was taken of.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from agentenv.node.backend import (
    ENVD_PORT,
    BackendError,
    DefaultTemplate,
    ForkOutcome,
    MetricSample,
    PauseResult,
    Placement,
    SandboxSpec,
    SnapshotRef,
    TemplateRef,
)

log = logging.getLogger("agentenv.node.vm_backend")

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
RELEASED_MARK = ".released"
SLOT_COOLDOWN = 30.0  # seconds before a network slot's address serves another VM



def _envd_version() -> str | None:
    try:
        from agentenv.guest.envd import ENVD_VERSION
    except ImportError:
        return None
    return str(ENVD_VERSION)


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a zombie's cmdline reads empty)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return bool(f.read())
    except OSError:
        return False


class VmBackend:
    name = "vm"

    def __init__(
        self,
        state_dir: Path,
        *,
        blockd_socket: Path | None = None,
        assets_dir: Path | None = None,
        debian_cache: Path | None = None,
        network_prefix: str | None = None,
        accel: str | None = None,
        first_slot: int | None = None,
    ) -> None:
        env = os.environ
        self.base = state_dir / "vm-backend"
        self.state_dir = state_dir
        sock = blockd_socket or env.get("AENV_BLOCKD_SOCKET")
        self.blockd_socket: Path | None = Path(sock) if sock else None
        self.assets_dir = assets_dir or Path(env.get("AENV_VM_ASSETS_DIR") or state_dir)
        self.debian_cache = debian_cache or Path(
            env.get("AENV_VM_DEBIAN_CACHE") or state_dir / "cache" / "debian")
        self.network_prefix = network_prefix or env.get("AENV_VM_NETWORK_PREFIX") or "aenv"
        self.accel = accel or env.get("AENV_VM_ACCEL") or "auto"
        # Two runtimes on one host need disjoint slot index ranges (see RuntimeConfig).
        self.first_slot = first_slot or int(env.get("AENV_VM_FIRST_SLOT") or 1)
        self._blockd_proc: Any = None  # agentenv.runtime.harness.BlockdProcess
        self._blockd: Any = None  # AsyncBlockdClient
        self.runtime: Any = None  # agentenv.runtime.Runtime, made in start()
        self._assets: Any = None  # GuestAssets
        self._vms: dict[str, Any] = {}  # sandbox id -> runtime VM
        self._cpu_seen: dict[str, tuple[float, int]] = {}
        self._gc_lock = asyncio.Lock()
        self._builtin: dict[str, Path] = {}  # built-in template name -> boot snapshot dir

    # --- paths and snapshot bookkeeping -------------------------------------------------------

    @property
    def snapshot_root(self) -> Path:
        return self.base / "runtime" / "snapshots"

    def _owned_file(self, sandbox_id: str) -> Path:
        return self.base / "sandboxes" / f"{sandbox_id}.json"

    def _owned(self, sandbox_id: str) -> list[str]:
        """Snapshot directories this sandbox made for itself (pauses, fork points)."""
        try:
            return list(json.loads(self._owned_file(sandbox_id).read_text()))
        except (OSError, ValueError):
            return []

    def _own(self, sandbox_id: str, record_dir: Path) -> None:
        owned = self._owned(sandbox_id)
        owned.append(str(record_dir))
        path = self._owned_file(sandbox_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(owned))
        tmp.replace(path)

    def _is_ours(self, path: Path) -> bool:
        try:
            path.resolve().relative_to(self.snapshot_root.resolve())
        except ValueError:
            return False
        return path.resolve() != self.snapshot_root.resolve()

    async def _release(self, record_dirs: list[str]) -> None:
        """Mark snapshot directories as unused, then delete those no other snapshot needs."""
        for raw in record_dirs:
            path = Path(raw)
            if self._is_ours(path) and path.is_dir():
                (path / RELEASED_MARK).touch()
        await self._collect()

    async def _collect(self) -> None:
        # Files of running VMs (they name the snapshot they came from), read on the loop.
        in_use: set[Path] = set()
        for vm in list(self._vms.values()):
            in_use.update(Path(ref.path).parent for ref in vm.memory_layers)
            for disk in vm.disks:
                in_use.update(Path(x.path).parent for x in disk.layers)
        async with self._gc_lock:
            await asyncio.to_thread(self._collect_sync, in_use)

    def _collect_sync(self, in_use: set[Path]) -> None:
        from agentenv.snapshot.record import SnapshotRecord

        if not self.snapshot_root.is_dir():
            return
        needed: set[Path] = set()
        released: list[Path] = []
        for snap in self.snapshot_root.iterdir():
            if not snap.is_dir():
                continue
            if (snap / RELEASED_MARK).exists():
                released.append(snap)
                continue
            try:
                record = SnapshotRecord.load(snap)
            except Exception:  # a half-written snapshot pins nothing
                continue
            files = [x.path for x in record.memory_layers] + [record.device_state]
            for disk in record.disks:
                files.extend(x.path for x in disk.layers)
            needed.update(Path(f).parent for f in files)
        for snap in released:
            if snap not in needed and snap not in in_use:
                shutil.rmtree(snap, ignore_errors=True)
                log.info("snapshot deleted", extra={"snapshot_dir": str(snap)})

    def _ref(self, record: Any, kind: str) -> TemplateRef:
        from agentenv.node.base_template import snapshot_layers

        return TemplateRef(kind=kind, data={"record_dir": str(Path(record.device_state).parent)},
                           layers=snapshot_layers(record))

    def _load_record(self, ref: TemplateRef) -> Any:
        from agentenv.snapshot.record import SnapshotRecord

        builtin = ref.data.get("builtin")
        record_dir = self._builtin.get(builtin) if builtin else ref.data.get("record_dir")
        if not record_dir:
            raise BackendError(f"{ref.kind} has no VM snapshot (made by another backend?)",
                               retryable=False)
        try:
            return SnapshotRecord.load(Path(record_dir))
        except Exception as exc:  # missing, unreadable or invalid record
            raise BackendError(f"snapshot {record_dir} cannot be read: {exc}",
                               retryable=False) from exc

    # --- lifecycle of the backend -------------------------------------------------------------

    async def start(self) -> None:
        from agentenv.blockd.client import AsyncBlockdClient
        from agentenv.guest.build.assets import build_assets
        from agentenv.runtime.config import RuntimeConfig
        from agentenv.runtime.vm import Runtime

        (self.base / "sandboxes").mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._reap_leftovers)
        if self.blockd_socket is None:
            from agentenv.runtime.harness import BlockdProcess

            root = self.base / "blockd"
            root.mkdir(parents=True, exist_ok=True)
            self._blockd_proc = BlockdProcess(root)
            log.info("starting a private blockd", extra={"socket": str(self._blockd_proc.socket)})
            await asyncio.to_thread(self._blockd_proc.start)
            self.blockd_socket = self._blockd_proc.socket
        self._blockd = AsyncBlockdClient(self.blockd_socket)
        log.info("guest assets: building or checking", extra={"dir": str(self.assets_dir)})
        t0 = time.monotonic()
        self._assets = await asyncio.to_thread(build_assets, self.assets_dir)
        log.info("guest assets ready", extra={"seconds": round(time.monotonic() - t0, 1),
                                              "built": list(self._assets.built)})
        config = RuntimeConfig(state_dir=self.base / "runtime", accel=self.accel,  # type: ignore[arg-type]
                               network_prefix=self.network_prefix, boot_timeout=300,
                               blockd_socket=self.blockd_socket,
                               slot_first_index=self.first_slot,
                               # The proxy's pooled keep-alive connections to a dead VM
                               # (httpx: 5 s) must expire before its address serves another.
                               slot_reuse_delay=SLOT_COOLDOWN)
        self.runtime = Runtime(config, blockd=self._blockd, on_vm_died=self._vm_died)
        await self.runtime.start(kernel_for_probe=self._assets.kernel)
        await self._collect()

    def _reap_leftovers(self) -> None:
        """SIGKILL QEMU and blockd processes a crashed node left running on this state dir.

        The node holds the state dir's lock, so whatever still names it is a leftover; its
        sandboxes are lost anyway (adopt() is not implemented), and its network slots would
        be rebuilt under the leftover VMs."""
        needle = str(self.base.resolve()).encode()
        me = os.getpid()
        killed: list[int] = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
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
        for sub in ("vms", "memory"):  # work dirs and RAM files of the killed VMs
            for stale in (self.base / "runtime" / sub).glob("*"):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)

    def _vm_died(self, vm: Any) -> None:
        for sid, known in list(self._vms.items()):
            if known is vm:
                log.error("sandbox VM died", extra={"sandbox_id": sid, "reason": vm.error})
                self._vms.pop(sid, None)

    async def close(self) -> None:
        if self.runtime is not None:
            with contextlib.suppress(Exception):
                await self.runtime.close()
            self.runtime = None
        self._vms.clear()
        if self._blockd is not None:
            with contextlib.suppress(Exception):
                await self._blockd.close()
            self._blockd = None
        if self._blockd_proc is not None:
            await asyncio.to_thread(self._blockd_proc.stop)
            self._blockd_proc = None

    async def default_templates(self) -> list[DefaultTemplate]:
        from agentenv.node.base_template import build_base_template, load_previous

        template_dir = self.state_dir / "templates" / "base"
        previous = load_previous(template_dir)
        try:
            base = await build_base_template(self.runtime, self._assets, template_dir,
                                             debian_cache=self.debian_cache)
        except Exception as exc:
            raise BackendError(f"building the base template failed: {exc}",
                               retryable=False) from exc
        self._builtin["base"] = base.record_dir
        if previous and str(previous.get("record_dir")) != str(base.record_dir):
            # A rebuild (new guest assets, accelerator...): the old boot snapshot goes once
            # no paused sandbox or snapshot made from it needs its files.
            await self._release([str(previous.get("record_dir"))])
        # The node stores this ref once and keeps it across restarts: it names the built-in
        # template, resolved to the current build at every create.
        return [DefaultTemplate(
            name="base",
            ref=TemplateRef(kind="template", data={"builtin": "base"}, layers=base.layers),
            cpu_count=base.vcpus, memory_mb=base.memory_mib,
            disk_size_mb=base.disk_bytes >> 20, envd_version=_envd_version())]

    # --- VMs ----------------------------------------------------------------------------------

    def _placement(self, sandbox_id: str, vm: Any) -> Placement:
        self._vms[sandbox_id] = vm
        host = vm.slot.guest_address
        rootfs = next((d.config.size for d in vm.disks if d.config.name == "rootfs"), 0)
        return Placement(host=host, envd_port=ENVD_PORT,
                         handle={"vm_id": vm.id, "pid": vm.pid, "cpu_count": vm.machine.vcpus,
                                 "memory_mb": vm.machine.memory_mib, "disk_bytes": rootfs,
                                 "timings_ms": {k: round(v, 1) for k, v in vm.timings.items()}},
                         envd_version=_envd_version())

    def _vm(self, sandbox_id: str) -> Any:
        vm = self._vms.get(sandbox_id)
        if vm is None or vm.state != "running":
            raise BackendError(f"sandbox {sandbox_id} has no running VM on this node",
                               retryable=False)
        return vm

    async def _restore(self, spec: SandboxSpec, record: Any, previous_token: str | None = None
                       ) -> Placement:
        from agentenv.runtime.errors import RuntimeError_

        try:
            vm = await self.runtime.restore(record, env_vars=spec.env_vars or None,
                                            access_token=spec.access_token,
                                            outbound=spec.allow_internet_access,
                                            guest_token=previous_token)
        except (RuntimeError_, OSError) as exc:
            raise BackendError(f"starting the VM of {spec.sandbox_id} failed: {exc}") from exc
        return self._placement(spec.sandbox_id, vm)

    async def create(self, spec: SandboxSpec) -> Placement:
        return await self._restore(spec, self._load_record(spec.source))

    async def pause(self, sandbox_id: str, placement: Placement, memory: bool) -> PauseResult:
        from agentenv.runtime.errors import RuntimeError_

        vm = self._vm(sandbox_id)
        try:
            record = await self.runtime.pause(vm)
        except (RuntimeError_, OSError) as exc:
            raise BackendError(f"pausing {sandbox_id} failed: {exc}",
                               retryable=vm.state == "running") from exc
        self._vms.pop(sandbox_id, None)
        self._cpu_seen.pop(sandbox_id, None)
        ref = self._ref(record, "paused")
        self._own(sandbox_id, Path(ref.data["record_dir"]))
        return PauseResult(snapshot=ref, memory=True)

    async def resume(self, spec: SandboxSpec, snapshot: SnapshotRef) -> Placement:
        return await self._restore(spec, self._load_record(snapshot))

    async def snapshot(
        self, sandbox_id: str, placement: Placement, snapshot_id: str
    ) -> SnapshotRef:
        from agentenv.runtime.errors import RuntimeError_

        vm = self._vm(sandbox_id)
        try:
            record = await self.runtime.snapshot(vm, keep_running=True)
        except (RuntimeError_, OSError) as exc:
            raise BackendError(f"snapshot of {sandbox_id} failed: {exc}",
                               retryable=vm.state == "running") from exc
        return self._ref(record, "snapshot")

    async def fork(
        self, spec: SandboxSpec, placement: Placement, children: list[SandboxSpec]
    ) -> list[ForkOutcome]:
        from agentenv.runtime.errors import RuntimeError_

        vm = self._vm(spec.sandbox_id)
        try:
            record = await self.runtime.snapshot(vm, keep_running=True)
        except (RuntimeError_, OSError) as exc:
            raise BackendError(f"fork of {spec.sandbox_id} failed: {exc}",
                               retryable=vm.state == "running") from exc
        # The fork point belongs to the parent: deleted with it once no child needs it.
        self._own(spec.sandbox_id, Path(record.device_state).parent)

        async def one(child: SandboxSpec) -> ForkOutcome:
            try:
                placed = await self._restore(child, record, previous_token=spec.access_token)
            except BackendError as exc:
                return ForkOutcome(child.sandbox_id, error=str(exc))
            return ForkOutcome(child.sandbox_id, placement=placed)

        return list(await asyncio.gather(*(one(c) for c in children)))

    async def kill(self, sandbox_id: str, placement: Placement | None) -> None:
        vm = self._vms.pop(sandbox_id, None)
        self._cpu_seen.pop(sandbox_id, None)
        if vm is not None:
            with contextlib.suppress(Exception):
                await self.runtime.kill(vm)
        await self._release(self._owned(sandbox_id))
        self._owned_file(sandbox_id).unlink(missing_ok=True)

    async def discard_paused(self, sandbox_id: str, snapshot: SnapshotRef) -> None:
        await self.kill(sandbox_id, None)

    async def delete_snapshot(self, ref: SnapshotRef) -> None:
        if ref.data.get("builtin"):
            return  # rebuilt at the next start anyway; its boot snapshot is kept
        record_dir = ref.data.get("record_dir")
        if record_dir:
            await self._release([record_dir])

    async def adopt(self) -> dict[str, Placement]:
        # Not implemented: VMs do not survive their node yet (the runtime's VM objects hold
        # the QMP connections). A graceful stop pauses every sandbox first.
        return {}

    async def metrics(self, sandbox_id: str, placement: Placement) -> MetricSample:
        return await asyncio.to_thread(self._sample, sandbox_id, placement)

    def _sample(self, sandbox_id: str, placement: Placement) -> MetricSample:
        """QEMU's CPU time and resident memory, and the disk stack's allocated bytes."""
        vm = self._vm(sandbox_id)
        now = time.time()
        ticks, rss = 0, 0
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{vm.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            ticks = int(fields[11]) + int(fields[12])
            with open(f"/proc/{vm.pid}/statm") as f:
                rss = int(f.read().split()[1]) * PAGE_SIZE
        cpus = vm.machine.vcpus
        prev = self._cpu_seen.get(sandbox_id)
        self._cpu_seen[sandbox_id] = (now, ticks)
        pct = 0.0
        if prev and now > prev[0]:
            pct = max(0.0, (ticks - prev[1]) / CLK_TCK / (now - prev[0]) / cpus * 100)
        mem_total = vm.machine.memory_mib << 20
        disk_used, disk_total = 0, 0
        for disk in vm.disks:
            if disk.config.name != "rootfs":
                continue
            disk_total = disk.config.size
            paths = [Path(x.path) for x in disk.layers]
            upper = Path(vm.workdir) / "disks" / "rootfs"
            if upper.is_dir():
                paths.extend(p for p in upper.rglob("*") if p.is_file())
            for p in paths:
                with contextlib.suppress(OSError):
                    disk_used += p.stat().st_blocks * 512
        return MetricSample(timestamp=now, cpu_count=cpus, cpu_used_pct=round(min(pct, 100.0), 2),
                            mem_used=min(rss, mem_total), mem_total=mem_total, mem_cache=0,
                            disk_used=min(disk_used, disk_total), disk_total=disk_total)
