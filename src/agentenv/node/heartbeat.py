"""The node's heartbeat to the scheduler: a NodeStatus every 2 s (or what the scheduler asks).

Started by the node server when `--scheduler ADDR` (or $AENV_SCHEDULER) is set. The status says
what the scheduler places by: free vCPUs, memory and disk, the running and paused counts, the
full sandbox list (the scheduler reconciles its binding table against it), and what is held
locally: templates and their names, snapshots, and overlaybd layer ids (cache-aware placement),
and the blobs its blockd serves to peers with the address it serves them at (node/layer_peers.py).

Capacity: vCPUs offered are `AENV_NODE_VCPUS` (default 4 x the host's CPUs: sandboxes mostly
wait on the model); memory is the admission budget (node/admission.py) when there is one, else
the host's MemTotal/MemAvailable; the sandbox count limit is AENV_MAX_SANDBOXES.

This module imports only the scheduler's client from the control plane (docs/architecture.md §3).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.control.scheduler.client import Credentials, SchedulerClient, SchedulerError, pb
from agentenv.errors import AgentEnvError

if TYPE_CHECKING:
    from agentenv.node.layer_peers import LayerPeers
    from agentenv.node.orchestrator import Orchestrator

log = logging.getLogger("agentenv.node.heartbeat")

DEFAULT_INTERVAL_S = 2.0
VCPU_OVERCOMMIT = 4


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[name] = int(parts[0]) // 1024
    return out


def offered_vcpus() -> int:
    raw = os.environ.get("AENV_NODE_VCPUS", "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            raise AgentEnvError(f"AENV_NODE_VCPUS={raw!r} is not a whole number") from None
        if value < 1:
            raise AgentEnvError(f"AENV_NODE_VCPUS={raw!r} must be at least 1")
        return value
    return VCPU_OVERCOMMIT * (os.cpu_count() or 1)


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
        self.state_dir = state_dir
        # the node's own identity: the scheduler takes heartbeats for `node_id` only with it
        self.client = SchedulerClient(scheduler, credentials, timeout=max(1.0, interval))
        self.node_id = node_id
        self.advertise = advertise
        self.layer_address = layer_address
        self.interval = interval
        self.ready = ready
        self.peers = peers  # adds blockd's chunk server and held blobs (node/layer_peers.py)
        self.vcpus = offered_vcpus()
        self.sent = 0
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    def status(self) -> pb.NodeStatus:
        orch = self.orchestrator
        msg = pb.NodeStatus(
            node_id=self.node_id, address=self.advertise, layer_address=self.layer_address
        )
        cpu_used = 0
        held_mib = 0
        admission = orch.admission
        for rec in list(orch.sandboxes.values()):
            paused = rec.state.public == "paused"
            msg.sandboxes.add(
                sandbox_id=rec.sandbox_id,
                state="paused" if paused else "running",
                # the team the gateway named when it was made (node/tenancy.py): a binding the
                # scheduler re-adds from this list keeps it
                team_id=rec.team,
            )
            if paused:
                msg.paused += 1
            else:
                msg.running += 1
                cpu_used += rec.cpu_count
                held_mib += (admission.sandbox_mb(rec.memory_mb, rec.cpu_count)
                             if admission else rec.memory_mb)
        msg.cpu_total = self.vcpus
        msg.cpu_free = max(0, self.vcpus - cpu_used)
        if admission is not None:
            msg.memory_total_mib = admission.memory_budget_mb
            msg.memory_free_mib = max(0, admission.memory_budget_mb - held_mib)
            msg.max_sandboxes = admission.max_sandboxes
        else:
            info = _meminfo()
            msg.memory_total_mib = info.get("MemTotal", 0)
            msg.memory_free_mib = info.get("MemAvailable", 0)
        with contextlib.suppress(OSError):
            msg.disk_free_bytes = shutil.disk_usage(self.state_dir).free
        layers: set[str] = set()
        for tpl in list(orch.catalogue.templates.values()):
            layers.update(tpl.ref.layers)
            if tpl.kind == "snapshot":
                msg.snapshots.append(tpl.template_id)
                msg.snapshots.extend(tpl.names)
            else:
                msg.templates.append(tpl.template_id)
                msg.templates.extend(tpl.names)
                if tpl.ref.layers:
                    for name in (tpl.template_id, *tpl.names):
                        msg.template_layers.add(template_id=name, layers=list(tpl.ref.layers))
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
