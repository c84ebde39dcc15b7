"""Admission control: the node refuses a create, resume or fork it cannot hold, before anything
is made for it (no record, no VM, no slot, no file), by what its sandboxes use, not only by what
they request (docs/control-plane.md §12).

Sandboxes mostly wait for the model: the seed ran 225,000 environments on 70 nodes at a
requested/used ratio of 27.9x for CPU (14.5x at worst) and 9.6x for memory (5.7x at worst). So
a node admits while two things hold:

- **Ceilings on what is requested**, at the seed's worst ratios: the vCPUs of the sandboxes
  holding a VM, the new ones included, at most `AENV_CPU_REQUEST_RATIO` (14) x the host's CPUs;
  their memory (guest + QEMU's overhead each) at most `AENV_MEMORY_REQUEST_RATIO` (5) x the
  host's MemTotal. They bound the worst case: every sandbox busy at once.
- **A floor of real headroom** (node/host_use.py reads it from /proc): MemAvailable, less what the
  sandboxes still starting will take and what the new one will (each counted at 1/ratio of its
  request, what the ratio says it uses), stays above `AENV_MEMORY_RESERVE_MB`; memory
  and CPU pressure (PSI "some avg10": the share of the last 10 s some task waited for memory or
  a CPU) stay at or under `AENV_MEMORY_PRESSURE_MAX` and `AENV_CPU_PRESSURE_MAX`. A kernel
  without PSI: the CPU check takes the host's busy share of the last 10 s (/proc/stat) instead,
  the memory check MemAvailable alone. This refuses before the host swaps or stalls.

Settings (environment, read when the node starts); every refusal is a 429 naming its resource,
the figures and the setting, with `Should-Retry: false` (the E2B SDK then raises at once: it
would otherwise retry a 429 three times within a second, which a full node does not outlast):

| variable | default | refusal |
|---|---|---|
| `AENV_MAX_SANDBOXES` | 0 (no limit) | sandboxes: that many sandboxes already hold a VM |
| `AENV_CPU_REQUEST_RATIO` | 14 | cpu: the requested vCPUs would pass ratio x the host's CPUs |
| `AENV_NODE_VCPUS` | unset | cpu: a fixed vCPU ceiling instead of the ratio's |
| `AENV_MEMORY_REQUEST_RATIO` | 5 | memory: the requested memory would pass ratio x MemTotal |
| `AENV_MEMORY_BUDGET_MB` | unset | memory: a fixed ceiling (MiB) instead of the ratio's |
| `AENV_MEMORY_RESERVE_MB` | 256 | memory: MemAvailable would fall below it (see above) |
| `AENV_MEMORY_PRESSURE_MAX` | 10 (%, 0: off) | memory: PSI memory some avg10 is over it |
| `AENV_CPU_PRESSURE_MAX` | 90 (%, 0: off) | cpu: PSI cpu some avg10 (or the busy share) is over it |
| `AENV_SANDBOX_OVERHEAD_MB` | 64 + 64 + 4 per vCPU (runtime/cgroup.py, measured under TCG) | QEMU's memory beside the guest's |
| `AENV_MIN_FREE_DISK_MB` | 1024 | disk: the state directory's filesystem has less free |
| `AENV_DISK_RESERVE` | 256 MiB (fsutil.py) | disk: the same when it is larger: blockd refuses upper growth below it (storage/budget.py), so a sandbox admitted without it could not write |

`room()` is what the node would admit now, in the units of a request (vCPUs; MiB of guest
memory plus the overhead): the heartbeat reports it (node/heartbeat.py), so the scheduler
places by the very figures the node admits by, and `admit()` decides by the same numbers.

Team quotas (a shared service's limits per team; 0 = no limit), 429 naming the limit:

| variable | default | what |
|---|---|---|
| `AENV_TEAM_MAX_SANDBOXES` | 100 | sandboxes a team runs at once (create, fork and resume count) |
| `AENV_TEAM_MAX_TEMPLATES` | 100 | templates a team has (a new template's build request counts) |
| `AENV_TEAM_MAX_SNAPSHOTS` | 500 | snapshots a team keeps |

A standalone node has one team and applies them itself; a node of a cluster leaves them to
the gateway, which counts a team's sandboxes, templates and snapshots over every node
(control/gateway/limits.py). Paused sandboxes hold no VM and count for nothing here (their disk use
does, through the free-disk check). VMs of the ready pool are the node's own and not counted.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from agentenv.api.errors import ApiError
from agentenv.api.tenancy import LOCAL_TEAM
from agentenv.fsutil import DEFAULT_RESERVE, disk_reserve
from agentenv.node.host_use import HostProbe, HostUse
from agentenv.node.records import SandboxRecord, State
from agentenv.runtime.cgroup import QEMU_BASE_OVERHEAD_MIB
from agentenv.settings import setting_text

log = logging.getLogger("agentenv.node.admission")

DEFAULT_TB_MIB = 64  # RuntimeConfig.tcg_tb_size_mib
OVERHEAD_PER_VCPU_MIB = 4  # runtime/cgroup.py vm_memory_overhead_mib
#: the seed's worst measured requested/used ratios (CPU 14.5x, memory 5.7x), rounded down
CPU_REQUEST_RATIO = 14.0
MEMORY_REQUEST_RATIO = 5.0
MEMORY_PRESSURE_MAX = 10.0
CPU_PRESSURE_MAX = 90.0
#: states whose VM is being made: its memory is not in MemAvailable yet
STARTING = frozenset({State.CREATING, State.RESUMING, State.ROLLING_BACK})
#: refusal limit -> the resource it is about (metrics, messages, the gateway's header)
RESOURCE = {
    "max_sandboxes": "sandboxes", "team_sandboxes": "sandboxes",
    "cpu_requested": "cpu", "cpu_pressure": "cpu",
    "memory_requested": "memory", "memory_available": "memory", "memory_pressure": "memory",
    "disk": "disk",
}
#: answered with every refusal: the E2B SDK retries a 429 without it (module doc)
REFUSAL_HEADERS = {"Should-Retry": "false"}
REFUSED_HEADER = "X-Agentenv-Refused"


class AdmissionRefused(ApiError):
    """A limit would be passed: 429; the message names the resource, the figures and the
    setting. `limit` is the limit's key (RESOURCE), `resource` what it is about."""

    def __init__(self, message: str, status: int, limit: str) -> None:
        super().__init__(message, status=status)
        self.limit = limit
        self.resource = RESOURCE.get(limit, limit)
        self.headers = {**REFUSAL_HEADERS, REFUSED_HEADER: self.resource}




