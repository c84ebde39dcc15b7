"""VmBackend: the SandboxBackend protocol methods (and the optional capabilities of
node/backend.py) over the VM runtime. Blockd, adoption, the snapshot store, egress and metrics
are in the modules beside this one; the package's doc describes the whole."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agentenv.blockd.client import DeviceInfo
from agentenv.envd_client import EnvdClient, EnvdClientError
from agentenv.guest.build.assets import GuestAssets, build_assets
from agentenv.guest.envd import ENVD_VERSION
from agentenv.network.control import SlotEntry, SlotIdentity
from agentenv.network.policy import EgressPolicy
from agentenv.node.backend import (
    ENVD_PORT,
    BackendError,
    CrashRecovery,
    DefaultTemplate,
    ForkOutcome,
    HealthReport,
    InitialisesEnvd,
    LayerAware,
    MetricSample,
    NetworkPolicies,
    PauseResult,
    Placement,
    ReadyPools,
    SandboxBackend,
    SandboxSpec,
    SnapshotBranching,
    SnapshotRef,
    TemplateBuilding,
    TemplateRef,
    VolumeMounting,
)
from agentenv.node.base_template import (
    BASE,
    CODE_INTERPRETER,
    BuiltinSpec,
    build_base_template,
    load_previous,
)
from agentenv.node.nfs import NfsError, node_nfs_port
from agentenv.node.nfs_exports import SharedExports, SharedVolume
from agentenv.node.ready_pool import ReadyPool, ReadyPoolConfig
from agentenv.node.vm_backend.adoption import (
    Leftovers,
    VmManifests,
    end_pooled,
    reap_leftovers,
    take_over,
)
from agentenv.node.vm_backend.blockd import BlockdLink
from agentenv.node.vm_backend.egress import EgressGlue, egress_of
from agentenv.node.vm_backend.errors import vm_errors
from agentenv.node.vm_backend.metrics import MetricsSampler
from agentenv.node.vm_backend.snapshots import SnapshotStore, record_dir, record_dirs
from agentenv.node.volumes import VOLUME_SLOTS, VolumeLimits
from agentenv.runtime import nfs_net, privilege
from agentenv.runtime.cgroup import Cgroup, Limits
from agentenv.runtime.config import RuntimeConfig, privilege_settings_from_env
from agentenv.runtime.errors import NetworkError, RuntimeError_
from agentenv.runtime.serial import SERIAL_LOG
from agentenv.runtime.vm import VM, BootSpec, DiskSource, Runtime, VolumeDisk
from agentenv.settings import get_settings
from agentenv.snapshot.record import VOLUME_SERIAL_PREFIX, SnapshotRecord, volume_slot_name

log = logging.getLogger("agentenv.node.vm_backend")

# ganesha's cgroup (node/nfs.py "Jail"): idle it holds about 9 MB and 18 threads.
NFS_CGROUP = "aenv-nfs"
NFS_LIMITS = Limits(memory_max=512 << 20, cpu_weight=100, cpu_quota_us=None, pids_max=512)
SLOT_COOLDOWN = 30.0  # seconds before a network slot's address serves another VM
SYNC_TIMEOUT = 30.0  # seconds envd gets to flush the guest before a filesystem-only pause


class VmBackend(SandboxBackend, CrashRecovery, LayerAware, TemplateBuilding, NetworkPolicies,
                HealthReport, ReadyPools, InitialisesEnvd, SnapshotBranching, VolumeMounting):
    name = "vm"
    #: create/resume/fork return after envd's /init with the spec's env vars and token
    #: (Runtime.restore does it), so the orchestrator skips its own readiness round trip.
    initialises_envd = True

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
        pool_config: ReadyPoolConfig | None = None,
        on_sandbox_lost: Callable[[str, str], None] | None = None,
    ) -> None:
        """`on_sandbox_lost(sandbox_id, reason)` is called when a sandbox's VM dies on its own
        (QEMU killed, crashed): the orchestrator then removes the sandbox."""
        settings = get_settings()
        self.base = state_dir / "vm-backend"
        self.state_dir = state_dir
        sock = blockd_socket or settings.blockd_socket
        self.blockd = BlockdLink(self.base, Path(sock) if sock else None)
        self.assets_dir = assets_dir or settings.vm_assets_dir or state_dir
        self.debian_cache = (debian_cache or settings.vm_debian_cache
                             or state_dir / "cache" / "debian")
        self.template_cache = settings.vm_template_cache
        self.network_prefix = network_prefix or settings.vm_network_prefix
        self.accel = accel or settings.vm_accel
        # Two runtimes on one host need disjoint slot index ranges (see RuntimeConfig).
        self.first_slot = first_slot or settings.vm_first_slot
        self.on_sandbox_lost = on_sandbox_lost
        self.snapshots = SnapshotStore(self.base)
        self.manifests = VmManifests(self.base / "sandboxes")
        self.egress = EgressGlue(self.base, state_dir)
        self.sampler = MetricsSampler()
        self.pool_config = pool_config or ReadyPoolConfig.from_env()
        # code-interpreter-v1 is built at the first start (a few minutes once, then cached);
        # AENV_VM_CODE_INTERPRETER=0 leaves it out (nodes that never serve it, most tests).
        self.builtin_specs: tuple[BuiltinSpec, ...] = (
            (BASE,) if not settings.vm_code_interpreter
            else (BASE, CODE_INTERPRETER))
        self.pool: ReadyPool | None = None  # made in start() once the runtime exists
        #: why a VM of the previous run was not adopted, by sandbox id
        self.adopt_failures: dict[str, str] = {}
        self._runtime: Runtime | None = None  # made in start()
        self._assets: GuestAssets | None = None  # built or checked in start()
        self._vms: dict[str, VM] = {}  # sandbox id -> its running VM
        self._adopted: dict[str, Placement] = {}
        self._creating = 0  # creates under way (the pools' fills yield to them)
        # Snapshot directories creates are restoring from: in use although no VM runs from
        # them yet (a template deleted or untagged meanwhile must not lose them).
        self._create_sources: list[set[Path]] = []
        #: envd access token each running VM's guest holds (None: not secure). A snapshot
        #: taken of it carries the token, so a create from it can replace the token.
        self._tokens: dict[str, str | None] = {}
        #: the shared volumes' NFS server and exports (docs/volumes.md §7.1), made in start()
        self.nfs: SharedExports | None = None
        self._nfs_cgroup: Cgroup | None = None

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            raise BackendError("the VM backend is not started", retryable=False)
        return self._runtime

    @property
    def assets(self) -> GuestAssets:
        if self._assets is None:
            raise BackendError("the VM backend is not started", retryable=False)
        return self._assets

    def _let_qemu_reach(self, config: RuntimeConfig) -> None:
        """QEMU runs as an unprivileged user (runtime/privilege.py) and opens by path: the
        runtime's state, the private blockd's NBD sockets and the guest assets. Each directory
        from the node's state directory down to them gets group search permission (only
        search: nothing becomes listable or readable); with the jail, none does."""
        if not config.qemu_user:
            return
        user = privilege.VMUser.lookup(config.qemu_user)
        # NBD sockets: the private blockd's, or the one `make up` starts (scripts/up.sh).
        targets = [config.state_dir, self.blockd.private_root / "state" / "nbd",
                   self.state_dir / "blockd" / "state" / "nbd"]
        if self._assets is not None:
            targets += [self._assets.kernel.parent, self._assets.initramfs.parent,
                        self._assets.tools_image.parent]
        for target in targets:
            if config.qemu_jail:
                # A jailed QEMU gets its files bound into its jail (runtime/jail.py): no VM
                # uid needs, or keeps from an earlier run, a way into the node's state.
                privilege.unreach(user, target, self.state_dir)
            else:
                privilege.reach(user, target, self.state_dir)

    # --- lifecycle of the backend -------------------------------------------------------------

    async def start(self) -> None:
        self.manifests.directory.mkdir(parents=True, exist_ok=True)
        pool_manifests = VmManifests(self.base / "pool")
        leftovers = await asyncio.to_thread(Leftovers.read, self.manifests, pool_manifests)
        # A VM whose QEMU survived is adopted when blockd (still running, or started again:
        # it reopens its devices from their records) serves its disks (adopt_vm checks).
        self.adopt_failures.update(leftovers.gone())
        keep_pids = leftovers.pids()
        if (blockd_pid := await asyncio.to_thread(self.blockd.find_previous)) is not None:
            keep_pids.add(blockd_pid)
        if (memfs_pid := await asyncio.to_thread(self.blockd.find_memfs)) is not None:
            keep_pids.add(memfs_pid)
        # The egress proxy too: the supervisor adopts it (the guests' flows through it go on).
        keep_pids.update(await asyncio.to_thread(self.egress.leftover_pids))
        await asyncio.to_thread(reap_leftovers, self.base, keep_pids,
                                list(leftovers.alive.values()))
        await self.blockd.start(on_new_blockd=self._blockd_replaced)
        log.info("guest assets: building or checking", extra={"dir": str(self.assets_dir)})
        t0 = time.monotonic()
        self._assets = assets = await asyncio.to_thread(build_assets, self.assets_dir)
        log.info("guest assets ready", extra={"seconds": round(time.monotonic() - t0, 1),
                                              "built": list(assets.built)})
        proxy_port = await self.egress.start()
        # Below 1024 and the same at every start (node/nfs.py "Port"): no local user takes it
        # while ganesha restarts. None when the rw-shared mode is off: no NFS server, and no
        # port walled or claimed on the host.
        try:
            nfs_port = await asyncio.to_thread(
                node_nfs_port, self.state_dir / "nfs",
                shared_rw=VolumeLimits.from_env().shared_rw, configured=get_settings().nfs_port)
        except NfsError as exc:
            raise BackendError(str(exc), retryable=False) from exc
        # A server an earlier run left is ended whether or not the mode is on now.
        leftover = SharedExports(self.state_dir / "nfs", nfs_port or 0)
        await asyncio.to_thread(leftover.reap_leftover)
        if nfs_port is None:
            with contextlib.suppress(NfsError):  # its tmpfs mounts
                await asyncio.to_thread(leftover.server.stop)
        config = RuntimeConfig(state_dir=self.base / "runtime", accel=self.accel,  # type: ignore[arg-type]
                               network_prefix=self.network_prefix, boot_timeout=300,
                               egress_proxy_port=proxy_port,
                               nfs_port=nfs_port,
                               network_open_ranges=self.egress.open_ranges,
                               blockd_socket=self.blockd.socket,
                               slot_first_index=self.first_slot,
                               # The proxy's pooled keep-alive connections to a dead VM
                               # (httpx: 5 s) must expire before its address serves another.
                               slot_reuse_delay=SLOT_COOLDOWN,
                               # VMs outlive a node crash; the next start adopts them.
                               qemu_die_with_parent=False,
                               # every machine can mount volumes (docs/volumes.md §6)
                               volume_slots=VOLUME_SLOTS,
                               # The root disk on virtio-scsi: a guest at its disk cap gets
                               # ENOSPC, not EIO (docs/running.md §4). AENV_DISK_BUS overrides.
                               **{"disk_bus": "virtio-scsi",
                                  **privilege_settings_from_env()})
        self._let_qemu_reach(config)
        self._runtime = runtime = Runtime(config, blockd=self.blockd.client,
                                          on_vm_died=self._vm_died)
        # Before adopting or abandoning anything: a second node (or bench) with this network
        # prefix is refused here instead of taking over the first one's slots.
        runtime.slots.acquire_prefix()
        # ganesha's network namespace (runtime/nfs_net.py), under the prefix now held: the
        # one an earlier run left is remade (on its link when still free); the slots' NFS
        # redirect (set up by runtime.start) is a DNAT to its address.
        try:
            if nfs_port is None:
                await asyncio.to_thread(nfs_net.remove_leftover, self.network_prefix)
            else:
                net = await asyncio.to_thread(nfs_net.claim, self.network_prefix, nfs_port)
                config.nfs_address = net.server_address
                self.nfs = SharedExports(self.state_dir / "nfs", nfs_port, network=net)
        except NetworkError as exc:
            raise BackendError(f"the NFS server's network namespace: {exc}",
                               retryable=False) from exc
        # Before the runtime builds network slots: adopted VMs keep theirs.
        adopted = await take_over(runtime, leftovers, self.manifests, self.blockd.identity,
                                  self.adopt_failures)
        for sid, found in adopted.items():
            self._tokens[sid] = found.guest_token
            self._adopted[sid] = self._placement(sid, found.vm)
        await end_pooled(runtime, leftovers.pooled, pool_manifests)
        await runtime.start(kernel_for_probe=assets.kernel)
        # ganesha's own cgroup, beside the VMs' (when the node has cgroups): a bounded
        # memory and task count whatever its guests make it do (node/nfs.py "Jail").
        if self.nfs is not None:
            self._nfs_cgroup = runtime.cgroups.create(NFS_CGROUP, NFS_LIMITS)
            if self._nfs_cgroup is not None:
                self.nfs.server.cgroup_procs = tuple(self._nfs_cgroup.procs_files)
            try:  # the adopted sandboxes' shared volumes, before their guests retry for long
                await self.nfs.resume_clients(set(self._adopted))
            except NfsError as exc:
                log.error("the NFS server for adopted sandboxes did not start",
                          extra={"error": str(exc)})
            self.nfs.supervise()
        self.pool = ReadyPool(runtime, self.pool_config, pool_manifests.directory,
                              busy=lambda: self._creating > 0)
        self.pool.start()
        await self._collect()

    async def close(self) -> None:
        if self.nfs is not None:
            with contextlib.suppress(Exception):
                await self.nfs.close()
        if self._nfs_cgroup is not None and self._runtime is not None:
            with contextlib.suppress(Exception):
                self._runtime.cgroups.remove(self._nfs_cgroup)
            self._nfs_cgroup = None
        await self.egress.close()
        if self.pool is not None:
            with contextlib.suppress(Exception):
                await self.pool.close()
            self.pool = None
        if self._runtime is not None:
            with contextlib.suppress(Exception):
                await self._runtime.close()
            self._runtime = None
        for sid in list(self._vms):
            self.manifests.drop(sid)
        self._vms.clear()
        await self.blockd.close()

    async def default_templates(self) -> list[DefaultTemplate]:
        return [await self._builtin_template(spec) for spec in self.builtin_specs]

    async def _builtin_template(self, spec: BuiltinSpec) -> DefaultTemplate:
        template_dir = self.state_dir / "templates" / spec.name
        previous = load_previous(template_dir)
        try:
            built = await build_base_template(self.runtime, self.assets, template_dir,
                                              debian_cache=self.debian_cache, spec=spec,
                                              shared_cache=self.template_cache)
        except Exception as exc:
            raise BackendError(f"building the {spec.name} template failed: {exc}",
                               retryable=False) from exc
        self.snapshots.builtin[spec.name] = built.record_dir
        if self.pool is not None:
            with contextlib.suppress(Exception):
                record = self.snapshots.load(TemplateRef(kind="template",
                                                         data={"builtin": spec.name}))
                self.pool.want(self._pool_key(record), record, pinned=True,
                               warm_port=spec.ready_port)
        if previous and str(previous.get("record_dir")) != str(built.record_dir):
            # A rebuild (new guest assets, accelerator...): the old boot snapshot goes once
            # no paused sandbox or snapshot made from it needs its files.
            await self._release([str(previous.get("record_dir"))])
        # The node stores this ref once and keeps it across restarts: it names the built-in
        # template, resolved to the current build at every create.
        return DefaultTemplate(
            name=spec.name,
            ref=TemplateRef(kind="template", data={"builtin": spec.name}, layers=built.layers),
            cpu_count=built.vcpus, memory_mb=built.memory_mib,
            disk_size_mb=built.disk_bytes >> 20, envd_version=ENVD_VERSION)

    # --- VMs ----------------------------------------------------------------------------------

    def _placement(self, sandbox_id: str, vm: VM, token: str | None = None) -> Placement:
        self._vms[sandbox_id] = vm
        if token is not None:
            self._tokens[sandbox_id] = token
        self._save_vm(sandbox_id, vm)
        assert vm.slot is not None  # sandbox VMs always have a network slot
        rootfs = next((d.config.size for d in vm.disks if d.config.name == "rootfs"), 0)
        return Placement(host=vm.slot.guest_address, envd_port=ENVD_PORT,
                         handle={"vm_id": vm.id, "pid": vm.pid, "cpu_count": vm.machine.vcpus,
                                 "memory_mb": vm.machine.memory_mib, "disk_bytes": rootfs,
                                 "timings_ms": {k: round(v, 1) for k, v in vm.timings.items()}},
                         envd_version=ENVD_VERSION)

    def _save_vm(self, sandbox_id: str, vm: VM) -> None:
        self.manifests.save(sandbox_id, vm, blockd=self.blockd.identity,
                            guest_token=self._tokens.get(sandbox_id))

    def _forget_vm(self, sandbox_id: str) -> VM | None:
        """The sandbox has no running VM any more (paused, killed, died, captured): drop what
        the backend kept for it while it ran (not its snapshots, not its egress entry)."""
        vm = self._vms.pop(sandbox_id, None)
        self.sampler.forget(sandbox_id)
        self._tokens.pop(sandbox_id, None)
        self.manifests.drop(sandbox_id)
        return vm

    def _vm(self, sandbox_id: str) -> VM:
        vm = self._vms.get(sandbox_id)
        if vm is None or vm.state != "running":
            raise BackendError(f"sandbox {sandbox_id} has no running VM on this node",
                               retryable=False)
        return vm

    def _vm_died(self, vm: VM) -> None:
        if self.pool is not None:
            self.pool.vm_died(vm)
        for sid, known in list(self._vms.items()):
            if known is vm:
                log.error("sandbox VM died", extra={"sandbox_id": sid, "reason": vm.error})
                self._forget_vm(sid)
                if self.on_sandbox_lost is not None:
                    self.on_sandbox_lost(sid, f"its VM died: {vm.error}")

    @staticmethod
    def _guest_env(spec: SandboxSpec) -> dict[str, str]:
        """The env vars envd gives every command: the sandbox's, and E2B's identity variables
        (what E2B sets in its sandboxes; a fork child or a pooled VM gets its own id here)."""
        identity = {"E2B_SANDBOX": "true", "E2B_SANDBOX_ID": spec.sandbox_id}
        if spec.template_id:
            identity["E2B_TEMPLATE_ID"] = spec.template_id
        return {**spec.env_vars, **identity}

    @staticmethod
    def _pool_key(record: SnapshotRecord) -> str:
        return str(record_dir(record))

    @staticmethod
    def _token(spec: SandboxSpec, guest_token: str | None) -> str | None:
        """The token envd gets at /init: the sandbox's; for a sandbox that is not secure, its
        own token too when envd holds another's (re-keyed: SandboxSpec.own_token)."""
        return spec.access_token or (spec.own_token if guest_token else None)

    @staticmethod
    def _mounts(spec: SandboxSpec) -> list[dict[str, Any]]:
        """What envd's /init mounts (guest/envd/mounts.py): every volume of the sandbox."""
        return [{"kind": "nfs", "export": f"/volumes/{m.volume_id}", "path": m.path,
                 "readOnly": False} if m.shared else
                {"serial": VOLUME_SERIAL_PREFIX + volume_slot_name(m.slot), "path": m.path,
                 "readOnly": m.read_only} for m in spec.volume_mounts]

    @staticmethod
    def _shared(spec: SandboxSpec) -> tuple[SharedVolume, ...]:
        return tuple(SharedVolume(m.volume_id, Path(m.shared_dir), *m.owner)
                     for m in spec.volume_mounts if m.shared)

    async def _open_nfs(self, spec: SandboxSpec, vm: VM) -> None:
        """Before the guest of a sandbox with shared volumes runs (or its /init mounts them):
        its slot's hole to the NFS server, and its address in their exports."""
        shared = self._shared(spec)
        if not shared:
            return
        if self.nfs is None or vm.slot is None:
            raise BackendError(f"{spec.sandbox_id}: shared volumes need the node's NFS server "
                               "and a network slot", retryable=False)
        try:
            await self.runtime.set_nfs(vm, True)
            await self.nfs.attach(spec.sandbox_id, vm.slot.guest_address, shared)
        except (NfsError, NetworkError, RuntimeError_) as exc:
            raise BackendError(f"{spec.sandbox_id}: serving its shared volumes over NFS "
                               f"failed: {exc}", retryable=False) from exc

    async def _close_nfs(self, sandbox_id: str) -> None:
        """The sandbox's VM is gone (paused, killed): out of every export."""
        if self.nfs is not None:
            with contextlib.suppress(NfsError):
                await self.nfs.detach(sandbox_id)

    @staticmethod
    def _new_volumes(spec: SandboxSpec, record: SnapshotRecord) -> dict[str, VolumeDisk]:
        """The volumes a create puts in empty slots of its snapshot (those the snapshot holds
        already were mounted by the sandbox it was taken of)."""
        empty = {d.name for d in record.disks if not d.layers}
        return {volume_slot_name(m.slot): VolumeDisk([Path(m.layer)], m.read_only)
                for m in spec.volume_mounts
                if not m.shared and volume_slot_name(m.slot) in empty}

    def free_volume_slots(self, source: TemplateRef) -> list[int]:
        try:
            record = self.snapshots.load(source)
        except BackendError:
            return []
        empty = {d.name for d in record.disks if not d.layers}
        slots = [d.name for d in record.machine.disks if d.volume_slot]
        return [i for i in range(len(slots)) if volume_slot_name(i) in empty]

    async def _restore(self, spec: SandboxSpec, record: SnapshotRecord,
                       previous_token: str | None = None, *, own: bool = False,
                       volumes: dict[str, VolumeDisk] | None = None) -> Placement:
        """own: `record` is this sandbox's pause (its disks' caps keep what they used);
        `volumes`: volumes a create puts in empty slots."""
        token = self._token(spec, previous_token)

        async def open_nfs(vm: VM) -> None:
            await self._open_nfs(spec, vm)

        before_start = open_nfs if self._shared(spec) else None
        try:
            with vm_errors(f"starting the VM of {spec.sandbox_id} failed"):
                vm = await self.runtime.restore(record, env_vars=self._guest_env(spec),
                                                access_token=token,
                                                egress=egress_of(spec),
                                                guest_token=previous_token, own_disks=own,
                                                volumes=volumes, mounts=self._mounts(spec),
                                                before_start=before_start)
        except BaseException:
            # the VM is gone and its slot goes back to the pool: so does its export entry
            if before_start is not None:
                await self._close_nfs(spec.sandbox_id)
            raise
        await self.egress.announce(spec.sandbox_id, vm, spec)
        return self._placement(spec.sandbox_id, vm, token)

    async def create(self, spec: SandboxSpec) -> Placement:
        await self.blockd.wait()
        record = self.snapshots.load(spec.source)
        machine = record.machine
        if (spec.cpu_count, spec.memory_mb) != (machine.vcpus, machine.memory_mib):
            # The record's sizes are what the API shows; the snapshot decides what runs.
            raise BackendError(
                f"the template's record says {spec.cpu_count} vCPUs and {spec.memory_mb} MiB, "
                f"its snapshot was taken of a {machine.vcpus} vCPU, {machine.memory_mib} MiB "
                "machine (a restore cannot resize it)", retryable=False)
        self._creating += 1
        sources = record_dirs(record)
        self._create_sources.append(sources)
        try:
            return await self._create(spec, record)
        finally:
            self._creating -= 1
            self._create_sources.remove(sources)

    async def _create(self, spec: SandboxSpec, record: SnapshotRecord) -> Placement:
        # A snapshot of a secure sandbox wakes up with that sandbox's envd token.
        guest_token = spec.source.data.get("guest_token")
        volumes = self._new_volumes(spec, record)
        # A pooled VM's volume disks are empty, and its guest runs before the node could let
        # it reach a shared volume: restored with them.
        if volumes or self._shared(spec):
            return await self._restore(spec, record, previous_token=guest_token,
                                       volumes=volumes)
        if self.pool is not None and self.pool_config.enabled:
            key = self._pool_key(record)
            vm: VM | None = self.pool.take(key)
            # A create makes its template hot (the pinned base is always); the fill starts
            # after the take so it never races this create for the VM it just took.
            self.pool.want(key, record, guest_token=guest_token)
            if vm is not None:
                placed = await self._hand_over(spec, vm, guest_token)
                if placed is not None:
                    return placed
        return await self._restore(spec, record, previous_token=guest_token)

    async def _hand_over(self, spec: SandboxSpec, vm: VM, guest_token: str | None
                         ) -> Placement | None:
        """Make a pooled VM the sandbox `spec`: network policy, then envd's /init with its env
        vars, token and the time. None (the VM is ended) when the VM fails on the way."""
        assert self.pool is not None
        t0 = time.perf_counter()
        lost = await self.blockd.disks_missing(vm)
        if lost:
            log.warning("pooled VM's disks are not served by blockd: restoring instead",
                        extra={"sandbox_id": spec.sandbox_id, "vm": vm.id, "missing": lost})
            with contextlib.suppress(Exception):
                await self.runtime.kill(vm)
            self.pool.handed_over(vm)
            return None
        try:
            # Before envd's /init (so before the create returns): no moment where the
            # sandbox has the pool's allow-all policy.
            egress = egress_of(spec)
            if vm.slot is not None and egress != vm.slot.policy:
                await self.runtime.set_policy(vm, egress)
            await self.egress.announce(spec.sandbox_id, vm, spec)
            t1 = time.perf_counter()
            token = self._token(spec, guest_token)
            await self.runtime.envd_init(vm, self._guest_env(spec), token,
                                         guest_token=guest_token, mounts=self._mounts(spec))
        except (RuntimeError_, OSError) as exc:  # not an error of the create: it restores
            log.warning("pooled VM failed at create: restoring instead",
                        extra={"sandbox_id": spec.sandbox_id, "vm": vm.id, "error": str(exc)})
            await self.egress.forget(spec.sandbox_id)
            with contextlib.suppress(Exception):
                await self.runtime.kill(vm)
            self.pool.handed_over(vm)  # its pool manifest
            return None
        t2 = time.perf_counter()
        vm.timings = {"pooled": 1.0, "outbound_ms": (t1 - t0) * 1e3,
                      "envd_init_ms": (t2 - t1) * 1e3, "parked_s": time.time() - vm.started_at}
        # Writes the sandbox's manifest before the pool's goes.
        placed = self._placement(spec.sandbox_id, vm, token)
        self.pool.handed_over(vm)
        log.info("sandbox VM from the ready pool", extra={
            "sandbox_id": spec.sandbox_id, "vm": vm.id,
            "timings_ms": {k: round(v, 1) for k, v in vm.timings.items()}})
        return placed

    async def pause(self, sandbox_id: str, placement: Placement, memory: bool) -> PauseResult:
        """memory=False: a filesystem-only pause. envd saves its defaults and flushes the
        guest's filesystems, then only the disks are kept (no memory layer, no device state);
        resume cold-boots the VM from them."""
        vm = self._vm(sandbox_id)
        if not memory:
            await self._sync_guest(sandbox_id, vm)
        with vm_errors(f"pausing {sandbox_id} failed", retryable=lambda: vm.state == "running"):
            record = await self.runtime.pause(vm, memory=memory)
        token = self._tokens.get(sandbox_id)
        self._forget_vm(sandbox_id)
        await self.egress.forget(sandbox_id)
        await self._close_nfs(sandbox_id)
        ref = self.snapshots.ref(record, "paused")
        if token and record.memory:  # what the resume's /init must show (a re-keyed guest's)
            ref.data["guest_token"] = token
        self.snapshots.own(sandbox_id, Path(ref.data["record_dir"]))
        return PauseResult(snapshot=ref, memory=record.memory)

    async def _sync_guest(self, sandbox_id: str, vm: VM) -> None:
        """envd's /aenv/sync before a filesystem-only pause. As in E2B, such a pause needs a
        guest agent that answers (without its flush the disk would miss recent writes): the
        pause is refused otherwise and the sandbox keeps running."""
        envd = EnvdClient(vm.envd_url, access_token=self._tokens.get(sandbox_id))
        try:
            await envd.sync(SYNC_TIMEOUT)
        except EnvdClientError as exc:
            raise BackendError(f"a filesystem-only pause of {sandbox_id} needs its guest agent "
                               f"(envd) to flush the disk: {exc}") from exc
        finally:
            await envd.close()

    async def resume(self, spec: SandboxSpec, snapshot: SnapshotRef,
                     memory: bool = True) -> Placement:
        """memory=False or a filesystem-only snapshot: a cold boot from the snapshot's disk (a
        memory snapshot's disk is then as after a power cut: its journal recovers it)."""
        await self.blockd.wait()
        record = self.snapshots.load(snapshot)
        if not record.memory or not memory:
            return await self._cold_boot(spec, record)
        return await self._restore(spec, record, previous_token=snapshot.data.get("guest_token"),
                                   own=True)

    async def _cold_boot(self, spec: SandboxSpec, record: SnapshotRecord) -> Placement:
        """A VM booted from a filesystem-only snapshot's disks with the current guest assets
        (kernel, initramfs, tools disk: a reboot may pick up newer ones), then envd's /init
        with the sandbox's identity (env vars, token)."""
        assets = self.assets
        snaps = {d.name: d for d in record.disks}
        disks = []
        for cfg in record.machine.disks:
            snap = snaps[cfg.name]
            if cfg.name == "tools" and snap.file:
                disks.append(DiskSource("tools", assets.tools_image.stat().st_size,
                                        read_only=True, file=assets.tools_image))
            else:
                disks.append(DiskSource(cfg.name, cfg.size, read_only=cfg.read_only,
                                        layers=[Path(x.path) for x in snap.layers],
                                        file=Path(snap.file) if snap.file else None,
                                        chain_used=snap.chain_used,
                                        bus=cfg.bus if cfg.volume_slot else None,
                                        volume_slot=cfg.volume_slot))
        boot = BootSpec(kernel=assets.kernel, initramfs=assets.initramfs,
                        cmdline=assets.cmdline_base, vcpus=record.machine.vcpus,
                        memory_mib=record.machine.memory_mib,
                        egress=egress_of(spec), disks=disks)
        sources = record_dirs(record)
        self._create_sources.append(sources)  # in use until the VM runs from them
        try:
            with vm_errors(f"cold-booting {spec.sandbox_id} from its disk failed"):
                vm = await self.runtime.boot(boot)
                try:
                    await self._open_nfs(spec, vm)
                    await self.runtime.envd_init(vm, self._guest_env(spec), spec.access_token,
                                                 mounts=self._mounts(spec))
                except BaseException:
                    await self.runtime.kill(vm)
                    if self._shared(spec):
                        await self._close_nfs(spec.sandbox_id)
                    raise
        finally:
            self._create_sources.remove(sources)
        await self.egress.announce(spec.sandbox_id, vm, spec)
        return self._placement(spec.sandbox_id, vm, spec.access_token)

    async def snapshot(
        self, sandbox_id: str, placement: Placement, snapshot_id: str
    ) -> SnapshotRef:
        vm = self._vm(sandbox_id)
        with vm_errors(f"snapshot of {sandbox_id} failed",
                       retryable=lambda: vm.state == "running"):
            record = await self.runtime.snapshot(vm, keep_running=True)
        self._save_vm(sandbox_id, vm)  # its disks have a new sealed layer under the upper
        ref = self.snapshots.ref(record, "snapshot")
        token = self._tokens.get(sandbox_id)
        if token:  # the snapshot's envd holds it: a create from it needs it to set its own
            ref.data["guest_token"] = token
        return ref

    async def fork(
        self, spec: SandboxSpec, placement: Placement, children: list[SandboxSpec]
    ) -> list[ForkOutcome]:
        await self.blockd.wait()
        if self._shared(spec):  # the orchestrator refuses it first (docs/volumes.md §7.1)
            raise BackendError(f"{spec.sandbox_id} mounts a shared volume: it cannot be forked",
                               retryable=False)
        vm = self._vm(spec.sandbox_id)
        with vm_errors(f"fork of {spec.sandbox_id} failed",
                       retryable=lambda: vm.state == "running"):
            record = await self.runtime.snapshot(vm, keep_running=True)
        self._save_vm(spec.sandbox_id, vm)
        # The fork point belongs to the parent: deleted with it once no child needs it.
        self.snapshots.own(spec.sandbox_id, record_dir(record))
        return await _each_child(children, lambda child: self._restore(
            child, record, previous_token=spec.access_token))

    async def fork_snapshot(self, snapshot: SnapshotRef,
                            children: list[SandboxSpec]) -> list[ForkOutcome]:
        """Each child is a resume of `snapshot` as itself: a restore (memory kept) or a cold
        boot (filesystem-only), on new disk uppers and a private copy of memory, each in its
        own QEMU (a new vmgenid: the guest reseeds its RNG). The snapshot is only read."""
        return await _each_child(children, lambda child: self.resume(child, snapshot))

    async def rollback(self, spec: SandboxSpec, placement: Placement | None,
                       snapshot: SnapshotRef) -> Placement:
        """A resume of `snapshot` as `spec`; then the sandbox's old VM (if it ran) ends. The
        new VM gets a fresh network slot: the old slot's address cools down first
        (SLOT_COOLDOWN), as every freed one does, so no connection the proxy pools to the old
        guest can reach the new one. The slot's policy is the sandbox's (spec.egress)."""
        old = self._vms.get(spec.sandbox_id)
        placed = await self.resume(spec, snapshot)  # _placement: the sandbox's VM is the new one
        if old is not None:
            with contextlib.suppress(Exception):
                await self.runtime.kill(old)
        return placed

    async def kill(self, sandbox_id: str, placement: Placement | None) -> None:
        self.blockd.lost.pop(sandbox_id, None)
        # Forgotten before it is killed: its death is not a lost sandbox (_vm_died).
        vm = self._forget_vm(sandbox_id)
        if vm is not None:
            with contextlib.suppress(Exception):
                await self.runtime.kill(vm)
        await self.egress.forget(sandbox_id)
        await self._close_nfs(sandbox_id)
        self._adopted.pop(sandbox_id, None)
        await self._release(self.snapshots.owned(sandbox_id))
        self.snapshots.disown(sandbox_id)

    async def discard_paused(self, sandbox_id: str, snapshot: SnapshotRef) -> None:
        await self.kill(sandbox_id, None)

    async def release_snapshots(self, sandbox_id: str, keep: list[SnapshotRef]) -> None:
        kept = {str(Path(ref.data["record_dir"])) for ref in keep if ref.data.get("record_dir")}
        unnamed = [d for d in self.snapshots.owned(sandbox_id) if str(Path(d)) not in kept]
        if not unnamed:
            return
        # The VM that wrote the pause ends in the background; until it has, its layers count
        # as in use and nothing of the snapshot it ran from could go.
        await self.runtime.drain()
        for directory in unnamed:
            self.snapshots.disown(sandbox_id, directory)
        await self._release(unnamed)

    async def delete_snapshot(self, ref: SnapshotRef) -> None:
        if ref.data.get("builtin"):
            return  # rebuilt at the next start anyway; its boot snapshot is kept
        directory = ref.data.get("record_dir")
        if directory:
            await self._release([directory])

    async def adopt(self) -> dict[str, Placement]:
        """The VMs start() took over from the previous run (see the package doc)."""
        adopted, self._adopted = self._adopted, {}
        return adopted

    def log_files(self, sandbox_id: str) -> list[tuple[str, Path]]:
        """The guest's serial console (kernel, init and envd write there; runtime/serial.py
        keeps it bounded)."""
        vm = self._vms.get(sandbox_id)
        return [] if vm is None else [("console", Path(vm.workdir) / SERIAL_LOG)]

    async def metrics(self, sandbox_id: str, placement: Placement) -> MetricSample:
        vm = self._vm(sandbox_id)
        return await asyncio.to_thread(self.sampler.sample, sandbox_id, vm)

    # --- snapshots no longer used ------------------------------------------------------------

    async def _release(self, directories: list[str]) -> None:
        """Mark snapshot directories as unused, then delete those no other snapshot needs."""
        await self._drop_pools(directories)
        if self.snapshots.mark_released(directories):
            # Nothing newly unused: nothing to collect (a scan reads every record).
            await self._collect()

    async def _collect(self) -> None:
        # Layer files of running VMs (from the snapshots they came from), read on the loop;
        # whole directories creates are restoring from.
        files: set[Path] = set()
        vms = list(self._runtime.vms.values()) if self._runtime is not None else []
        for vm in vms + list(self._vms.values()):
            files.update(Path(ref.path) for ref in vm.memory_layers)
            for disk in vm.disks:
                files.update(Path(x.path) for x in disk.layers)
        directories: set[Path] = set()
        for sources in self._create_sources:
            directories.update(sources)
        await self.snapshots.collect(files, directories)

    async def _drop_pools(self, directories: list[str]) -> None:
        """Snapshots no longer used as templates take their ready VMs with them."""
        if self.pool is None:
            return
        for raw in directories:
            for key in self.pool.pooled_keys():
                if Path(key).resolve() == Path(raw).resolve():
                    await self.pool.drop(key)

    # --- crash recovery (CrashRecovery) and health ---------------------------------------------

    async def recover_pause(self, sandbox_id: str, placement: Placement,
                            since: float) -> PauseResult | None:
        """The pause snapshot of `sandbox_id` a crashed node wrote but did not record: the
        newest complete snapshot of its VM taken after `since` (no other operation ran on the
        sandbox while it was pausing). None when there is no complete one."""
        vm_id = placement.handle.get("vm_id")
        if not vm_id:
            return None
        record = await asyncio.to_thread(self.snapshots.find_pause_record, str(vm_id), since)
        if record is None:
            return None
        ref = self.snapshots.ref(record, "paused")
        if ref.data["record_dir"] not in self.snapshots.owned(sandbox_id):
            self.snapshots.own(sandbox_id, Path(ref.data["record_dir"]))
        return PauseResult(snapshot=ref, memory=record.memory)

    def health_problem(self) -> str | None:
        """Why the node cannot serve sandboxes fully right now (for /health); None: fine."""
        return self.blockd.problem()

    async def _blockd_replaced(self, identity: dict[str, Any]) -> None:
        """A new blockd process answers: running VMs whose disks came back name it in their
        manifests; pooled VMs whose disks did not are ended (they are not sandboxes yet)."""
        pooled = list(self.pool.vms()) if self.pool is not None else []
        check = await self.blockd.check_restart(identity, self._vms, pooled)
        for sid in check.kept:
            if (vm := self._vms.get(sid)) is not None:
                self._save_vm(sid, vm)
        for vm in check.pooled_lost:
            with contextlib.suppress(Exception):
                await self.runtime.kill(vm)

    # --- layer awareness (LayerAware: node/gc.py) ---------------------------------------------

    def files_in_use(self) -> set[Path]:
        """Files and directories live VMs (sandboxes, build and pooled VMs) and the built-in
        templates use, and RAM files the runtime holds a reference on."""
        used: set[Path] = set(self.snapshots.builtin.values())
        runtime = self._runtime
        vms = list(runtime.vms.values()) if runtime is not None else []
        for vm in vms + list(self._vms.values()):
            used.update(Path(x.path) for x in vm.memory_layers)
            for disk in vm.disks:
                used.update(Path(x.path) for x in disk.layers)
                if disk.file:
                    used.add(Path(disk.file))
            used.add(Path(vm.workdir))
            if vm.mem_path:
                used.add(Path(vm.mem_path))
        for sources in self._create_sources:
            used.update(sources)
        if runtime is not None and runtime.memory.directory.is_dir():
            for mem in runtime.memory.directory.glob("*.mem"):
                if runtime.memory.refcount(mem.stem) > 0:
                    used.add(mem)
        return used

    async def blockd_devices(self) -> list[DeviceInfo]:
        return await self.blockd.devices()

    async def release_device(self, device_id: str) -> None:
        await self.blockd.release(device_id)

    # --- network policy (NetworkPolicies) ------------------------------------------------------

    async def network_reapplied(self) -> None:
        """The orchestrator has set every adopted sandbox's policy again after a start: an
        adopted egress proxy's table is now replaced by the node's (stale entries go)."""
        if self.egress.proxy is not None and self.egress.proxy.adopted:
            await self.egress.proxy.resync()

    async def set_network(self, sandbox_id: str, placement: Placement, policy: EgressPolicy,
                          identity: SlotIdentity | None) -> None:
        """Replace a running sandbox's policy: the proxy first (it only sees what the kernel
        sends it, and must judge that by the new policy), then the kernel; on a failure the
        old policy is put back in both."""
        vm = self._vm(sandbox_id)
        if vm.slot is None:
            raise BackendError(f"sandbox {sandbox_id} has no network slot")
        old_policy = vm.slot.policy
        old_entry = self.egress.entry(vm.slot.guest_address)
        entry = SlotEntry(vm.slot.guest_address,
                          identity or SlotIdentity(sandbox_id, "", None, None, ""), policy)
        await self.egress.announce_entry(sandbox_id, entry)
        try:
            with vm_errors(f"network policy of {sandbox_id} not applied"):
                await self.runtime.set_policy(vm, policy)
        except BackendError:
            with contextlib.suppress(Exception):
                await self.runtime.set_policy(vm, old_policy)
            if old_entry is not None:
                await self.egress.announce_entry(sandbox_id, old_entry)
            raise

    # --- template builds (TemplateBuilding: node/template_api.py) -----------------------------

    builds_from_images = True

    async def boot_image(self, sandbox_id: str, lowers: list[Path], disk_bytes: int,
                         cpu_count: int, memory_mb: int) -> Placement:
        """Cold-boot a build VM whose root disk is the overlaybd stack `lowers` (a pulled image);
        returns once its envd answers."""
        assets = self.assets
        spec = BootSpec(
            kernel=assets.kernel, initramfs=assets.initramfs, cmdline=assets.cmdline_base,
            vcpus=cpu_count, memory_mib=memory_mb, outbound=True,
            disks=[DiskSource("tools", assets.tools_image.stat().st_size, read_only=True,
                              file=assets.tools_image),
                   DiskSource("rootfs", disk_bytes, layers=list(lowers))])
        with vm_errors(f"booting the build VM {sandbox_id} failed", retryable=False):
            vm = await self.runtime.boot(spec)
        return self._placement(sandbox_id, vm)

    async def capture_template(self, sandbox_id: str) -> TemplateRef:
        """Pause a build VM into a template's boot snapshot. The snapshot belongs to the template
        (delete_snapshot releases it), not to the build VM."""
        vm = self._vm(sandbox_id)
        try:
            with vm_errors(f"snapshotting the build VM {sandbox_id} failed", retryable=False):
                record = await self.runtime.pause(vm, wait_teardown=True)
        finally:
            if vm.state != "running":
                self._forget_vm(sandbox_id)
        return self.snapshots.ref(record, "template")


async def _each_child(children: list[SandboxSpec],
                      start: Callable[[SandboxSpec], Awaitable[Placement]]
                      ) -> list[ForkOutcome]:
    """Start every child at once; a child that fails is its own outcome, not the batch's."""
    async def one(child: SandboxSpec) -> ForkOutcome:
        try:
            return ForkOutcome(child.sandbox_id, placement=await start(child))
        except BackendError as exc:
            return ForkOutcome(child.sandbox_id, error=str(exc))

    return list(await asyncio.gather(*(one(c) for c in children)))
