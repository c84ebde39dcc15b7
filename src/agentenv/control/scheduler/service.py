"""The scheduler's logic behind the gRPC methods (scheduler.proto): placement, bindings, heartbeats.

Durable state is in Redis (store.py); this object keeps the node views (placement.py) and a copy
of the binding table in memory, rebuilt from Redis at start. Every change is written to Redis
first and to memory once Redis has it, so Lookup answers from memory (one scheduler process
at a time owns the table; docs/control-plane.md §2). Liveness: a node is down once it has missed `missed_heartbeats`
heartbeats (plus half an interval of slack); it is up again at its next heartbeat. Time the
scheduler itself was away (killed, restarting) is not held against the nodes: their heartbeat
ages are shifted by the outage when the state is loaded.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from agentenv.cluster_keys import node_key, peer_credential, peer_serve_key
from agentenv.control.scheduler.holders import DEFAULT_LIMIT, HolderIndex
from agentenv.control.scheduler.placement import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    NodeView,
    PlacementError,
    Placer,
    Request,
    count_resources,
    describe,
    learn_template_layers,
)
from agentenv.control.scheduler.store import Binding, Store, now_ms
from agentenv.scheduling.proto import scheduler_pb2 as pb

log = logging.getLogger("agentenv.control.scheduler")

ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
# Template names may carry a tag (`name:tag`) or a namespace (`team/name`).
REF_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,255}")
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
MAX_HOLDER_DIGESTS = 256
MAX_HOLDER_LIMIT = 64
ADDRESS_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5}")
MAX_VCPUS = 1024
RESERVATION_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._:-]{0,127})/[0-9a-f]{16}")
MAX_EXCLUDED = 256
MAX_MEMORY_MIB = 16 << 20
UP_CACHE_MS = 100


@dataclass
class SchedulerConfig:
    strategy: str = DEFAULT_STRATEGY
    heartbeat_interval_s: float = 2.0
    missed_heartbeats: int = 3
    default_vcpus: int = 2
    default_memory_mib: int = 512
    min_disk_free_mib: int = 512
    self_registration: bool = True
    # How long a peer credential of a Holders answer is good for (agentenv.cluster_keys): a
    # node no longer up (removed from discovery, stopped) is refused by its peers after this.
    peer_credential_ttl_s: float = 120.0
    # A binding younger than this is not dropped by a heartbeat that does not list it, and a
    # released sandbox is not re-added by one that does (the node's list may be that old).
    reconcile_grace_s: float = 5.0

    @property
    def down_after_ms(self) -> float:
        return (self.missed_heartbeats + 0.5) * self.heartbeat_interval_s * 1000


class Invalid(PlacementError):
    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_id(what: str, value: str, required: bool = True) -> str:
    if not value and not required:
        return value
    if not value:
        raise Invalid(f"{what} is required")
    if not ID_RE.fullmatch(value):
        raise Invalid(
            f"{what} {value[:80]!r} is not an id (letters, digits, '.', '_', ':', '-'; "
            "at most 128 characters)"
        )
    return value


def check_address(what: str, value: str) -> str:
    if value and not ADDRESS_RE.fullmatch(value):
        raise Invalid(f"{what} {value[:80]!r} is not host:port")
    return value


class PeerIssuer:
    """The peer credentials of Holders answers: node X's for holder P, made with P's serving
    key (derived from the cluster secret and P's id; kept per holder)."""

    def __init__(self, cluster_secret: str, ttl_s: float) -> None:
        self._secret = cluster_secret
        self.ttl_s = ttl_s
        self._serve_keys: dict[str, str] = {}

    def issue(self, asker: str, holder: str, now_s: float) -> str:
        key = self._serve_keys.get(holder)
        if key is None:
            if len(self._serve_keys) >= 10_000:  # ids of nodes long gone
                self._serve_keys.clear()
            key = self._serve_keys[holder] = peer_serve_key(node_key(self._secret, holder))
        return peer_credential(key, asker, int(now_s + self.ttl_s))


class SchedulerService:
    def __init__(self, store: Store, config: SchedulerConfig | None = None,
                 cluster_secret: str | None = None) -> None:
        self.store = store
        self.config = config or SchedulerConfig()
        # Without the secret (tests of the logic alone) Holders answers carry no credentials.
        self.issuer = (PeerIssuer(cluster_secret, self.config.peer_credential_ttl_s)
                       if cluster_secret else None)
        if self.config.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {self.config.strategy!r}: one of {', '.join(STRATEGIES)}"
            )
        self.views: dict[str, NodeView] = {}
        self.bindings: dict[str, Binding] = {}
        self.template_layers: dict[str, tuple[str, ...]] = {}
        #: template or snapshot (id or name) -> (vCPUs, MiB) a sandbox of it asks, as its
        #: holders report: a request that names no size is placed by it
        self.template_sizes: dict[str, tuple[int, int]] = {}
        self.holder_index = HolderIndex()  # blob digest -> nodes serving it to peers
        self.placer = Placer(min_disk_bytes=self.config.min_disk_free_mib << 20)
        # Memory (views, bindings, the up cache) changes under this lock: RPCs and discovery
        # call in from the event loop, heartbeats and releases from worker threads (they wait
        # for Redis), binding writes from the store's writer (on the loop, or its thread for a
        # TLS URL). Redis is never waited for while holding it (Lookup, which reads without
        # it, must not queue behind a write).
        self.lock = threading.RLock()
        self._sweeper: threading.Thread | None = None
        self._stopping = threading.Event()
        # Which nodes are up, recomputed when a node changes state or UP_CACHE_MS have passed
        # (Schedule would otherwise judge every node's liveness on every call).
        self._up: tuple[float, list[NodeView], dict[str, str]] | None = None
        #: (a list of up nodes of `_up`, template -> those of them holding it): Schedule's
        #: cache-aware placement looked at every up node on every call for the template's
        #: holders. A node whose templates change drops `_up`, and with its list this.
        self._held: tuple[list[NodeView] | None, dict[str, list[NodeView]]] = (None, {})

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the registry and the per-node binding sets from Redis; start the sweeper."""
        self.store.ping()
        grace = int(self.config.reconcile_grace_s * 1000)
        previous_alive = self.store.mark_alive(grace)
        started = now_ms()
        outage = max(0, started - previous_alive) if previous_alive else 0
        nodes = self.store.nodes()
        sets = self.store.node_sandboxes(nodes)
        bindings = self.store.all_bindings()
        with self.lock:
            self.bindings = bindings
            for node_id, (status, seen) in nodes.items():
                view = self._view(node_id)
                view.update(status, seen + outage, sets.get(node_id, set()))
                view.sources.add("heartbeat")
                self.holder_index.update(node_id, status.blobs, status.partial_blobs)
            learn_template_layers(self.template_layers, (s for s, _ in nodes.values()))
            for status, _ in nodes.values():
                self._learn_sizes(status)
        log.info(
            "scheduler state loaded",
            extra={"nodes": len(nodes), "bindings": len(self.bindings),
                   "outage_ms": outage},
        )
        self._stopping.clear()
        self._sweeper = threading.Thread(
            target=self._sweep_forever, name="scheduler-sweeper", daemon=True
        )
        self._sweeper.start()

    def close(self) -> None:
        self._stopping.set()
        if self._sweeper:
            self._sweeper.join()
            self._sweeper = None
        self.store.close()

    def _sweep_forever(self) -> None:
        grace = int(self.config.reconcile_grace_s * 1000)
        period = min(1.0, self.config.heartbeat_interval_s / 2)
        while not self._stopping.wait(period):
            try:
                self.store.mark_alive(grace)
            except Exception as exc:  # Redis away: keep serving what memory knows
                log.warning("scheduler sweep failed: %s", exc)

    def _view(self, node_id: str) -> NodeView:
        view = self.views.get(node_id)
        if view is None:
            view = self.views[node_id] = NodeView(node_id)
            self._up = None
        return view

    def up_nodes(self, at_ms: float) -> tuple[list[NodeView], dict[str, str]]:
        """(the up nodes, the others -> why they are down)."""
        cached = self._up
        if cached is not None and at_ms - cached[0] < UP_CACHE_MS:
            return cached[1], cached[2]
        up: list[NodeView] = []
        down: dict[str, str] = {}
        for view in self.views.values():
            why = self.down_reason(view, at_ms)
            if why:
                down[view.node_id] = why
            else:
                up.append(view)
        self._up = (at_ms, up, down)
        return up, down

    def _holding(self, template_id: str, up: list[NodeView]) -> list[NodeView]:
        """The nodes of `up` (a list up_nodes returned) holding `template_id`."""
        of, cache = self._held
        if of is not up:
            of, cache = self._held = (up, {})
        held = cache.get(template_id)
        if held is None:
            held = cache[template_id] = [v for v in up if template_id in v.templates]
        return held

    def down_reason(self, view: NodeView, at_ms: float | None = None) -> str:
        return view.down_reason(at_ms or now_ms(), self.config.down_after_ms)

    # --- discovery --------------------------------------------------------------------------------

    def set_discovered(self, source: str, nodes: Mapping[str, tuple[str, bool]]) -> None:
        """Replace what discovery `source` knows: node id -> (address, ready). A node that left
        the source, or is not ready there, is down until the source has it ready again."""
        with self.lock:
            for node_id, (address, ready) in nodes.items():
                view = self._view(node_id)
                view.sources.add(source)
                if address and not view.address:
                    view.address = address
                view.discovery_down = "" if ready else f"not ready in {source} discovery"
            for node_id, view in self.views.items():
                if source in view.sources and node_id not in nodes:
                    view.sources.discard(source)
                    view.discovery_down = f"removed from {source} discovery"
            self._up = None

    # --- RPCs -------------------------------------------------------------------------------------

    def _request(self, msg: pb.ScheduleRequest) -> Request:
        if msg.template_id and msg.snapshot_id:
            raise Invalid("give template_id or snapshot_id, not both")
        if not (msg.template_id or msg.snapshot_id or msg.source_sandbox_id):
            raise Invalid("one of template_id, snapshot_id or source_sandbox_id is required")
        for what, value in (("template_id", msg.template_id), ("snapshot_id", msg.snapshot_id)):
            if value and not REF_RE.fullmatch(value):
                raise Invalid(f"{what} {value[:80]!r} is not a template or snapshot reference")
        check_id("source_sandbox_id", msg.source_sandbox_id, required=False)
        check_id("team_id", msg.team_id, required=False)
        if msg.strategy and msg.strategy not in STRATEGIES:
            raise Invalid(f"unknown strategy {msg.strategy!r}: one of {', '.join(STRATEGIES)}")
        if msg.vcpus > MAX_VCPUS:
            raise Invalid(f"vcpus {msg.vcpus} is more than {MAX_VCPUS}")
        if msg.memory_mib > MAX_MEMORY_MIB:
            raise Invalid(f"memory_mib {msg.memory_mib} is more than {MAX_MEMORY_MIB}")
        if len(msg.exclude_nodes) > MAX_EXCLUDED:
            raise Invalid(f"at most {MAX_EXCLUDED} exclude_nodes, got {len(msg.exclude_nodes)}")
        for node_id in msg.exclude_nodes:
            check_id("exclude_nodes[]", node_id)
        vcpus, memory = self.template_sizes.get(msg.snapshot_id or msg.template_id, (0, 0))
        return Request(
            template_id=msg.template_id,
            snapshot_id=msg.snapshot_id,
            vcpus=msg.vcpus or vcpus or self.config.default_vcpus,
            memory_mib=msg.memory_mib or memory or self.config.default_memory_mib,
            layers=tuple(msg.layers),
        )

    def _learn_sizes(self, status: pb.NodeStatus) -> None:
        for entry in status.template_sizes:
            if entry.vcpus and entry.memory_mib:
                self.template_sizes[entry.template_id] = (entry.vcpus, entry.memory_mib)

    def schedule(self, msg: pb.ScheduleRequest) -> pb.ScheduleResponse:
        req = self._request(msg)
        with self.lock:
            return self._schedule(msg, req)

    def _schedule(self, msg: pb.ScheduleRequest, req: Request) -> pb.ScheduleResponse:
        strategy = msg.strategy or self.config.strategy
        at = now_ms()
        if msg.source_sandbox_id:
            view, reason = self._fork_node(msg.source_sandbox_id, req, at)
        else:
            candidates, down = self.up_nodes(at)
            held = (self._holding(req.template_id, candidates)
                    if strategy == "cache-aware" and req.template_id and not msg.exclude_nodes
                    else None)
            down = {n: f"down ({w})" for n, w in down.items()}
            if msg.exclude_nodes:
                tried = set(msg.exclude_nodes)
                down.update((v.node_id, "tried (it refused the sandbox)")
                            for v in candidates if v.node_id in tried)
                candidates = [v for v in candidates if v.node_id not in tried]
            holders = len(self.views)
            if req.snapshot_id:
                # A snapshot cannot move between nodes yet: only its holders are candidates.
                candidates = [v for v in candidates if req.snapshot_id in v.snapshots]
                down = {n: w for n, w in down.items() if req.snapshot_id in self.views[n].snapshots}
                holders = len(candidates) + len(down)
            if req.snapshot_id and not holders:
                raise PlacementError(
                    grpc.StatusCode.NOT_FOUND, f"no node holds snapshot {req.snapshot_id!r}"
                )
            if not candidates and not any(w.startswith("tried") for w in down.values()):
                what = f"holding snapshot {req.snapshot_id!r} " if req.snapshot_id else ""
                raise PlacementError(
                    grpc.StatusCode.UNAVAILABLE, f"no node {what}is up: " + describe(down),
                    refused=count_resources(down.values()), request=req.text,
                )
            view, reason = self.placer.choose(
                strategy, req, candidates, down, self.template_layers, held
            )
            if req.snapshot_id:
                reason = f"holds the snapshot; {reason}"
        reservation = view.reserve(req)
        return pb.ScheduleResponse(node_id=view.node_id, node_address=view.address, reason=reason,
                                   reservation=reservation)

    def _fork_node(self, source: str, req: Request, at: float) -> tuple[NodeView, str]:
        binding = self.bindings.get(source)
        if binding is None:
            raise PlacementError(
                grpc.StatusCode.NOT_FOUND, f"fork source sandbox {source!r} has no binding"
            )
        view = self.views.get(binding.node_id)
        why = self.down_reason(view, at) if view else "not registered"
        if view is None or why:
            raise PlacementError(
                grpc.StatusCode.UNAVAILABLE,
                f"fork source {source!r} is on node {binding.node_id}, which is down ({why})",
            )
        misfit = view.misfit(req, self.placer.min_disk_bytes)
        if misfit:
            raise PlacementError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"fork source {source!r} is on node {binding.node_id}, which cannot take "
                f"{req.text} more: {misfit}", refused=count_resources([misfit]),
                request=req.text,
            )
        return view, "fork source"

    async def record(self, msg: pb.Assignment) -> None:
        """Returns once Redis and memory have the binding (waits without holding a thread)."""
        check_id("sandbox_id", msg.sandbox_id)
        check_id("node_id", msg.node_id)
        check_id("team_id", msg.team_id, required=False)
        if msg.reservation:
            self._check_reservation(msg.reservation, msg.node_id)
        view = self.views.get(msg.node_id)
        if view is None:
            raise PlacementError(grpc.StatusCode.NOT_FOUND, f"unknown node {msg.node_id!r}")
        default = (self.config.default_vcpus, self.config.default_memory_mib)
        vcpus = msg.vcpus or default[0]
        memory = msg.memory_mib or default[1]
        binding = Binding(msg.sandbox_id, msg.node_id, msg.team_id, now_ms(), vcpus, memory)
        target: NodeView = view

        def apply(old: Binding | None) -> None:
            with self.lock:
                self.bindings[msg.sandbox_id] = binding
                target.changed_ms = binding.recorded_ms
                if old and old.node_id != msg.node_id:
                    self._changed(old.node_id, binding.recorded_ms)
                if old and old.node_id != msg.node_id and old.node_id in self.views:
                    self.views[old.node_id].released(msg.sandbox_id)
                target.assigned(msg.sandbox_id, msg.vcpus, msg.memory_mib, msg.reservation,
                                default)

        # Memory follows in Redis's order (two records of one sandbox racing end as in Redis).
        await self.store.record_async(binding, apply)

    def _check_reservation(self, reservation: str, node_id: str = "") -> str:
        """The node a reservation names (Schedule made it `node/token`)."""
        match = RESERVATION_RE.fullmatch(reservation)
        if match is None or (node_id and match.group(1) != node_id):
            raise Invalid(f"reservation {reservation[:80]!r} is not one this scheduler made"
                          + (f" for node {node_id!r}" if node_id else ""))
        return match.group(1)

    def release(self, msg: pb.ReleaseRequest) -> None:
        if msg.reservation:
            node_id = self._check_reservation(msg.reservation)
            with self.lock:
                view = self.views.get(node_id)
                if view is not None:
                    view.unreserve(msg.reservation)
            if not msg.sandbox_id:
                return
        check_id("sandbox_id", msg.sandbox_id)
        old = self.store.release(msg.sandbox_id)
        with self.lock:
            self.bindings.pop(msg.sandbox_id, None)
            if old:
                self._changed(old.node_id, now_ms())
            if old and old.node_id in self.views:
                self.views[old.node_id].released(msg.sandbox_id)

    def lookup(self, msg: pb.LookupRequest) -> pb.LookupResponse:
        check_id("sandbox_id", msg.sandbox_id)
        binding = self.bindings.get(msg.sandbox_id)
        if binding is None:
            return pb.LookupResponse(found=False)
        view = self.views.get(binding.node_id)
        return pb.LookupResponse(
            found=True,
            node_id=binding.node_id,
            node_address=view.address if view else "",
            node_up=bool(view) and not self.down_reason(view),
            team_id=binding.team_id,
        )

    def _mirror(
        self, msg: pb.NodeStatus, at: float, added: list[str], dropped: list[str]
    ) -> None:
        """Bring the in-memory bindings in line with what the heartbeat script changed."""
        with self.lock:
            for sandbox_id in dropped:
                self.bindings.pop(sandbox_id, None)
        if added or any(
            s.team_id and s.sandbox_id in self.bindings and not self.bindings[s.sandbox_id].team_id
            for s in msg.sandboxes
        ):
            # Added or given a team by the script: read back what it wrote.
            changed = [s.sandbox_id for s in msg.sandboxes]
            written = self.store.lookup_many(changed)
            with self.lock:
                for sandbox_id, binding in written.items():
                    old = self.bindings.get(sandbox_id)
                    if old is not None and old.node_id != binding.node_id:
                        self._changed(old.node_id, at)
                        if old.node_id in self.views:
                            self.views[old.node_id].released(sandbox_id)
                    self.bindings[sandbox_id] = binding

    def _alive_anyway(self, msg: pb.NodeStatus, at: float) -> None:
        """Redis refused the heartbeat: the node is alive all the same (its sandboxes stay
        routable from memory); the next heartbeat reconciles in full."""
        with self.lock:
            view = self.views.get(msg.node_id)
            if view is not None and view.status is not None:
                templates = view.templates
                view.update(msg, at, None)
                view.listed = None
                if view.templates != templates:
                    self._up = None

    def _changed(self, node_id: str, at: float) -> None:
        view = self.views.get(node_id)
        if view is not None:
            view.changed_ms = at

    def heartbeat(self, msg: pb.NodeStatus) -> pb.HeartbeatResponse:
        check_id("node_id", msg.node_id)
        check_address("address", msg.address)
        check_address("layer_address", msg.layer_address)
        if not msg.address and not (msg.node_id in self.views and self.views[msg.node_id].address):
            raise Invalid(f"node {msg.node_id!r}: address is required (host:port of its API)")
        if msg.node_id not in self.views and not self.config.self_registration:
            raise PlacementError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {msg.node_id!r} is not in the discovered node list and self-registration "
                "is off",
            )
        at = now_ms()
        grace = int(self.config.reconcile_grace_s * 1000)
        listed = frozenset((s.sandbox_id, s.team_id) for s in msg.sandboxes)
        known = self.views.get(msg.node_id)
        added: list[str] = []
        dropped: list[str] = []
        seen: set[str] | None = None
        if (
            known is not None
            and known.listed == listed
            and len(listed) == len(msg.sandboxes)
            and known.reconciled_ms > known.changed_ms + grace
        ):
            # The same list as at the last full reconciliation, and none of this node's
            # bindings changed since (beyond the grace): nothing can differ. The steady state.
            try:
                self.store.touch(msg, at)
            except Exception:
                self._alive_anyway(msg, at)
                raise
        else:
            seen = set()
            for sandbox in msg.sandboxes:
                check_id("sandboxes[].sandbox_id", sandbox.sandbox_id)
                check_id("sandboxes[].team_id", sandbox.team_id, required=False)
                if sandbox.sandbox_id in seen:
                    raise Invalid(f"sandbox {sandbox.sandbox_id!r} is listed twice")
                seen.add(sandbox.sandbox_id)
            try:
                added, dropped = self.store.heartbeat(msg, grace, at)
            except Exception:
                self._alive_anyway(msg, at)
                raise
            self._mirror(msg, at, added, dropped)
            with self.lock:
                view = self._view(msg.node_id)
                view.listed = listed
                view.reconciled_ms = at
                if added or dropped:
                    view.changed_ms = at
        with self.lock:
            view = self._view(msg.node_id)
            was_down = self.down_reason(view, at)
            view.sources.add("heartbeat")
            templates = view.templates
            view.update(msg, at, seen)
            if view.templates != templates:
                self._up = None  # and the holders of each template with it
            learn_template_layers(self.template_layers, (msg,))
            self._learn_sizes(msg)
            self.holder_index.update(msg.node_id, msg.blobs, msg.partial_blobs)
            if was_down:
                self._up = None
            log.info("node up", extra={"node": msg.node_id, "was": was_down})
        if added or dropped:
            log.info(
                "bindings reconciled",
                extra={"node": msg.node_id, "added": len(added), "dropped": len(dropped)},
            )
        return pb.HeartbeatResponse(interval_ms=int(self.config.heartbeat_interval_s * 1000))

    def holders(self, msg: pb.HoldersRequest) -> pb.HoldersResponse:
        """The up nodes with a layer address that hold each digest (NodeStatus.blobs and
        partial_blobs), the asking node left out, each with the asker's credential for it.
        An asker that is not up here (never heard from, stopped, removed from discovery) is
        told of no holder."""
        if len(msg.digests) > MAX_HOLDER_DIGESTS:
            raise Invalid(f"at most {MAX_HOLDER_DIGESTS} digests per Holders call, "
                          f"got {len(msg.digests)}")
        for digest in msg.digests:
            if not DIGEST_RE.fullmatch(digest):
                raise Invalid(f"digest {digest[:80]!r} is not sha256:<64 lowercase hex>")
        check_id("node_id", msg.node_id, required=False)
        limit = min(msg.limit or DEFAULT_LIMIT, MAX_HOLDER_LIMIT)
        with self.lock:  # the index and the views change under heartbeats (in threads)
            return self._holders(msg, limit)

    def _holders(self, msg: pb.HoldersRequest, limit: int) -> pb.HoldersResponse:
        _, down = self.up_nodes(now_ms())

        def usable(node_id: str) -> bool:
            view = self.views.get(node_id)
            return (node_id not in down and view is not None and view.status is not None
                    and bool(view.status.layer_address))

        out = pb.HoldersResponse()
        asker = msg.node_id
        answer = asker in self.views and asker not in down
        issuer, now_s = self.issuer, time.time()
        for digest in msg.digests:
            entry = out.blobs.add(digest=digest)
            if not answer:
                continue
            for node_id, complete in self.holder_index.holders(
                digest, exclude=asker, limit=limit, usable=usable
            ):
                status = self.views[node_id].status
                assert status is not None
                entry.holders.add(node_id=node_id, layer_address=status.layer_address,
                                  complete=complete,
                                  credential=issuer.issue(asker, node_id, now_s) if issuer else "")
        return out

    def list_nodes(self) -> pb.NodeList:
        with self.lock:
            return self._list_nodes()

    def _list_nodes(self) -> pb.NodeList:
        at = now_ms()
        out = pb.NodeList()
        for node_id in sorted(self.views):
            view = self.views[node_id]
            why = self.down_reason(view, at)
            info = out.nodes.add(
                up=not why,
                last_heartbeat_unix_ms=int(view.last_seen_ms),
                down_reason=why,
                discovered_by=",".join(sorted(view.sources)),
            )
            if view.status is not None:
                info.status.CopyFrom(view.status)
                del info.status.sandboxes[:]
            info.status.node_id = node_id
            info.status.address = view.address
        return out
