"""The VM backend: every sandbox is a QEMU VM run by `agentenv.runtime`.

- start(): a block daemon (the one at $AENV_BLOCKD_SOCKET, else a private `aenv blockd` child
  under <state>/vm-backend/blockd/), the guest assets (kernel, initramfs, tools disk), the runtime.
- default_templates(): the built-in `base` template (base_template.py), built on first start.
- create = a ready-pool VM of the template + `/init`, else a restore of its boot snapshot;
  pause = runtime.pause (memory kept), or with memory=False a filesystem-only pause (envd's
  /aenv/sync, then only the disks are sealed);
  resume = restore the pause snapshot, or cold-boot a filesystem-only one from its disks;
  snapshot = snapshot with the VM kept running;
  fork = one snapshot, then one restore per child.

Snapshots are directories under <state>/vm-backend/runtime/snapshots/; a later snapshot names
the layer files of the ones it grew from (memory and disk lineages), so a snapshot directory
is only deleted once it is released (killed sandbox, deleted snapshot) AND no remaining
snapshot names a file in it (`_collect`).

Crashes: QEMU runs without PDEATHSIG, so VMs outlive a node killed with SIGKILL. Every running
VM has a manifest (<state>/vm-backend/sandboxes/<id>.vm.json: pid, QMP socket, slot, blockd
devices, memory lineage; runtime/adopt.py); the next start takes each one over again (adopt())
when its QEMU and its blockd devices are still there, and ends it otherwise. The private blockd
is reused when it survived (its pid is in blockd/blockd.pid); a blockd started again reopens its
devices from their records, and QEMU's NBD disks reconnect to it (runtime/qemu.py), so the VMs
are adopted then too. A graceful stop pauses every VM first.

blockd is supervised (node/blockd_supervisor.py): a dead blockd is started again at once (the
private one, or the one `make up` starts: AENV_BLOCKD_STATE_DIR), /health answers 503 with the
reason while it is down, creates/resumes/forks wait for it up to AENV_BLOCKD_WAIT seconds (15)
and then answer 503, a new blockd process is checked at once for every running VM's devices
(missing ones are reported on /health and in the log, the sandbox is not deleted), and a
ready-pool VM's disks are checked before it is handed out.

Creates take a pre-restored, warmed VM from a ready pool when one is parked for the template
(node/ready_pool.py; AENV_VM_POOL_LOW/_HIGH/_TEMPLATES/_IDLE, 0 disables): the create is then one
envd `/init` with the sandbox's identity. The pooled VMs are not sandboxes: the orchestrator never
sees them, a graceful stop kills them, and their manifests (<state>/vm-backend/pool/) let the next
start end them after a crash. Every guest gets E2B's identity variables (E2B_SANDBOX=true,
E2B_SANDBOX_ID, E2B_TEMPLATE_ID) with the sandbox's env vars at `/init`.

A VM that dies on its own (QEMU killed, crashed) is reported through `on_sandbox_lost`; the
orchestrator then removes the sandbox. A sandbox's cpu_count/memory_mb/disk_size_mb are the
template's: a restore cannot change the machine a snapshot was taken of, so a template record
whose sizes differ from its snapshot's machine is refused at create.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentenv.fsutil import atomic_write_json
from agentenv.network.control import SlotEntry, SlotIdentity
from agentenv.network.policy import EgressPolicy
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
from agentenv.node.blockd_supervisor import BlockdLaunch, BlockdSupervisor
from agentenv.node.network_policy import EgressProxySupervisor
from agentenv.node.ready_pool import ReadyPool, ReadyPoolConfig

log = logging.getLogger("agentenv.node.vm_backend")

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
RELEASED_MARK = ".released"
SLOT_COOLDOWN = 30.0  # seconds before a network slot's address serves another VM
# How long a create, resume or fork waits for a blockd that is down (restarting) before it
# answers 503 (AENV_BLOCKD_WAIT).
BLOCKD_WAIT = 15.0
SYNC_TIMEOUT = 30.0  # seconds envd gets to flush the guest before a filesystem-only pause



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


def _egress_leftovers(base: Path) -> list[int]:
    try:
        from agentenv.network.process import running_for
    except ImportError:  # a build without the egress proxy
        return []
    return running_for(base / "egress" / "control.sock")


def _live_blockd(root: Path) -> int | None:
    """The pid of the private blockd an earlier node started in `root`, if it still runs and
    answers on its socket (blockd outlives a node killed with SIGKILL)."""
    from agentenv.blockd.client import BlockdClient
    from agentenv.blockd.errors import BlockdUnavailable

    try:
        pid = int((root / "blockd.pid").read_text().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if str(root / "blockd.sock").encode() not in f.read():
                return None
        with BlockdClient(root / "blockd.sock", timeout=5) as client:
            client.ping()
    except (OSError, ValueError, BlockdUnavailable):
        return None
    return pid


class VmBackend:
    name = "vm"
    #: create/resume/fork return after envd's /init with the spec's env vars and token
    #: (Runtime.restore does it), so the orchestrator skips its own readiness round trip.
    initialises_envd = True
    #: egress policies hold (network slots, the egress proxy): see runtime/network.py
    enforces_network_policy = True

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
        #: watches blockd, starts it again when it dies (node/blockd_supervisor.py)
        self.supervisor: BlockdSupervisor | None = None
        self._private_blockd = self.blockd_socket is None
        #: running sandboxes whose disks a restarted blockd did not bring back, with why
        self.blockd_lost: dict[str, str] = {}
        self._blockd: Any = None  # AsyncBlockdClient
        self.runtime: Any = None  # agentenv.runtime.Runtime, made in start()
        self._assets: Any = None  # GuestAssets
        self._vms: dict[str, Any] = {}  # sandbox id -> runtime VM
        self._cpu_seen: dict[str, tuple[float, int]] = {}
        self._gc_lock = asyncio.Lock()
        self._builtin: dict[str, Path] = {}  # built-in template name -> boot snapshot dir
        self._blockd_pid: int | None = None  # a private blockd that outlived the last node
        self._adopted: dict[str, Placement] = {}
        #: why a VM of the previous run was not adopted, by sandbox id
        self.adopt_failures: dict[str, str] = {}
        self._blockd_seen: dict[str, Any] | None = None  # blockd's pid + start
        self.pool_config = pool_config or ReadyPoolConfig.from_env()
        self.pool: ReadyPool | None = None  # made in start() once the runtime exists
        self._creating = 0  # creates under way (the pools' fills yield to them)
        # Snapshot directories creates are restoring from: in use although no VM runs from
        # them yet (a template deleted or untagged meanwhile must not lose them).
        self._create_sources: list[set[Path]] = []
        #: envd access token each running VM's guest holds (None: not secure). A snapshot
        #: taken of it carries the token, so a create from it can replace the token.
        self._tokens: dict[str, str | None] = {}
        #: Set by the orchestrator: called with (sandbox id, reason) when a VM dies on its own.
        self.on_sandbox_lost: Callable[[str, str], None] | None = None
        #: the node-wide egress proxy (made in start()); AENV_EGRESS_PROXY=0 runs without it
        #: (then names in policies cannot be allowed: their TCP 80/443 is reset)
        self.egress: EgressProxySupervisor | None = None
        self.egress_port = int(env.get("AENV_EGRESS_PROXY_PORT") or 0)
        self.egress_enabled = env.get("AENV_EGRESS_PROXY", "1") != "0"
        self.open_ranges = [x for x in (env.get("AENV_NET_OPEN_RANGES") or "").split(",") if x]
        self._sources: dict[str, str] = {}  # sandbox id -> its slot's source address

    def _let_qemu_reach(self, config: Any) -> None:
        """QEMU runs as an unprivileged user (runtime/privilege.py) and opens by path: the
        runtime's state, the private blockd's NBD sockets and the guest assets. Each directory
        from the node's state directory down to them gets group search permission (only
        search: nothing becomes listable or readable)."""
        from agentenv.runtime import privilege

        if not config.qemu_user:
            return
        user = privilege.VMUser.lookup(config.qemu_user)
        # NBD sockets: the private blockd's, or the one `make up` starts (scripts/up.sh).
        targets = [config.state_dir, self.base / "blockd" / "state" / "nbd",
                   self.state_dir / "blockd" / "state" / "nbd"]
        if self._assets is not None:
            targets += [self._assets.kernel.parent, self._assets.initramfs.parent,
                        self._assets.tools_image.parent]
        for target in targets:
            privilege.reach(user, target, self.state_dir)

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
        atomic_write_json(self._owned_file(sandbox_id), owned)

    def _vm_file(self, sandbox_id: str) -> Path:
        return self.base / "sandboxes" / f"{sandbox_id}.vm.json"

    def _save_vm(self, sandbox_id: str, vm: Any) -> None:
        """The running VM's manifest, for a node restarted after a crash (runtime/adopt.py)."""
        from agentenv.runtime.adopt import vm_manifest

        # which blockd served its disks: a later start sees a blockd restart
        atomic_write_json(self._vm_file(sandbox_id),
                          {**vm_manifest(vm), "blockd": self._blockd_seen,
                           # its disks reconnect when blockd restarts (runtime/qemu.py)
                           "nbd_reconnect": True,
                           "guest_token": self._tokens.get(sandbox_id)})

    def _drop_vm(self, sandbox_id: str) -> None:
        self._vm_file(sandbox_id).unlink(missing_ok=True)

    def _load_manifests(self, where: Path | None = None) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for path in (where or self.base / "sandboxes").glob("*.vm.json"):
            try:
                found[path.name.removesuffix(".vm.json")] = json.loads(path.read_text())
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
        return found

    def _is_ours(self, path: Path) -> bool:
        try:
            path.resolve().relative_to(self.snapshot_root.resolve())
        except ValueError:
            return False
        return path.resolve() != self.snapshot_root.resolve()

    async def _release(self, record_dirs: list[str]) -> None:
        """Mark snapshot directories as unused, then delete those no other snapshot needs."""
        await self._drop_pools(record_dirs)
        marked = 0
        for raw in record_dirs:
            path = Path(raw)
            if self._is_ours(path) and path.is_dir():
                (path / RELEASED_MARK).touch()
                marked += 1
        if marked:  # nothing newly unused: nothing to collect (a scan reads every record)
            await self._collect()

    async def _collect(self) -> None:
        # Files of running VMs (they name the snapshot they came from), read on the loop.
        in_use: set[Path] = set()
        vms = list(self.runtime.vms.values()) if self.runtime is not None else []
        for vm in vms + list(self._vms.values()):
            in_use.update(Path(ref.path).parent for ref in vm.memory_layers)
            for disk in vm.disks:
                in_use.update(Path(x.path).parent for x in disk.layers)
        for sources in self._create_sources:
            in_use.update(sources)
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
            needed.update(_record_dirs(record))
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
        from agentenv.runtime.adopt import manifest_alive
        from agentenv.runtime.config import RuntimeConfig, privilege_settings_from_env
        from agentenv.runtime.vm import Runtime

        (self.base / "sandboxes").mkdir(parents=True, exist_ok=True)
        manifests = await asyncio.to_thread(self._load_manifests)
        # VMs parked in the ready pools of a crashed run: never adopted, always ended.
        pooled = await asyncio.to_thread(self._load_manifests, self.base / "pool")
        private_root = self.base / "blockd"
        launch = self._blockd_launch(private_root)
        if self.blockd_socket is None:
            self._blockd_pid = await asyncio.to_thread(_live_blockd, private_root)
        # A VM whose QEMU survived is adopted when blockd (still running, or started again:
        # it reopens its devices from their records) serves its disks (adopt_vm checks).
        alive = {sid: m for sid, m in manifests.items() if manifest_alive(m)}
        self._note_not_alive(manifests, alive)
        keep_pids = {int(m["pid"]) for m in alive.values()}
        if self._blockd_pid is not None:
            keep_pids.add(self._blockd_pid)
        # The egress proxy too: the supervisor adopts it (the guests' flows through it go on).
        if self.egress_enabled:
            keep_pids.update(await asyncio.to_thread(_egress_leftovers, self.base))
        await asyncio.to_thread(self._reap_leftovers, keep_pids, list(alive.values()))
        if self.blockd_socket is None:
            private_root.mkdir(parents=True, exist_ok=True)
            self.blockd_socket = private_root / "blockd.sock"
            if self._blockd_pid is not None:
                log.info("reusing the private blockd of the previous run",
                         extra={"pid": self._blockd_pid})
        self.supervisor = BlockdSupervisor(self.blockd_socket, launch=launch,
                                           on_new_blockd=self._blockd_replaced)
        await self.supervisor.start()  # starts the private blockd when there is none
        if self.supervisor.problem() is not None:
            raise BackendError(f"the node cannot start without blockd: "
                               f"{self.supervisor.problem()}", unavailable=True)
        self._blockd = AsyncBlockdClient(self.blockd_socket)
        self._blockd_seen = self.supervisor.identity
        log.info("guest assets: building or checking", extra={"dir": str(self.assets_dir)})
        t0 = time.monotonic()
        self._assets = await asyncio.to_thread(build_assets, self.assets_dir)
        log.info("guest assets ready", extra={"seconds": round(time.monotonic() - t0, 1),
                                              "built": list(self._assets.built)})
        proxy_port = await self._start_egress()
        config = RuntimeConfig(state_dir=self.base / "runtime", accel=self.accel,  # type: ignore[arg-type]
                               network_prefix=self.network_prefix, boot_timeout=300,
                               egress_proxy_port=proxy_port,
                               network_open_ranges=self.open_ranges,
                               blockd_socket=self.blockd_socket,
                               slot_first_index=self.first_slot,
                               # The proxy's pooled keep-alive connections to a dead VM
                               # (httpx: 5 s) must expire before its address serves another.
                               slot_reuse_delay=SLOT_COOLDOWN,
                               # VMs outlive a node crash; the next start adopts them.
                               qemu_die_with_parent=False,
                               **privilege_settings_from_env(os.environ))
        self._let_qemu_reach(config)
        self.runtime = Runtime(config, blockd=self._blockd, on_vm_died=self._vm_died)
        # Before adopting or abandoning anything: a second node (or bench) with this network
        # prefix is refused here instead of taking over the first one's slots.
        self.runtime.slots.acquire_prefix()
        # Before the runtime builds network slots: adopted VMs keep theirs.
        await self._adopt_all(manifests, alive)
        await self._abandon_pooled(pooled)
        await self.runtime.start(kernel_for_probe=self._assets.kernel)
        self.pool = ReadyPool(self.runtime, self.pool_config, self.base / "pool",
                              busy=lambda: self._creating > 0)
        self.pool.start()
        await self._collect()

    async def _start_egress(self) -> int | None:
        """The egress proxy, before the host's rules that redirect to its port are made."""
        from agentenv.runtime.network import require_tools

        require_tools()
        if not self.egress_enabled:
            log.warning("egress proxy off (AENV_EGRESS_PROXY=0): no metadata service, and "
                        "TCP 80/443 of policies that name hosts is reset")
            return None
        try:
            import agentenv.network.process  # noqa: F401
        except ImportError:
            log.error("the egress proxy is not part of this build: running without it (no "
                      "metadata service; TCP 80/443 of policies that name hosts is reset)")
            return None
        from agentenv.runtime.network import parse_open_ranges

        opened = tuple(str(n) for n in parse_open_ranges(self.open_ranges))  # checked here
        egress = EgressProxySupervisor(self.base / "egress" / "control.sock", self.egress_port,
                                       log_path=self.state_dir / "logs" / "egress-proxy.log",
                                       open_ranges=opened)
        port = await egress.start()
        self.egress = egress
        return port

    # --- network policy (runtime/network.py, node/network_policy.py) ---------------------------

    async def _announce(self, sandbox_id: str, vm: Any, spec: SandboxSpec) -> None:
        """Tell the egress proxy who the VM's slot is and what it may reach."""
        if vm.slot is None:
            return
        identity = spec.identity or SlotIdentity(spec.sandbox_id, spec.template_id, None,
                                                 None, "")
        await self._announce_entry(sandbox_id, SlotEntry(vm.slot.guest_address, identity,
                                                         spec.egress))

    async def _announce_entry(self, sandbox_id: str, entry: SlotEntry) -> None:
        old = self._sources.get(sandbox_id)
        self._sources[sandbox_id] = entry.source
        if self.egress is not None:
            if old is not None and old != entry.source:
                await self.egress.remove(old)
            await self.egress.set(entry)

    async def _forget_slot(self, sandbox_id: str) -> None:
        source = self._sources.pop(sandbox_id, None)
        if source is not None and self.egress is not None:
            await self.egress.remove(source)

    async def network_reapplied(self) -> None:
        """The orchestrator has set every adopted sandbox's policy again after a start: an
        adopted egress proxy's table is now replaced by the node's (stale entries go)."""
        if self.egress is not None and self.egress.adopted:
            await self.egress.resync()

    async def set_network(self, sandbox_id: str, placement: Placement, policy: EgressPolicy,
                          identity: SlotIdentity | None) -> None:
        """Replace a running sandbox's policy: the proxy first (it only sees what the kernel
        sends it, and must judge that by the new policy), then the kernel; on a failure the
        old policy is put back in both."""
        from agentenv.runtime.errors import RuntimeError_

        vm = self._vm(sandbox_id)
        if vm.slot is None:
            raise BackendError(f"sandbox {sandbox_id} has no network slot")
        old_policy = vm.slot.policy
        old_entry = self.egress.entries.get(vm.slot.guest_address) if self.egress else None
        entry = SlotEntry(vm.slot.guest_address,
                          identity or SlotIdentity(sandbox_id, "", None, None, ""), policy)
        await self._announce_entry(sandbox_id, entry)
        try:
            await self.runtime.set_policy(vm, policy)
        except (RuntimeError_, OSError) as exc:
            with contextlib.suppress(Exception):
                await self.runtime.set_policy(vm, old_policy)
            if old_entry is not None:
                await self._announce_entry(sandbox_id, old_entry)
            raise BackendError(f"network policy of {sandbox_id} not applied: {exc}") from exc

    async def _adopt_all(self, manifests: dict[str, dict[str, Any]],
                         alive: dict[str, dict[str, Any]]) -> None:
        from agentenv.runtime.adopt import abandon, adopt_vm
        from agentenv.runtime.errors import RuntimeError_

        for sid, manifest in manifests.items():
            refusal = self._blockd_changed(manifest) if sid in alive else None
            if sid in alive and refusal is None:
                try:
                    vm = await adopt_vm(self.runtime, manifest)
                except (RuntimeError_, OSError) as exc:
                    log.warning("running VM of the previous run not adopted",
                                extra={"sandbox_id": sid, "error": str(exc)})
                    self.adopt_failures[sid] = f"its VM could not be taken over: {exc}"
                else:
                    self._tokens[sid] = manifest.get("guest_token")
                    self._adopted[sid] = self._placement(sid, vm)
                    log.info("VM adopted", extra={"sandbox_id": sid, "pid": vm.pid})
                    continue
            if refusal is not None:
                self.adopt_failures[sid] = refusal
                log.error("running VM of the previous run ended: blockd restarted under it",
                          extra={"sandbox_id": sid, "reason": refusal})
            await abandon(self.runtime, manifest)
            self._drop_vm(sid)

    async def _abandon_pooled(self, pooled: dict[str, dict[str, Any]]) -> None:
        from agentenv.runtime.adopt import abandon

        for vm_id, manifest in pooled.items():
            await abandon(self.runtime, manifest)
            (self.base / "pool" / f"{vm_id}.vm.json").unlink(missing_ok=True)
        if pooled:
            log.info("ended the ready-pool VMs of the previous run",
                     extra={"count": len(pooled)})

    def _reap_leftovers(self, keep_pids: set[int], keep: list[dict[str, Any]]) -> None:
        """SIGKILL QEMU and blockd processes a crashed node left running on this state dir,
        except those named in `keep_pids` (VMs to adopt, a reusable blockd).

        The node holds the state dir's lock, so whatever else still names it is a leftover."""
        needle = str(self.base.resolve()).encode()
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
        for sub in ("vms", "memory"):  # work dirs and RAM files of the killed VMs
            for stale in (self.base / "runtime" / sub).glob("*"):
                if stale in kept:
                    continue
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)

    def _vm_died(self, vm: Any) -> None:
        if self.pool is not None:
            self.pool.vm_died(vm)
        for sid, known in list(self._vms.items()):
            if known is vm:
                log.error("sandbox VM died", extra={"sandbox_id": sid, "reason": vm.error})
                self._vms.pop(sid, None)
                self._cpu_seen.pop(sid, None)
                self._drop_vm(sid)
                if self.on_sandbox_lost is not None:
                    self.on_sandbox_lost(sid, f"its VM died: {vm.error}")

    async def close(self) -> None:
        if self.egress is not None:
            with contextlib.suppress(Exception):
                await self.egress.close()
            self.egress = None
        if self.pool is not None:
            with contextlib.suppress(Exception):
                await self.pool.close()
            self.pool = None
        if self.runtime is not None:
            with contextlib.suppress(Exception):
                await self.runtime.close()
            self.runtime = None
        for sid in list(self._vms):
            self._drop_vm(sid)
        self._vms.clear()
        if self._blockd is not None:
            with contextlib.suppress(Exception):
                await self._blockd.close()
            self._blockd = None
        if self.supervisor is not None:
            await self.supervisor.close()
            if self._private_blockd:
                # The node's own blockd goes with it (a shared one, as `make up` starts, stays).
                await asyncio.to_thread(self.supervisor.stop_blockd)
            self.supervisor = None
        self._blockd_pid = None

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
        if self.pool is not None:
            with contextlib.suppress(Exception):
                record = self._load_record(TemplateRef(kind="template", data={"builtin": "base"}))
                self.pool.want(self._pool_key(record), record, pinned=True)
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

    def _placement(self, sandbox_id: str, vm: Any, token: str | None = None) -> Placement:
        self._vms[sandbox_id] = vm
        if token is not None:
            self._tokens[sandbox_id] = token
        self._save_vm(sandbox_id, vm)
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

    @staticmethod
    def _guest_env(spec: SandboxSpec) -> dict[str, str]:
        """The env vars envd gives every command: the sandbox's, and E2B's identity variables
        (what E2B sets in its sandboxes; a fork child or a pooled VM gets its own id here)."""
        identity = {"E2B_SANDBOX": "true", "E2B_SANDBOX_ID": spec.sandbox_id}
        if spec.template_id:
            identity["E2B_TEMPLATE_ID"] = spec.template_id
        return {**spec.env_vars, **identity}

    @staticmethod
    def _pool_key(record: Any) -> str:
        return str(Path(record.device_state).parent)

    async def _restore(self, spec: SandboxSpec, record: Any, previous_token: str | None = None
                       ) -> Placement:
        from agentenv.runtime.errors import RuntimeError_

        try:
            vm = await self.runtime.restore(record, env_vars=self._guest_env(spec),
                                            access_token=spec.access_token,
                                            egress=self._egress_of(spec),
                                            guest_token=previous_token)
        except (RuntimeError_, OSError) as exc:
            raise BackendError(
                f"starting the VM of {spec.sandbox_id} failed: {exc}") from exc
        await self._announce(spec.sandbox_id, vm, spec)
        return self._placement(spec.sandbox_id, vm, spec.access_token)

    @staticmethod
    def _egress_of(spec: SandboxSpec) -> EgressPolicy:
        """The spec's policy; a spec made without one (allow_internet_access only) still
        gets its outbound switch."""
        if spec.egress.is_default and not spec.allow_internet_access:
            return EgressPolicy.from_wire(None, False)
        return spec.egress

    async def create(self, spec: SandboxSpec) -> Placement:
        await self._need_blockd()
        record = self._load_record(spec.source)
        machine = record.machine
        if (spec.cpu_count, spec.memory_mb) != (machine.vcpus, machine.memory_mib):
            # The record's sizes are what the API shows; the snapshot decides what runs.
            raise BackendError(
                f"the template's record says {spec.cpu_count} vCPUs and {spec.memory_mb} MiB, "
                f"its snapshot was taken of a {machine.vcpus} vCPU, {machine.memory_mib} MiB "
                "machine (a restore cannot resize it)", retryable=False)
        self._creating += 1
        sources = _record_dirs(record)
        self._create_sources.append(sources)
        try:
            return await self._create(spec, record)
        finally:
            self._creating -= 1
            self._create_sources.remove(sources)

    async def _create(self, spec: SandboxSpec, record: Any) -> Placement:
        # A snapshot of a secure sandbox wakes up with that sandbox's envd token.
        guest_token = spec.source.data.get("guest_token")
        if self.pool is not None and self.pool_config.enabled:
            key = self._pool_key(record)
            vm = self.pool.take(key)
            # A create makes its template hot (the pinned base is always); the fill starts
            # after the take so it never races this create for the VM it just took.
            self.pool.want(key, record, guest_token=guest_token)
            if vm is not None:
                placed = await self._hand_over(spec, vm, guest_token)
                if placed is not None:
                    return placed
        return await self._restore(spec, record, previous_token=guest_token)

    async def _hand_over(self, spec: SandboxSpec, vm: Any, guest_token: str | None
                         ) -> Placement | None:
        """Make a pooled VM the sandbox `spec`: network policy, then envd's /init with its env
        vars, token and the time. None (the VM is ended) when the VM fails on the way."""
        from agentenv.runtime.errors import RuntimeError_

        assert self.pool is not None
        t0 = time.perf_counter()
        lost = await self._disks_missing(vm)
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
            egress = self._egress_of(spec)
            if vm.slot is not None and egress != vm.slot.policy:
                await self.runtime.set_policy(vm, egress)
            await self._announce(spec.sandbox_id, vm, spec)
            t1 = time.perf_counter()
            await self.runtime.envd_init(vm, self._guest_env(spec), spec.access_token,
                                         guest_token=guest_token)
        except (RuntimeError_, OSError) as exc:
            log.warning("pooled VM failed at create: restoring instead",
                        extra={"sandbox_id": spec.sandbox_id, "vm": vm.id, "error": str(exc)})
            await self._forget_slot(spec.sandbox_id)
            with contextlib.suppress(Exception):
                await self.runtime.kill(vm)
            self.pool.handed_over(vm)  # its pool manifest
            return None
        t2 = time.perf_counter()
        vm.timings = {"pooled": 1.0, "outbound_ms": (t1 - t0) * 1e3, "envd_init_ms": (t2 - t1) * 1e3,
                      "parked_s": time.time() - vm.started_at}
        # Writes the sandbox's manifest before the pool's goes.
        placed = self._placement(spec.sandbox_id, vm, spec.access_token)
        self.pool.handed_over(vm)
        log.info("sandbox VM from the ready pool", extra={
            "sandbox_id": spec.sandbox_id, "vm": vm.id,
            "timings_ms": {k: round(v, 1) for k, v in vm.timings.items()}})
        return placed

    async def pause(self, sandbox_id: str, placement: Placement, memory: bool) -> PauseResult:
        """memory=False: a filesystem-only pause. envd saves its defaults and flushes the
        guest's filesystems, then only the disks are kept (no memory layer, no device state);
        resume cold-boots the VM from them."""
        from agentenv.runtime.errors import RuntimeError_

        vm = self._vm(sandbox_id)
        if not memory:
            await self._sync_guest(sandbox_id, vm)
        try:
            record = await self.runtime.pause(vm, memory=memory)
        except (RuntimeError_, OSError) as exc:
            raise BackendError(f"pausing {sandbox_id} failed: {exc}",
                               retryable=vm.state == "running") from exc
        self._vms.pop(sandbox_id, None)
        self._cpu_seen.pop(sandbox_id, None)
        self._drop_vm(sandbox_id)
        self._tokens.pop(sandbox_id, None)
        await self._forget_slot(sandbox_id)
        ref = self._ref(record, "paused")
        self._own(sandbox_id, Path(ref.data["record_dir"]))
        return PauseResult(snapshot=ref, memory=record.memory)

    async def _sync_guest(self, sandbox_id: str, vm: Any) -> None:
        """envd's /aenv/sync before a filesystem-only pause. As in E2B, such a pause needs a
        guest agent that answers (without its flush the disk would miss recent writes): the
        pause is refused otherwise and the sandbox keeps running."""
        import httpx

        token = self._tokens.get(sandbox_id)
        try:
            async with httpx.AsyncClient(timeout=SYNC_TIMEOUT, trust_env=False) as client:
                answer = await client.post(vm.envd_url + "/aenv/sync",
                                           headers={"X-Access-Token": token} if token else None)
        except httpx.HTTPError as exc:
            raise BackendError(
                f"a filesystem-only pause of {sandbox_id} needs its guest agent (envd) to flush "
                f"the disk, and envd did not answer: {exc!r}") from exc
        if answer.status_code != 204:
            raise BackendError(
                f"a filesystem-only pause of {sandbox_id} needs its guest agent (envd) to flush "
                f"the disk, and envd answered {answer.status_code}: {answer.text[:200]}")

    async def resume(self, spec: SandboxSpec, snapshot: SnapshotRef,
                     memory: bool = True) -> Placement:
        """memory=False or a filesystem-only snapshot: a cold boot from the snapshot's disk (a
        memory snapshot's disk is then as after a power cut: its journal recovers it)."""
        await self._need_blockd()
        record = self._load_record(snapshot)
        if not record.memory or not memory:
            return await self._cold_boot(spec, record)
        return await self._restore(spec, record)

    async def _cold_boot(self, spec: SandboxSpec, record: Any) -> Placement:
        """A VM booted from a filesystem-only snapshot's disks with the current guest assets
        (kernel, initramfs, tools disk: a reboot may pick up newer ones), then envd's /init
        with the sandbox's identity (env vars, token)."""
        from agentenv.runtime.errors import RuntimeError_
        from agentenv.runtime.vm import BootSpec, DiskSource

        assets = self._assets
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
                                        file=Path(snap.file) if snap.file else None))
        boot = BootSpec(kernel=assets.kernel, initramfs=assets.initramfs,
                        cmdline=assets.cmdline_base, vcpus=record.machine.vcpus,
                        memory_mib=record.machine.memory_mib,
                        egress=self._egress_of(spec), disks=disks)
        sources = _record_dirs(record)
        self._create_sources.append(sources)  # in use until the VM runs from them
        try:
            vm = await self.runtime.boot(boot)
            try:
                await self.runtime.envd_init(vm, self._guest_env(spec), spec.access_token)
            except BaseException:
                await self.runtime.kill(vm)
                raise
        except (RuntimeError_, OSError) as exc:
            raise BackendError(f"cold-booting {spec.sandbox_id} from its disk failed: {exc}"
                               ) from exc
        finally:
            self._create_sources.remove(sources)
        await self._announce(spec.sandbox_id, vm, spec)
        return self._placement(spec.sandbox_id, vm, spec.access_token)

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
        self._save_vm(sandbox_id, vm)  # its disks have a new sealed layer under the upper
        ref = self._ref(record, "snapshot")
        token = self._tokens.get(sandbox_id)
        if token:  # the snapshot's envd holds it: a create from it needs it to set its own
            ref.data["guest_token"] = token
        return ref

    async def fork(
        self, spec: SandboxSpec, placement: Placement, children: list[SandboxSpec]
    ) -> list[ForkOutcome]:
        from agentenv.runtime.errors import RuntimeError_

        await self._need_blockd()
        vm = self._vm(spec.sandbox_id)
        try:
            record = await self.runtime.snapshot(vm, keep_running=True)
        except (RuntimeError_, OSError) as exc:
            raise BackendError(f"fork of {spec.sandbox_id} failed: {exc}",
                               retryable=vm.state == "running") from exc
        self._save_vm(spec.sandbox_id, vm)
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
        self.blockd_lost.pop(sandbox_id, None)
        vm = self._vms.pop(sandbox_id, None)
        self._cpu_seen.pop(sandbox_id, None)
        self._tokens.pop(sandbox_id, None)
        if vm is not None:
            with contextlib.suppress(Exception):
                await self.runtime.kill(vm)
        await self._forget_slot(sandbox_id)
        self._drop_vm(sandbox_id)
        self._adopted.pop(sandbox_id, None)
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

    async def _drop_pools(self, record_dirs: list[str]) -> None:
        """Snapshots no longer used as templates take their ready VMs with them."""
        if self.pool is None:
            return
        for raw in record_dirs:
            for key in self.pool.pooled_keys():
                if Path(key).resolve() == Path(raw).resolve():
                    await self.pool.drop(key)

    async def adopt(self) -> dict[str, Placement]:
        """The VMs start() took over from the previous run (see the module doc)."""
        adopted, self._adopted = self._adopted, {}
        return adopted

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

    # --- crash recovery and garbage collection support -------------------------------------
    # (node/gc.py and Orchestrator._reconcile call these; kept apart from the pool code)

    def _blockd_launch(self, private_root: Path) -> BlockdLaunch | None:
        """How the supervisor starts blockd again: the private one, or the one `make up`
        starts (AENV_BLOCKD_STATE_DIR names its state directory); None: only watched."""
        env = os.environ
        if self.blockd_socket is None:
            return BlockdLaunch(private_root / "state", private_root / "blockd.sock",
                                private_root / "blockd.log", private_root / "blockd.pid")
        state = env.get("AENV_BLOCKD_STATE_DIR")
        if not state:
            return None
        home = Path(state).parent
        return BlockdLaunch(Path(state), self.blockd_socket,
                            Path(env.get("AENV_BLOCKD_LOG") or home / "blockd.log"),
                            Path(env.get("AENV_BLOCKD_PIDFILE") or home / "blockd.pid"))

    def health_problem(self) -> str | None:
        """Why the node cannot serve sandboxes fully right now (for /health); None: fine."""
        if self.supervisor is not None and (problem := self.supervisor.problem()):
            return problem
        if self.blockd_lost:
            return "; ".join(f"sandbox {sid}: {why}" for sid, why in sorted(self.blockd_lost.items()))
        return None

    async def _need_blockd(self) -> None:
        """Wait (briefly) for blockd; a create must never get a VM whose disks are gone."""
        if self.supervisor is None:
            return
        wait = float(os.environ.get("AENV_BLOCKD_WAIT") or BLOCKD_WAIT)
        if not await self.supervisor.wait_up(wait):
            raise BackendError(f"blockd is unavailable (waited {wait:g} s): "
                               f"{self.supervisor.problem()}", unavailable=True)

    async def _disks_missing(self, vm: Any) -> list[str]:
        """The blockd devices of `vm` the current blockd does not serve."""
        wanted = {d.device_id for d in vm.disks if getattr(d, "device_id", None)}
        if not wanted or self._blockd is None:
            return []
        try:
            served = {d.id for d in await self._blockd.list()}
        except Exception as exc:
            return [f"blockd cannot list its devices: {exc}"]
        return sorted(wanted - served)

    async def _blockd_replaced(self, identity: dict[str, Any]) -> None:
        """A new blockd process answers (it died and was started again): check at once that
        it brought back every running VM's disks. VMs whose disks are missing are reported
        (health, logs, the sandbox's lost reason), never silently deleted; pooled ones are
        ended (they are not sandboxes yet)."""
        self._blockd_seen = identity
        for sid, vm in list(self._vms.items()):
            missing = await self._disks_missing(vm)
            if missing:
                why = (f"blockd restarted (pid {identity.get('pid')}) without its disks "
                       f"{missing}: its disk I/O fails once QEMU stops waiting")
                self.blockd_lost[sid] = why
                log.error("sandbox lost its disks in a blockd restart",
                          extra={"sandbox_id": sid, "missing": missing})
            else:
                self._save_vm(sid, vm)  # the manifest names the blockd serving it now
        if self.pool is not None:
            for vm in list(self.pool.vms()):
                if await self._disks_missing(vm):
                    log.warning("ready-pool VM lost its disks in a blockd restart: ended",
                                extra={"vm": vm.id})
                    with contextlib.suppress(Exception):
                        await self.runtime.kill(vm)

    def _blockd_changed(self, manifest: dict[str, Any]) -> str | None:
        """Why a live VM must not be adopted: the blockd serving its disks is not the one it
        was started with (blockd restarted under it: its NBD connections were cut, writes in
        flight failed, the guest's filesystem cannot be trusted). None when it is the same."""
        then = manifest.get("blockd")
        has_devices = any(d.get("device_id") for d in manifest.get("disks", []))
        if manifest.get("nbd_reconnect"):
            return None  # its QEMU reconnected to the new blockd; adopt_vm checks the devices
        if not has_devices or then is None or self._blockd_seen is None or then == self._blockd_seen:
            return None
        return (f"blockd restarted under its running VM (pid {then.get('pid')} -> "
                f"{self._blockd_seen.get('pid')}): its disks' connections were cut, so the VM "
                "cannot go on safely and was ended")

    def _note_not_alive(self, manifests: dict[str, dict[str, Any]],
                        alive: dict[str, dict[str, Any]]) -> None:
        for sid in manifests:
            if sid not in alive:
                self.adopt_failures[sid] = "its QEMU process is gone"

    async def recover_pause(self, sandbox_id: str, placement: Placement,
                            since: float) -> PauseResult | None:
        """The pause snapshot of `sandbox_id` a crashed node wrote but did not record: the
        newest complete snapshot of its VM taken after `since` (no other operation ran on the
        sandbox while it was pausing). None when there is no complete one."""
        vm_id = placement.handle.get("vm_id")
        if not vm_id:
            return None
        record = await asyncio.to_thread(self._find_pause_record, str(vm_id), since)
        if record is None:
            return None
        ref = self._ref(record, "paused")
        if ref.data["record_dir"] not in self._owned(sandbox_id):
            self._own(sandbox_id, Path(ref.data["record_dir"]))
        return PauseResult(snapshot=ref, memory=record.memory)

    def _find_pause_record(self, vm_id: str, since: float) -> Any:
        from agentenv.snapshot.record import SnapshotRecord

        best = None
        if not self.snapshot_root.is_dir():
            return None
        for snap in self.snapshot_root.iterdir():
            if not snap.is_dir() or (snap / RELEASED_MARK).exists():
                continue
            try:
                record = SnapshotRecord.load(snap)
                if record.source_vm != vm_id or record.created_ms < since * 1000:
                    continue
                record.check_files()
            except Exception:  # half-written or damaged: not a pause snapshot to resume
                continue
            if best is None or record.created_ms > best.created_ms:
                best = record
        return best

    def files_in_use(self) -> set[Path]:
        """Files and directories live VMs (sandboxes, build and pooled VMs) and the built-in
        templates use, and RAM files the runtime holds a reference on."""
        used: set[Path] = set(self._builtin.values())
        vms = list(self.runtime.vms.values()) if self.runtime is not None else []
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
        memory = getattr(self.runtime, "memory", None)
        if memory is not None and memory.directory.is_dir():
            for mem in memory.directory.glob("*.mem"):
                if memory.refcount(mem.stem) > 0:
                    used.add(mem)
        return used

    async def blockd_devices(self) -> list[Any]:
        """blockd's devices (DeviceInfo); empty without a blockd."""
        return [] if self._blockd is None else list(await self._blockd.list())

    async def release_device(self, device_id: str) -> None:
        if self._blockd is not None:
            await self._blockd.release(device_id)

    # --- template builds (node/template_api.py) -----------------------------------------------

    async def boot_image(self, sandbox_id: str, lowers: list[Path], disk_bytes: int,
                         cpu_count: int, memory_mb: int) -> Placement:
        """Cold-boot a build VM whose root disk is the overlaybd stack `lowers` (a pulled image);
        returns once its envd answers."""
        from agentenv.runtime.errors import RuntimeError_
        from agentenv.runtime.vm import BootSpec, DiskSource

        assets = self._assets
        spec = BootSpec(
            kernel=assets.kernel, initramfs=assets.initramfs, cmdline=assets.cmdline_base,
            vcpus=cpu_count, memory_mib=memory_mb, outbound=True,
            disks=[DiskSource("tools", assets.tools_image.stat().st_size, read_only=True,
                              file=assets.tools_image),
                   DiskSource("rootfs", disk_bytes, layers=list(lowers))])
        try:
            vm = await self.runtime.boot(spec)
        except (RuntimeError_, OSError) as exc:
            raise BackendError(f"booting the build VM {sandbox_id} failed: {exc}",
                               retryable=False) from exc
        return self._placement(sandbox_id, vm)

    async def capture_template(self, sandbox_id: str) -> TemplateRef:
        """Pause a build VM into a template's boot snapshot. The snapshot belongs to the template
        (delete_snapshot releases it), not to the build VM."""
        from agentenv.runtime.errors import RuntimeError_

        vm = self._vm(sandbox_id)
        try:
            record = await self.runtime.pause(vm, wait_teardown=True)
        except (RuntimeError_, OSError) as exc:
            raise BackendError(f"snapshotting the build VM {sandbox_id} failed: {exc}",
                               retryable=False) from exc
        finally:
            if vm.state != "running":
                self._vms.pop(sandbox_id, None)
                self._cpu_seen.pop(sandbox_id, None)
                self._drop_vm(sandbox_id)
        return self._ref(record, "template")


def _record_dirs(record: Any) -> set[Path]:
    """The snapshot directories a record's files are in (its own and its ancestors')."""
    from agentenv.node.base_template import snapshot_layers

    return {Path(p).parent for p in (*snapshot_layers(record), record.device_state)}
