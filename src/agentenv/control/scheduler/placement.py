"""Node views and placement strategies.

A `NodeView` is the scheduler's in-memory picture of one node: its last heartbeat plus what was
placed on it since (sandboxes scheduled but not yet recorded, recorded but not yet in a
heartbeat), so a burst of creates between two heartbeats does not land on one node.

Strategies choose among the nodes that are up and fit the request:
- ``round-robin`` and ``random`` (the reference's);
- ``least-loaded``: the lowest load (the largest used fraction of vCPUs, memory or sandbox slots);
- ``cache-aware`` (default): the node holding the most of what the sandbox starts from (the
  snapshot, the template, else the largest share of its layers), ties broken by load.

Whatever the strategy, a fork goes to its source's node and a snapshot resume to a node holding
the snapshot (neither can move between nodes yet).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from agentenv.control.proto import scheduler_pb2 as pb

STRATEGIES = ("cache-aware", "least-loaded", "round-robin", "random")
DEFAULT_STRATEGY = "cache-aware"
# A placement not followed by RecordAssignment within this long (the create failed or the
# gateway died) stops counting against the node.
PENDING_TTL_S = 60.0


class PlacementError(Exception):
    """No node fits; `code` is the gRPC status to answer with, the message names why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Request:
    template_id: str = ""
    snapshot_id: str = ""
    vcpus: int = 2
    memory_mib: int = 512
    layers: tuple[str, ...] = ()


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
    recorded: dict[str, tuple[int, int]] = field(default_factory=dict)  # since: id -> (cpu, MiB)
    pending: list[tuple[float, int, int]] = field(default_factory=list)  # (monotonic, cpu, MiB)
    templates: frozenset[str] = frozenset()
    snapshots: frozenset[str] = frozenset()
    layers: frozenset[str] = frozenset()

    def update(self, status: pb.NodeStatus, seen_ms: float, reported: set[str] | None) -> None:
        self.status = status
        if status.address:
            self.address = status.address
        self.last_seen_ms = seen_ms
        self.templates = frozenset(status.templates)
        self.snapshots = frozenset(status.snapshots)
        self.layers = frozenset(status.layers)
        if reported is not None:
            self.reported = reported
            for sandbox_id in reported & self.recorded.keys():
                del self.recorded[sandbox_id]

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

    def _expire_pending(self) -> None:
        cutoff = time.monotonic() - PENDING_TTL_S
        if self.pending and self.pending[0][0] < cutoff:
            self.pending = [p for p in self.pending if p[0] >= cutoff]

    def usage(self) -> tuple[int, int, int]:
        """(vCPUs, MiB, sandboxes) placed here since the node's last heartbeat counted them."""
        self._expire_pending()
        cpu = sum(c for c, _ in self.recorded.values()) + sum(p[1] for p in self.pending)
        mem = sum(m for _, m in self.recorded.values()) + sum(p[2] for p in self.pending)
        return cpu, mem, len(self.recorded) + len(self.pending)

    def free(self) -> tuple[int, int, int | None]:
        """Free vCPUs, free MiB, free sandbox slots (None: no count limit)."""
        st = self.status
        assert st is not None
        cpu, mem, count = self.usage()
        slots = None
        if st.max_sandboxes:
            slots = st.max_sandboxes - (st.running + count)
        return st.cpu_free - cpu, st.memory_free_mib - mem, slots

    def load(self) -> float:
        """The largest used fraction of vCPUs, memory and sandbox slots (0 idle, 1 full)."""
        st = self.status
        assert st is not None
        cpu_free, mem_free, slots = self.free()
        parts = [0.0]
        if st.cpu_total:
            parts.append(1 - cpu_free / st.cpu_total)
        if st.memory_total_mib:
            parts.append(1 - mem_free / st.memory_total_mib)
        if st.max_sandboxes and slots is not None:
            parts.append(1 - slots / st.max_sandboxes)
        return max(parts)

    def misfit(self, req: Request, min_disk_bytes: int) -> str:
        """Why the request does not fit here ('' when it does)."""
        st = self.status
        assert st is not None
        cpu_free, mem_free, slots = self.free()
        if slots is not None and slots <= 0:
            return f"full ({st.max_sandboxes} sandboxes)"
        if cpu_free < req.vcpus:
            return f"{max(cpu_free, 0)} free vCPUs < {req.vcpus}"
        if mem_free < req.memory_mib:
            return f"{max(mem_free, 0)} MiB free < {req.memory_mib} MiB"
        if st.disk_free_bytes < min_disk_bytes:
            return f"{st.disk_free_bytes >> 20} MiB disk free < {min_disk_bytes >> 20} MiB"
        return ""

    def reserve(self, req: Request) -> None:
        self.pending.append((time.monotonic(), req.vcpus, req.memory_mib))

    def assigned(self, sandbox_id: str, vcpus: int, memory_mib: int) -> None:
        """RecordAssignment: the oldest pending placement becomes a recorded sandbox."""
        if self.pending:
            self.pending.pop(0)
        if sandbox_id not in self.reported:
            self.recorded[sandbox_id] = (vcpus, memory_mib)

    def released(self, sandbox_id: str) -> None:
        self.recorded.pop(sandbox_id, None)
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
    ) -> tuple[NodeView, str]:
        """The chosen node and why. `candidates` are the up nodes allowed for this request;
        `down` maps the others to why they are down (for the error message)."""
        fitting: list[NodeView] = []
        misfits: dict[str, str] = {}
        for view in candidates:
            why = view.misfit(req, self.min_disk_bytes)
            if why:
                misfits[view.node_id] = why
            else:
                fitting.append(view)
        if not fitting:
            raise PlacementError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no node can take {req.vcpus} vCPUs and {req.memory_mib} MiB: "
                + describe({**misfits, **{n: f"down ({w})" for n, w in down.items()}}),
            )
        fitting.sort(key=lambda v: v.node_id)
        if strategy == "round-robin":
            chosen = fitting[self._rr % len(fitting)]
            self._rr += 1
            return chosen, "round-robin"
        if strategy == "random":
            return self._random.choice(fitting), "random"
        if strategy == "least-loaded":
            return min(fitting, key=lambda v: v.load()), "least-loaded"
        scored = [(v.locality(req, template_layers), -v.load(), v) for v in fitting]
        best = max(scored, key=lambda t: (t[0], t[1]))
        if best[0] >= 1.0:
            reason = "cache: holds the snapshot" if req.snapshot_id else "cache: holds the template"
        elif best[0] > 0:
            reason = f"cache: holds {best[0]:.0%} of the layers"
        else:
            reason = "least-loaded (no node holds the template's layers)"
        return best[2], reason


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
