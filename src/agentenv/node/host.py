"""What the orchestrator's collaborators use of it (node/orchestrator.py passes itself to each).

Each collaborator (node/creation.py, pauses.py, lineage.py, snapshots.py, expiry.py) names the
part it needs as a Protocol built on these. Its members are looked up at each call: the server
and tests set the admission, events, volumes, capabilities and activity tracker after the
orchestrator is made. Also the node's settings and counters they share with it (NodeConfig,
NodeCounters; node/orchestrator.py exports them too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from agentenv.node.admission import Reservation
from agentenv.node.backend import Capabilities, Placement, SandboxBackend, SandboxSpec
from agentenv.node.operations import Operations
from agentenv.node.records import SandboxRecord
from agentenv.node.store import Store


@dataclass
class NodeConfig:
    default_timeout: int = 300  # E2B's server default when the create body has no timeout
    fork_default_timeout: int = 15
    auto_resume_min_timeout: int = 300
    max_timeout: int = 30 * 24 * 3600
    reaper_interval: float = 1.0
    envd_ready_timeout: float = 60.0
    domain: str | None = None
    default_envd_version: str = "0.5.7"
    #: idlePauseAfter of sandboxes whose create and template name none (node/idle.py); 0: off
    idle_pause_after: int = 0


@dataclass
class NodeCounters:
    """Creates the node finished, in all and per team (a team's /nodes shows its own)."""

    create_successes: int = 0
    create_fails: int = 0
    #: team -> [successes, fails]
    teams: dict[str, list[int]] = field(default_factory=dict)
    #: pauses the node made of idle sandboxes, and resumes of sandboxes so paused
    idle_pauses: int = 0
    idle_resumes: int = 0

    def count_create(self, team: str, ok: bool) -> None:
        if ok:
            self.create_successes += 1
        else:
            self.create_fails += 1
        self.teams.setdefault(team, [0, 0])[0 if ok else 1] += 1

    def of_team(self, team: str) -> tuple[int, int]:
        successes, fails = self.teams.get(team, (0, 0))
        return successes, fails


class RecordsHost(Protocol):
    """The records, their store and operations, and the events of their transitions."""

    store: Store
    sandboxes: dict[str, SandboxRecord]
    ops: Operations
    config: NodeConfig

    def check_open(self) -> None: ...

    def clamp_timeout(self, seconds: int | None, default: int) -> int: ...

    def emit(self, kind: str, rec: SandboxRecord, **data: Any) -> None: ...


class RunHost(RecordsHost, Protocol):
    """And the backend that starts sandboxes, with the admission of what they hold."""

    backend: SandboxBackend
    capabilities: Capabilities

    def admit(self, what: str, memory_mb: int, cpu_count: int, count: int = 1
              ) -> Reservation | None: ...

    def release(self, held: Reservation | None) -> None: ...

    def spec(self, rec: SandboxRecord) -> SandboxSpec: ...

    async def envd_ready(self, rec: SandboxRecord, placement: Placement) -> None: ...