def env_number(env: Mapping[str, str] | None, name: str, default: float | None,
                kind: type = int, minimum: float = 0) -> float | None:
    """The setting `name` of `env` (None: the process's) as a number, `default` when unset."""
    raw = setting_text(name, env).strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a {'number' if kind is float else 'whole number'}"
                         ) from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum}")
    return value


class QuotaExceeded(ApiError):
    """A team quota would be passed (429); the message names the limit and its setting."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message, status=429)
        self.limit = limit


#: kind -> (setting, default, what one is called)
QUOTA_SETTINGS = {
    "sandboxes": ("AENV_TEAM_MAX_SANDBOXES", 100, "concurrent sandboxes"),
    "templates": ("AENV_TEAM_MAX_TEMPLATES", 100, "templates"),
    "snapshots": ("AENV_TEAM_MAX_SNAPSHOTS", 500, "snapshots"),
}


@dataclass(frozen=True)
class TeamQuotas:
    """The per-team limits (0: none)."""

    sandboxes: int = QUOTA_SETTINGS["sandboxes"][1]
    templates: int = QUOTA_SETTINGS["templates"][1]
    snapshots: int = QUOTA_SETTINGS["snapshots"][1]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TeamQuotas:
        return cls(**{kind: int(env_number(env, name, default) or 0)
                      for kind, (name, default, _) in QUOTA_SETTINGS.items()})

    def check(self, kind: str, team: str, have: int, adding: int = 1) -> None:
        """Raise QuotaExceeded when `team`, holding `have`, may not get `adding` more."""
        limit = getattr(self, kind)
        if limit and have + adding > limit:
            setting, _, what = QUOTA_SETTINGS[kind]
            log.warning("team quota reached", extra={"team": team, "limit": kind,
                                                     "have": have, "quota": limit})
            raise QuotaExceeded(
                f"team quota reached: {limit} {what} (the team has {have}, {adding} more "
                f"asked; {setting}). Remove some, or ask the operator for a higher quota",
                kind)


@dataclass
class Reservation:
    memory_mb: int
    count: int
    cpus: int = 0
    released: bool = False


def size_text(mib: float) -> str:
    """648 MiB, 19.6 GiB."""
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


@dataclass(frozen=True)
class Room:
    """What the node would admit now, in the units of a request: vCPUs, and MiB of guest memory
    plus the node's per-sandbox overhead. `cpu_limit` and `memory_limit` name what bounds each
    free figure (the limit that refuses a request larger than it)."""

    sandboxes: int  # holding a VM, reservations included
    cpu_requested: int
    cpu_ceiling: int
    cpu_free: int
    cpu_limit: str  # cpu_requested | cpu_pressure
    memory_requested_mib: int
    memory_ceiling_mib: int
    memory_free_mib: int
    memory_limit: str  # memory_requested | memory_available | memory_pressure
    #: the expected use of sandboxes still starting (their memory is not in MemAvailable yet)
    starting_mib: float
    disk_free: int  # bytes
    disk_floor: int  # bytes
    disk_setting: str
    use: HostUse


class Admission:
    def __init__(self, state_dir: Path, *, max_sandboxes: int = 0,
                 vcpus: int | None = None, cpu_request_ratio: float = CPU_REQUEST_RATIO,
                 memory_budget_mb: int | None = None,
                 memory_request_ratio: float = MEMORY_REQUEST_RATIO,
                 memory_reserve_mb: int = 256,
                 memory_pressure_max: float = MEMORY_PRESSURE_MAX,
                 cpu_pressure_max: float = CPU_PRESSURE_MAX,
                 overhead_mb: int | None = None, min_free_disk_mb: int = 1024,
                 disk_reserve: int = 0, probe: HostProbe | None = None) -> None:
        self.state_dir = state_dir
        self.max_sandboxes = max_sandboxes
        self.probe = probe or HostProbe()
        host = self.probe.sample()
        self.host_cpus = host.cpus
        self.host_memory_mb = host.memory_total_mib
        self.cpu_request_ratio = cpu_request_ratio
        self.explicit_vcpus = vcpus is not None
        # the small epsilon: 14 x 0.1 is 1.4000000000000001 x 10 in floating point
        self.cpu_ceiling = (vcpus if vcpus is not None
                            else max(1, int(cpu_request_ratio * host.cpus + 1e-9)))
        self.memory_request_ratio = memory_request_ratio
        self.explicit_budget = memory_budget_mb is not None
        self.memory_ceiling_mb = (memory_budget_mb if memory_budget_mb is not None
                                  else int(memory_request_ratio * host.memory_total_mib))
        self.memory_reserve_mb = memory_reserve_mb
        self.memory_pressure_max = memory_pressure_max
        self.cpu_pressure_max = cpu_pressure_max
        self.overhead_mb = overhead_mb
        self.min_free_disk_mb = min_free_disk_mb
        self.disk_reserve = disk_reserve  # bytes blockd keeps free (AENV_DISK_RESERVE)
        self._reserved: list[Reservation] = []
        #: refusals by limit (RESOURCE's keys), for the node's metrics
        self.refusals: dict[str, int] = {}
        #: the team quotas of a standalone node (its one team); None on a cluster's node
        self.quotas: TeamQuotas | None = None
        #: templates or snapshots being made under hold_quota, by kind
        self._quota_held: dict[str, int] = {}
        #: the node serves several teams (a cluster's): a refusal names the limit but not the
        #: node's figures (sandboxes running, memory in use), which are every team's load
        self.shared = False

    @classmethod
    def from_env(cls, state_dir: Path, env: Mapping[str, str] | None = None) -> Admission:
        if setting_text("AENV_MEMORY_OVERCOMMIT", env).strip():
            raise ValueError("AENV_MEMORY_OVERCOMMIT is gone: the memory ceiling is "
                             "AENV_MEMORY_REQUEST_RATIO x the host's MemTotal (default 5)")
        budget = env_number(env, "AENV_MEMORY_BUDGET_MB", None)
        vcpus = env_number(env, "AENV_NODE_VCPUS", None, minimum=1)
        overhead = env_number(env, "AENV_SANDBOX_OVERHEAD_MB", None)

        def ratio(name: str, default: float) -> float:
            return float(env_number(env, name, default, float, minimum=0.01) or default)

        def percent(name: str, default: float) -> float:
            value = float(env_number(env, name, default, float) or 0.0)
            if value > 100:
                raise ValueError(f"{name}={value:g} is over 100 (a percentage; 0 turns it off)")
            return value

        admission = cls(
            state_dir,
            max_sandboxes=int(env_number(env, "AENV_MAX_SANDBOXES", 0) or 0),
            vcpus=int(vcpus) if vcpus is not None else None,
            cpu_request_ratio=ratio("AENV_CPU_REQUEST_RATIO", CPU_REQUEST_RATIO),
            memory_budget_mb=int(budget) if budget is not None else None,
            memory_request_ratio=ratio("AENV_MEMORY_REQUEST_RATIO", MEMORY_REQUEST_RATIO),
            memory_reserve_mb=int(env_number(env, "AENV_MEMORY_RESERVE_MB", 256) or 0),
            memory_pressure_max=percent("AENV_MEMORY_PRESSURE_MAX", MEMORY_PRESSURE_MAX),
            cpu_pressure_max=percent("AENV_CPU_PRESSURE_MAX", CPU_PRESSURE_MAX),
            overhead_mb=int(overhead) if overhead is not None else None,
            min_free_disk_mb=int(env_number(env, "AENV_MIN_FREE_DISK_MB", 1024) or 0),
            disk_reserve=int(env_number(env, "AENV_DISK_RESERVE", DEFAULT_RESERVE) or 0),
        )
        log.info("admission limits", extra={
            "max_sandboxes": admission.max_sandboxes, "host_cpus": admission.host_cpus,
            "cpu_ceiling": admission.cpu_ceiling, "host_memory_mb": admission.host_memory_mb,
            "memory_ceiling_mb": admission.memory_ceiling_mb,
            "memory_reserve_mb": admission.memory_reserve_mb,
            "memory_pressure_max": admission.memory_pressure_max,
            "cpu_pressure_max": admission.cpu_pressure_max,
            "psi": admission.probe.sample().cpu_pressure is not None,
            "min_free_disk_mb": admission.min_free_disk_mb,
            "disk_reserve": admission.disk_reserve})
        return admission

    # --- what a sandbox costs ----------------------------------------------------------------

    @property
    def overhead(self) -> tuple[int, int]:
        """(MiB per sandbox, MiB per vCPU) counted beside each guest's memory."""
        if self.overhead_mb is not None:
            return self.overhead_mb, 0
        return QEMU_BASE_OVERHEAD_MIB + DEFAULT_TB_MIB, OVERHEAD_PER_VCPU_MIB

    def sandbox_mb(self, memory_mb: int, cpu_count: int) -> int:
        """What one sandbox requests of the host: guest memory + QEMU's overhead."""
        fixed, per_vcpu = self.overhead
        return memory_mb + fixed + per_vcpu * cpu_count

    def _held(self, records: Iterable[SandboxRecord]) -> tuple[int, int, int, float]:
        """(count, vCPUs, MiB, MiB expected of those starting) of the sandboxes that hold a VM,
        plus outstanding reservations (a reservation's VMs are all still to start)."""
        count = cpus = memory = 0
        starting = 0
        for rec in records:
            if rec.state.holds_vm:
                size = self.sandbox_mb(rec.memory_mb, rec.cpu_count)
                count += 1
                cpus += rec.cpu_count
                memory += size
                if rec.state in STARTING:
                    starting += size
        for held in self._reserved:
            count += held.count
            cpus += held.cpus
            memory += held.memory_mb
            starting += held.memory_mb
        return count, cpus, memory, starting / self.use_ratio

    @property
    def use_ratio(self) -> float:
        """What a sandbox is expected to use is its request / this (never more than all of
        it: a ratio under 1 is a ceiling below the host's memory, not a guest using more than
        it was given)."""
        return max(self.memory_request_ratio, 1.0)

    def holding(self, records: Iterable[SandboxRecord]) -> tuple[int, int]:
        """(count, MiB) of the sandboxes that hold a VM, plus outstanding reservations."""
        count, _, memory, _ = self._held(records)
        return count, memory

    # --- room and admission ------------------------------------------------------------------

    def cpu_busy(self, use: HostUse) -> float:
        """The CPU figure the floor compares: PSI's where the kernel has it, else the busy
        share."""
        return use.cpu_pressure if use.cpu_pressure is not None else use.cpu_busy

    def room(self, records: Iterable[SandboxRecord]) -> Room:
        """What the node would admit now (module doc); `admit` refuses exactly past it."""
        count, cpus, memory, starting = self._held(records)
        use = self.probe.sample()
        cpu_free, cpu_limit = self.cpu_ceiling - cpus, "cpu_requested"
        if self.cpu_pressure_max and self.cpu_busy(use) > self.cpu_pressure_max:
            cpu_free, cpu_limit = 0, "cpu_pressure"
        memory_free, memory_limit = self.memory_ceiling_mb - memory, "memory_requested"
        # A new sandbox is expected to use 1/ratio of its request: in request units, the
        # headroom is ratio x what MemAvailable has left above the reserve.
        by_use = int((use.memory_available_mib - starting - self.memory_reserve_mb)
                     * self.use_ratio)
        if by_use < memory_free:
            memory_free, memory_limit = by_use, "memory_available"
        if (self.memory_pressure_max and use.memory_pressure is not None
                and use.memory_pressure > self.memory_pressure_max):
            memory_free, memory_limit = 0, "memory_pressure"
        floor, setting = self.min_free_disk_mb << 20, "AENV_MIN_FREE_DISK_MB"
        if self.disk_reserve > floor:
            floor, setting = self.disk_reserve, "AENV_DISK_RESERVE"
        return Room(sandboxes=count, cpu_requested=cpus, cpu_ceiling=self.cpu_ceiling,
                    cpu_free=max(cpu_free, 0), cpu_limit=cpu_limit,
                    memory_requested_mib=memory, memory_ceiling_mib=self.memory_ceiling_mb,
                    memory_free_mib=max(memory_free, 0), memory_limit=memory_limit,
                    starting_mib=starting, disk_free=shutil.disk_usage(self.state_dir).free,
                    disk_floor=floor, disk_setting=setting, use=use)

    def admit(self, what: str, records: Iterable[SandboxRecord], memory_mb: int, cpu_count: int,
              count: int = 1) -> Reservation:
        """Check every limit for `count` new VMs of this size; raises AdmissionRefused naming
        the limit. The reservation counts until released (the caller releases it once the
        sandboxes' records hold the VMs, or on failure)."""
        need = self.sandbox_mb(memory_mb, cpu_count) * count
        need_cpus = cpu_count * count
        room = self.room(records)
        if self.quotas is not None:  # a standalone node: every sandbox is its one team's
            try:
                self.quotas.check("sandboxes", LOCAL_TEAM, room.sandboxes, count)
            except QuotaExceeded as exc:
                self.refusals["team_sandboxes"] = self.refusals.get("team_sandboxes", 0) + 1
                raise AdmissionRefused(exc.message, 429, "team_sandboxes") from None
        if self.max_sandboxes and room.sandboxes + count > self.max_sandboxes:
            self._refuse("max_sandboxes", what, (
                f"sandbox limit reached ({room.sandboxes} of {self.max_sandboxes} running, "
                f"{count} more asked)"), "sandbox limit reached", "AENV_MAX_SANDBOXES")
        if need_cpus > room.cpu_free:
            self._refuse(room.cpu_limit, what, *self._words(room.cpu_limit, room, need_cpus,
                                                            need))
        if need > room.memory_free_mib:
            self._refuse(room.memory_limit, what, *self._words(room.memory_limit, room,
                                                               need_cpus, need))
        if room.disk_free < room.disk_floor:
            self._refuse("disk", what, *self._words("disk", room, need_cpus, need))
        held = Reservation(need, count, need_cpus)
        self._reserved.append(held)
        return held

    def _words(self, limit: str, room: Room, need_cpus: int, need: int
               ) -> tuple[str, str, str]:
        """(the refusal with the node's figures, without them, the setting) of `limit`."""
        use = room.use
        if limit == "cpu_requested":
            total = room.cpu_requested + need_cpus
            if self.explicit_vcpus:
                return (f"requested {total} vCPUs would exceed the node's {room.cpu_ceiling}",
                        "the requested vCPUs would exceed the node's ceiling", "AENV_NODE_VCPUS")
            return (f"requested {total} vCPUs would exceed {self.cpu_request_ratio:g} x "
                    f"{self.host_cpus} host CPUs",
                    f"the requested vCPUs would exceed {self.cpu_request_ratio:g} x the host's "
                    "CPUs", "AENV_CPU_REQUEST_RATIO")
        if limit == "cpu_pressure":
            figure = (f"pressure {use.cpu_pressure:.1f}% (PSI some avg10)"
                      if use.cpu_pressure is not None
                      else f"{use.cpu_busy:.1f}% busy over the last 10 s (no PSI)")
            return (f"{figure} is over {self.cpu_pressure_max:g}%",
                    f"the host's CPU pressure is over {self.cpu_pressure_max:g}%",
                    "AENV_CPU_PRESSURE_MAX")
        if limit == "memory_requested":
            total = room.memory_requested_mib + need
            if self.explicit_budget:
                return (f"requested {total} MiB would exceed the budget of "
                        f"{room.memory_ceiling_mib} MiB",
                        "the requested memory would exceed the node's budget",
                        "AENV_MEMORY_BUDGET_MB")
            return (f"requested {size_text(total)} would exceed "
                    f"{self.memory_request_ratio:g} x {size_text(self.host_memory_mb)} host "
                    "memory",
                    f"the requested memory would exceed {self.memory_request_ratio:g} x the "
                    "host's memory", "AENV_MEMORY_REQUEST_RATIO")
        if limit == "memory_available":
            ratio = self.use_ratio
            return (f"{size_text(use.memory_available_mib)} available, less "
                    f"{size_text(room.starting_mib)} for the sandboxes starting and "
                    f"{size_text(need / ratio)} for this (1/{ratio:g} of "
                    f"{size_text(need)} requested), would leave less than "
                    f"{self.memory_reserve_mb} MiB",
                    "the host's available memory is short", "AENV_MEMORY_RESERVE_MB")
        if limit == "memory_pressure":
            return (f"pressure {use.memory_pressure:.1f}% (PSI some avg10) is over "
                    f"{self.memory_pressure_max:g}%",
                    f"the host's memory pressure is over {self.memory_pressure_max:g}%",
                    "AENV_MEMORY_PRESSURE_MAX")
        assert limit == "disk", limit
        return (f"free disk low: the state filesystem under {self.state_dir} has "
                f"{room.disk_free >> 20} MiB free, {room.disk_floor >> 20} MiB must stay free",
                "free disk low", room.disk_setting)

    def bound(self, limit: str, room: Room) -> str:
        """What bounds a free figure of `room` now, for the scheduler's messages (its callers
        may read the node's figures; docs/control-plane.md §12)."""
        use = room.use
        if limit == "cpu_requested":
            return (f"AENV_NODE_VCPUS={room.cpu_ceiling}" if self.explicit_vcpus else
                    f"{self.cpu_request_ratio:g} x {self.host_cpus} host CPUs, "
                    "AENV_CPU_REQUEST_RATIO")
        if limit == "cpu_pressure":
            return f"{self.cpu_busy(use):.1f}% > {self.cpu_pressure_max:g}%, AENV_CPU_PRESSURE_MAX"
        if limit == "memory_requested":
            return (f"AENV_MEMORY_BUDGET_MB={room.memory_ceiling_mib}" if self.explicit_budget
                    else f"{self.memory_request_ratio:g} x {size_text(self.host_memory_mb)} "
                    "host memory, AENV_MEMORY_REQUEST_RATIO")
        if limit == "memory_available":
            return (f"{size_text(use.memory_available_mib)} available, "
                    f"{size_text(room.starting_mib)} starting, {self.memory_reserve_mb} MiB "
                    "reserve, AENV_MEMORY_RESERVE_MB")
        return (f"pressure {use.memory_pressure or 0:.1f}% > {self.memory_pressure_max:g}%, "
                "AENV_MEMORY_PRESSURE_MAX")

    def check_quota(self, kind: str, have: int) -> None:
        """A new template or snapshot of the standalone node's team (no-op in a cluster); for
        a caller that records it before it next awaits (else hold_quota)."""
        if self.quotas is not None:
            try:
                self.quotas.check(kind, LOCAL_TEAM, have + self._quota_held.get(kind, 0))
            except QuotaExceeded:
                self.refusals[f"team_{kind}"] = self.refusals.get(f"team_{kind}", 0) + 1
                raise

    @contextlib.contextmanager
    def hold_quota(self, kind: str, have: int) -> Iterator[None]:
        """Check and hold a place of the standalone node's team quota of `kind` while one is
        made (a snapshot, a pull: they await long before the catalogue counts them), so
        concurrent requests cannot all take the last place."""
        self.check_quota(kind, have)
        self._quota_held[kind] = self._quota_held.get(kind, 0) + 1
        try:
            yield
        finally:
            self._quota_held[kind] -= 1

    def release(self, held: Reservation | None) -> None:
        if held is not None and not held.released:
            held.released = True
            self._reserved.remove(held)

    def _refuse(self, limit: str, what: str, full: str, shared: str, setting: str) -> None:
        """Refuse naming the resource, the limit and its setting; with the node's figures
        unless the node is `shared` (they are in the node's log either way)."""
        self.refusals[limit] = self.refusals.get(limit, 0) + 1
        resource = RESOURCE[limit]
        text = f"cannot {what}: {resource}: {full} ({setting})"
        log.warning("admission refused", extra={"limit": limit, "resource": resource,
                                                 "reason": text})
        raise AdmissionRefused(f"cannot {what}: {resource}: {shared} ({setting})"
                               if self.shared else text, 429, limit)


def space_reserve(admission: Admission | None) -> tuple[int, str]:
    """(bytes, setting) a team's upload, pull or volume write leaves free: never less than what
    the node needs to admit a create (AENV_MIN_FREE_DISK_MB), so they cannot refuse other
    teams' creates."""
    reserve, setting = disk_reserve(), "AENV_DISK_RESERVE"
    if admission is not None and admission.min_free_disk_mb << 20 > reserve:
        reserve, setting = admission.min_free_disk_mb << 20, "AENV_MIN_FREE_DISK_MB"
    return reserve, setting
