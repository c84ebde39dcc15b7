"""Node views and placement strategies.

A `NodeView` is the scheduler's in-memory picture of one node: its last heartbeat plus what was
placed on it since (sandboxes scheduled but not yet recorded, recorded but not yet in a
heartbeat), so a burst of creates between two heartbeats does not land on one node.

A node's heartbeat reports what it would admit now (node/admission.py `room()`: free vCPUs and
MiB by its ceilings on what sandboxes request and by its real headroom) with the memory
overhead it counts per sandbox and its free-disk floor: a request fits here exactly when the
node would admit it, less what was placed here since (docs/control-plane.md §12).

Strategies choose among the nodes that are up and fit the request:
- ``round-robin`` and ``random`` (the reference's);
- ``least-loaded``: the lowest load (the largest used fraction of vCPUs, memory or sandbox slots);
- ``cache-aware`` (default): the node holding the most of what the sandbox starts from (the
  snapshot, the template, else the largest share of its layers), ties broken by load.

Whatever the strategy, a fork goes to its source's node and a snapshot resume to a node holding
the snapshot (neither can move between nodes yet).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from agentenv.scheduling.proto import scheduler_pb2 as pb

STRATEGIES = ("cache-aware", "least-loaded", "round-robin", "random")
DEFAULT_STRATEGY = "cache-aware"
# A placement not followed by RecordAssignment within this long (the create failed or the
# gateway died) stops counting against the node.
PENDING_TTL_S = 60.0


#: reservation tokens not handed out yet: 8 bytes of the OS's CSPRNG each, drawn 4 KiB at a
#: time (`secrets.token_hex` per Schedule was a getrandom call that let go of the GIL on the
#: event loop every time, and another thread took it)
_TOKENS: list[str] = []
_TOKENS_PER_DRAW = 512
os.register_at_fork(after_in_child=_TOKENS.clear)  # a child never repeats its parent's


def _token() -> str:
    """16 hex digits, unpredictable (what secrets.token_hex(8) gives)."""
    try:
        return _TOKENS.pop()
    except IndexError:
        raw = os.urandom(8 * _TOKENS_PER_DRAW).hex()
        _TOKENS.extend(raw[i:i + 16] for i in range(0, len(raw), 16))
        return _TOKENS.pop()


class PlacementError(Exception):
    """No node fits; `code` is the gRPC status to answer with, the message names why.
    `refused`: resource (cpu, memory, disk, sandboxes; down, tried) -> how many nodes refused
    for it, and `request` the size asked, for a caller that may not read the message (the
    gateway: it names other teams' load)."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 refused: dict[str, int] | None = None, request: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.refused = refused or {}
        self.request = request


@dataclass
class Request:
    template_id: str = ""
    snapshot_id: str = ""
    vcpus: int = 2
    memory_mib: int = 512
    layers: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        return f"{self.vcpus} vCPUs and {self.memory_mib} MiB"


@dataclass
class NodeView:
    node_id: str
    address: str = ""
    status: pb.NodeStatus | None = None
    last_seen_ms: float = 0.0  # wall clock ms of the last heartbeat (shifted after an outage)
    sources: set[str] = field(default_factory=set)
    # Discovery said the node's endpoint is not ready (Kubernetes), or it left the static list.
    discovery_down: str = ""
    reported: set[str] = field(default_factory=set)  # sandboxes in its last heartbeat
    templates: frozenset[str] = frozenset()
    snapshots: frozenset[str] = frozenset()
    layers: frozenset[str] = frozenset()
    # Placed here since the last heartbeat counted them, with running totals (Schedule looks at
    # every node: no sums over lists there). MiB as the node counts them (with its overhead).
    recorded: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (vCPUs, MiB)
    # reservation id -> (monotonic, vCPUs, MiB), oldest first (dicts keep insertion order)
    pending: dict[str, tuple[float, int, int]] = field(default_factory=dict)
    _cpu: int = 0
    _mem: int = 0
    # Reconciliation can be skipped while nothing changes: the (id, team) list at the last full
    # reconciliation, when that was, and when a binding of this node last changed.
    listed: frozenset[tuple[str, str]] | None = None
    reconciled_ms: float = 0.0
    changed_ms: float = 0.0
    # The status's numbers as plain ints, for Schedule's loop over every node (a protobuf field
    # read costs several times a tuple's): cpu_free, memory_free_mib, disk_free_bytes,
    # cpu_total, memory_total_mib, max_sandboxes, running, the per-sandbox and per-vCPU memory
    # overhead, disk_floor_bytes.
    numbers: tuple[int, int, int, int, int, int, int, int, int, int] = (0,) * 10

    def __post_init__(self) -> None:
        if self.status is not None:
            self._take_numbers(self.status)

    def _take_numbers(self, status: pb.NodeStatus) -> None:
        self.numbers = (
            status.cpu_free, status.memory_free_mib, status.disk_free_bytes, status.cpu_total,
            status.memory_total_mib, status.max_sandboxes, status.running,
            status.sandbox_overhead_mib, status.sandbox_overhead_per_vcpu_mib,
            status.disk_floor_bytes,
        )

    def need_mib(self, vcpus: int, memory_mib: int) -> int:
        """What a sandbox of this size takes of the node's memory as the node counts it."""
        return memory_mib + self.numbers[7] + self.numbers[8] * vcpus

    def update(self, status: pb.NodeStatus, seen_ms: float, reported: set[str] | None) -> None:
        self.status = status
        self._take_numbers(status)
        if status.address:
            self.address = status.address
        self.last_seen_ms = seen_ms
        self.templates = frozenset(status.templates)
        self.snapshots = frozenset(status.snapshots)
        self.layers = frozenset(status.layers)
        if reported is not None:
            fresh = len(reported - self.reported - self.recorded.keys())
            self.reported = reported
            for sandbox_id in reported & self.recorded.keys():
                self._forget(sandbox_id)
            # Sandboxes listed for the first time and not recorded yet: placed here, their
            # create under way. The node's figures count them now; so would their
            # reservations until RecordAssignment, and a burst at the node's last room would
            # be refused for room counted twice. Their reservations go (oldest first: which
            # is whose is not known; a wrong guess only lasts until the records arrive).
            for _ in range(min(fresh, len(self.pending))):
                self.unreserve(next(iter(self.pending)))

    def _forget(self, sandbox_id: str) -> None:
        cpu, mem = self.recorded.pop(sandbox_id)
        self._cpu -= cpu
        self._mem -= mem

    # --- liveness ---------------------------------------------------------------------------------

    def down_reason(self, now_ms: float, limit_ms: float) -> str:
        if self.discovery_down:
            return self.discovery_down
        if self.status is None:
            return "never heard from (no heartbeat yet)"
        age = now_ms - self.last_seen_ms
        if age > limit_ms:
            return f"no heartbeat for {age / 1000:.1f} s"
        return ""

    # --- capacity ---------------------------------------------------------------------------------

    def _expire_pending(self, now: float) -> None:
        cutoff = now - PENDING_TTL_S
        pending = self.pending
        while pending:
            oldest = next(iter(pending))
            if pending[oldest][0] >= cutoff:
                return
            self.unreserve(oldest)

    def capacity(self, now: float) -> tuple[int, int, int | None, float]:
        """Free vCPUs, free MiB, free sandbox slots (None: no count limit), and the load: the
        largest used fraction of vCPUs, memory and slots (0 idle, 1 full)."""
        st = self.status
        assert st is not None
        self._expire_pending(now)
        cpu_free = st.cpu_free - self._cpu
        mem_free = st.memory_free_mib - self._mem
        load = 0.0
        if st.cpu_total:
            load = 1 - cpu_free / st.cpu_total
        if st.memory_total_mib:
            load = max(load, 1 - mem_free / st.memory_total_mib)
        slots = None
        if st.max_sandboxes:
            slots = st.max_sandboxes - (st.running + len(self.recorded) + len(self.pending))
            load = max(load, 1 - slots / st.max_sandboxes)
        return cpu_free, mem_free, slots, max(load, 0.0)

    def load(self, now: float | None = None) -> float:
        return self.capacity(time.monotonic() if now is None else now)[3]

    def fit(self, req: Request, min_disk_bytes: int, now: float) -> tuple[str, float]:
        """(why the request does not fit here, '' when it does; the node's load). A reason
        starts with its resource (count_resources), then the node's own words for what bounds
        it."""
        st = self.status
        assert st is not None
        cpu_free, mem_free, slots, load = self.capacity(now)
        if slots is not None and slots <= 0:
            return f"sandboxes: full ({st.max_sandboxes} sandboxes)", load
        if cpu_free < req.vcpus:
            bound = f" ({st.cpu_bound})" if st.cpu_bound else ""
            return f"cpu: {max(cpu_free, 0)} free vCPUs < {req.vcpus}{bound}", load
        need = self.need_mib(req.vcpus, req.memory_mib)
        if mem_free < need:
            bound = f" ({st.memory_bound})" if st.memory_bound else ""
            return f"memory: {max(mem_free, 0)} MiB free < {need} MiB{bound}", load
        floor = max(min_disk_bytes, st.disk_floor_bytes)
        if st.disk_free_bytes < floor:
            return f"disk: {st.disk_free_bytes >> 20} MiB free < {floor >> 20} MiB", load
        return "", load

    def misfit(self, req: Request, min_disk_bytes: int, now: float | None = None) -> str:
        """Why the request does not fit here ('' when it does)."""
        return self.fit(req, min_disk_bytes, time.monotonic() if now is None else now)[0]

    def reserve(self, req: Request) -> str:
        """Hold room for `req` until it is recorded or cancelled; the reservation's id names
        this node (`node/token`), so a Release finds it without a table of its own."""
        reservation = f"{self.node_id}/{_token()}"
        mem = self.need_mib(req.vcpus, req.memory_mib)
        self.pending[reservation] = (time.monotonic(), req.vcpus, mem)
        self._cpu += req.vcpus
        self._mem += mem
        return reservation

    def unreserve(self, reservation: str) -> tuple[int, int] | None:
        """Cancel a reservation; its (vCPUs, MiB), None when it is not (or no longer) held."""
        held = self.pending.pop(reservation, None)
        if held is None:
            return None
        _, cpu, mem = held
        self._cpu -= cpu
        self._mem -= mem
        return cpu, mem

    def assigned(self, sandbox_id: str, vcpus: int, memory_mib: int, reservation: str = "",
                 default: tuple[int, int] = (2, 512)) -> None:
        """RecordAssignment: the reservation (without one, the oldest) becomes a recorded
        sandbox, counted with the size given, else the reservation's, else `default`."""
        if not reservation and self.pending:
            reservation = next(iter(self.pending))
        held = self.unreserve(reservation) if reservation else None
        if vcpus and memory_mib:
            size = (vcpus, self.need_mib(vcpus, memory_mib))
        else:
            size = held or (default[0], self.need_mib(*default))
        if sandbox_id in self.recorded:
            self._forget(sandbox_id)
        if sandbox_id not in self.reported:
            self.recorded[sandbox_id] = size
            self._cpu += size[0]
            self._mem += size[1]

    def released(self, sandbox_id: str) -> None:
        if sandbox_id in self.recorded:
            self._forget(sandbox_id)
        self.reported.discard(sandbox_id)

    def locality(self, req: Request, template_layers: dict[str, tuple[str, ...]]) -> float:
        """How much of what the sandbox starts from is here: 1 the snapshot or template itself,
        else the share of its layers held locally, 0 nothing."""
        if req.snapshot_id and req.snapshot_id in self.snapshots:
            return 1.0
        if req.template_id and req.template_id in self.templates:
            return 1.0
        layers = req.layers or template_layers.get(req.template_id or req.snapshot_id, ())
        if not layers:
            return 0.0
        return sum(1 for d in layers if d in self.layers) / len(layers)


class Placer:
    """Chooses a node among views; keeps the round-robin position."""

    def __init__(self, min_disk_bytes: int = 512 << 20, seed: int | None = None) -> None:
        self.min_disk_bytes = min_disk_bytes
        self._rr = 0
        self._random = random.Random(seed)

    def choose(
        self,
        strategy: str,
        req: Request,
        candidates: list[NodeView],
        down: dict[str, str],
        template_layers: dict[str, tuple[str, ...]],
        held: list[NodeView] | None = None,
    ) -> tuple[NodeView, str]:
        """The chosen node and why. `candidates` are the up nodes allowed for this request;
        `down` maps the others to why they are not (for the error message): "down (...)" or
        "tried (...)", the word first. `held`: the candidates holding the snapshot or template
        when the caller knows them already."""
        now = time.monotonic()
        wanted = req.snapshot_id or req.template_id
        if strategy == "cache-aware" and wanted:
            # The holders first: only they need their load worked out when one of them fits.
            if held is None:
                held = [v for v in candidates
                        if wanted in (v.snapshots if req.snapshot_id else v.templates)]
            fits = self._fitting(held, req, now) if held else []
            if fits:
                chosen = min((load, v.node_id, v) for v, load in fits)[2]
                reason = ("cache: holds the snapshot" if req.snapshot_id
                          else "cache: holds the template")
                return chosen, reason
        fitting = self._fitting(candidates, req, now)
        if not fitting:
            misfits = {v.node_id: v.fit(req, self.min_disk_bytes, now)[0] for v in candidates}
            why = {**misfits, **down}
            raise PlacementError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no node can take {req.text}: " + describe(why),
                refused=count_resources(why.values()), request=req.text,
            )
        if strategy == "round-robin":
            fitting.sort(key=lambda f: f[0].node_id)
            chosen = fitting[self._rr % len(fitting)][0]
            self._rr += 1
            return chosen, "round-robin"
        if strategy == "random":
            return self._random.choice(fitting)[0], "random"
        if strategy == "least-loaded":
            return min(fitting, key=lambda f: (f[1], f[0].node_id))[0], "least-loaded"
        # cache-aware, and no node holding the template or snapshot itself has room
        layers = req.layers or template_layers.get(wanted, ())
        if layers:
            share, _, _, chosen = min(
                (-sum(1 for d in layers if d in v.layers) / len(layers), load, v.node_id, v)
                for v, load in fitting
            )
            if share < 0:
                return chosen, f"cache: holds {-share:.0%} of the layers"
        chosen = min(fitting, key=lambda f: (f[1], f[0].node_id))[0]
        return chosen, "least-loaded (no node holds the template's layers)"


    def _fitting(
        self, views: list[NodeView], req: Request, now: float
    ) -> list[tuple[NodeView, float]]:
        """The views the request fits on, each with its load. The hot loop of Schedule: plain
        arithmetic on the running totals; `fit` (with the messages) only explains a refusal."""
        cutoff = now - PENDING_TTL_S
        vcpus, memory, min_disk = req.vcpus, req.memory_mib, self.min_disk_bytes
        fitting: list[tuple[NodeView, float]] = []
        for view in views:
            pending = view.pending
            if pending and next(iter(pending.values()))[0] < cutoff:
                view._expire_pending(now)
            (cpu, mem, disk, cpu_total, mem_total, limit, running, overhead, per_vcpu,
             floor) = view.numbers
            cpu_free = cpu - view._cpu
            mem_free = mem - view._mem
            if (cpu_free < vcpus or mem_free < memory + overhead + per_vcpu * vcpus
                    or disk < min_disk or disk < floor):
                continue
            load = 0.0
            if cpu_total:
                load = 1 - cpu_free / cpu_total
            if mem_total:
                used = 1 - mem_free / mem_total
                if used > load:
                    load = used
            if limit:
                slots = limit - (running + len(view.recorded) + len(pending))
                if slots <= 0:
                    continue
                used = 1 - slots / limit
                if used > load:
                    load = used
            fitting.append((view, load))
        return fitting


def count_resources(reasons: Iterable[str]) -> dict[str, int]:
    """resource -> how many of `reasons` name it."""
    counts: dict[str, int] = {}
    for why in reasons:
        word = re.match(r"[a-z]+", why)  # "memory: ...", "down (...)"
        resource = word.group() if word else "other"
        counts[resource] = counts.get(resource, 0) + 1
    return counts


def describe(why: dict[str, str], limit: int = 8) -> str:
    """'a: down (...); b: 1 free vCPUs < 2' with the first `limit` nodes by id."""
    if not why:
        return "no nodes are registered"
    items = sorted(why.items())
    text = "; ".join(f"{n}: {w}" for n, w in items[:limit])
    if len(items) > limit:
        text += f"; and {len(items) - limit} more"
    return text


def learn_template_layers(
    into: dict[str, tuple[str, ...]], statuses: Iterable[pb.NodeStatus]
) -> None:
    for status in statuses:
        for entry in status.template_layers:
            if entry.layers:
                into[entry.template_id] = tuple(entry.layers)
