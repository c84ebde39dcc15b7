"""The node's heartbeat to the scheduler: a NodeStatus every 2 s (or what the scheduler asks).

Started by the node server when `--scheduler ADDR` (or $AENV_SCHEDULER) is set. The status says
what the scheduler places by: free vCPUs, memory and disk, the running and paused counts, the
full sandbox list (the scheduler reconciles its binding table against it), and what is held
locally: templates and their names, snapshots, and overlaybd layer ids (cache-aware placement),
and the blobs its blockd serves to peers with the address it serves them at (node/layer_peers.py).

Capacity is the node's own admission's (node/admission.py `room()`): cpu_free and memory_free_mib
are what the node would admit now (the smaller of its ceilings on what sandboxes request and of
its real headroom: MemAvailable, PSI), the totals its ceilings, with the per-sandbox memory
overhead and the free-disk floor it counts, so the scheduler places by the figures the node
admits by; also the host's CPUs, memory and pressure as they are. The sandbox count limit is
AENV_MAX_SANDBOXES.

This module imports only the scheduler's client from the control plane (docs/architecture.md §3).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.scheduling.client import Credentials, SchedulerClient, SchedulerError, pb

if TYPE_CHECKING:
    from agentenv.node.layer_peers import LayerPeers
    from agentenv.node.orchestrator import Orchestrator

log = logging.getLogger("agentenv.node.heartbeat")

DEFAULT_INTERVAL_S = 2.0


class HeartbeatSender:
    def __init__(
        self,
        orchestrator: Orchestrator,
        state_dir: Path,
        scheduler: str,
        credentials: Credentials,
        node_id: str,
        advertise: str,
        layer_address: str = "",
        interval: float = DEFAULT_INTERVAL_S,
        ready: Callable[[], bool] = lambda: True,
        peers: LayerPeers | None = None,
    ) -> None:
        self.orchestrator = orchestrator
        #: the templates and snapshots the heartbeat reports (node/catalogue.py)
        self.catalogue = orchestrator.catalogue
        self.state_dir = state_dir
        # the node's own identity: the scheduler takes heartbeats for `node_id` only with it
        self.client = SchedulerClient(scheduler, credentials, timeout=max(1.0, interval))
        self.node_id = node_id
        self.advertise = advertise
        self.layer_address = layer_address
        self.interval = interval
        self.ready = ready
        self.peers = peers  # adds blockd's chunk server and held blobs (node/layer_peers.py)
        self.sent = 0
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    def status(self) -> pb.NodeStatus:
        orch = self.orchestrator
        msg = pb.NodeStatus(
            node_id=self.node_id, address=self.advertise, layer_address=self.layer_address
        )
        for rec in orch.all_sandboxes():
            paused = rec.state.public == "paused"
            msg.sandboxes.add(
                sandbox_id=rec.sandbox_id,
                state="paused" if paused else "running",
                # the team the gateway named when it was made (api/tenancy.py): a binding the
                # scheduler re-adds from this list keeps it
                team_id=rec.team,
            )
            if paused:
                msg.paused += 1
            else:
                msg.running += 1
        admission = orch.admission
        assert admission is not None, "the node's server sets the admission before heartbeats"
        room = admission.room(orch.all_sandboxes())
        msg.cpu_total, msg.cpu_free = room.cpu_ceiling, room.cpu_free
        msg.memory_total_mib, msg.memory_free_mib = room.memory_ceiling_mib, room.memory_free_mib
        msg.max_sandboxes = admission.max_sandboxes
        msg.sandbox_overhead_mib, msg.sandbox_overhead_per_vcpu_mib = admission.overhead
        msg.disk_free_bytes, msg.disk_floor_bytes = room.disk_free, room.disk_floor
        msg.cpu_bound = admission.bound(room.cpu_limit, room)
        msg.memory_bound = admission.bound(room.memory_limit, room)
        use = room.use
        msg.host_cpus, msg.host_memory_mib = use.cpus, use.memory_total_mib
        msg.memory_available_mib = use.memory_available_mib
        if use.cpu_pressure is not None:
            msg.cpu_pressure = use.cpu_pressure
        if use.memory_pressure is not None:
            msg.memory_pressure = use.memory_pressure
        msg.cpu_busy = use.cpu_busy
        layers: set[str] = set()
        for tpl in list(self.catalogue.templates.values()):
            layers.update(tpl.ref.layers)
            names = (tpl.template_id, *tpl.names)
            if tpl.kind == "snapshot":
                msg.snapshots.extend(names)
            else:
                msg.templates.extend(names)
                if tpl.ref.layers:
                    for name in names:
                        msg.template_layers.add(template_id=name, layers=list(tpl.ref.layers))
            # what a sandbox of it asks: the scheduler sizes a request that names none by it
            for name in names:
                msg.template_sizes.add(template_id=name, vcpus=tpl.cpu_count,
                                       memory_mib=tpl.memory_mb)
        msg.layers.extend(sorted(layers))
        return msg

    async def send_once(self) -> float:
        """One heartbeat; returns the interval the scheduler asks for."""
        msg = self.status()
        if self.peers is not None:
            await self.peers.fill(msg)
        asked = await self.client.heartbeat(msg)
        self.sent += 1
        return asked or self.interval

    async def _run(self) -> None:
        while not self.ready():
            await asyncio.sleep(0.05)
        interval = self.interval
        while True:
            started = time.monotonic()
            try:
                interval = await self.send_once()
                if self.failures:
                    log.info("scheduler reachable again", extra={"after_failures": self.failures})
                self.failures = 0
            except SchedulerError as exc:
                self.failures += 1
                # Once, then every 30th: a scheduler being away is logged, not flooded.
                if self.failures == 1 or self.failures % 30 == 0:
                    log.warning("heartbeat failed: %s", exc, extra={"failures": self.failures})
            except Exception:
                self.failures += 1
                log.exception("heartbeat failed")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-heartbeat")
        log.info(
            "heartbeats to the scheduler",
            extra={"scheduler": self.client.target, "node_id": self.node_id,
                   "advertise": self.advertise},
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.close()
        if self.peers is not None:
            await self.peers.close()
