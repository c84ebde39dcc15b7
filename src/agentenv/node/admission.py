"""Admission control: the node refuses a create, resume or fork it cannot hold, before anything
is made for it (no record, no VM, no slot, no file).

Limits (environment, read when the node starts):

| variable | default | refusal |
|---|---|---|
| `AENV_MAX_SANDBOXES` | 0 (no limit) | 429 when that many sandboxes already hold a VM |
| `AENV_MEMORY_BUDGET_MB` | overcommit x MemAvailable at node start | 429 when the memory of the sandboxes holding a VM (guest memory + QEMU overhead each) plus the new ones would pass it |
| `AENV_MEMORY_OVERCOMMIT` | 1.0 | the ratio above (guests rarely touch all their memory: > 1 admits more) |
| `AENV_MEMORY_RESERVE_MB` | 256 | 503 when the host's MemAvailable is below this right now |
| `AENV_SANDBOX_OVERHEAD_MB` | 64 + 64 + 4 per vCPU (runtime/cgroup.py, measured under TCG) | QEMU's memory beside the guest's |
| `AENV_MIN_FREE_DISK_MB` | 1024 | 503 when the state directory's filesystem has less free |
| `AENV_DISK_RESERVE` | 256 MiB (fsutil.py) | the same 503 when it is larger: blockd refuses upper growth below it (storage/budget.py), so a sandbox admitted without it could not write |

429 means "this node's quota is used up, retry once sandboxes end"; 503 means "the host itself
is short right now".

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
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from agentenv.fsutil import DEFAULT_RESERVE
from agentenv.node.errors import ApiError
from agentenv.node.records import SandboxRecord
from agentenv.node.tenancy import LOCAL_TEAM
from agentenv.runtime.cgroup import QEMU_BASE_OVERHEAD_MIB

log = logging.getLogger("agentenv.node.admission")

DEFAULT_TB_MIB = 64  # RuntimeConfig.tcg_tb_size_mib


class AdmissionRefused(ApiError):
    """A limit would be passed: 429 (node quota) or 503 (host short); the message names it."""

    def __init__(self, message: str, status: int, limit: str) -> None:
        super().__init__(message, status=status)
        self.limit = limit


def mem_available_mb(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable")


def env_number(env: Mapping[str, str], name: str, default: float | None,
                kind: type = int, minimum: float = 0) -> float | None:
    raw = env.get(name, "").strip()
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
        env = os.environ if env is None else env
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
    released: bool = False


class Admission:
    def __init__(self, state_dir: Path, *, max_sandboxes: int = 0, memory_budget_mb: int | None = None,
                 memory_overcommit: float = 1.0, memory_reserve_mb: int = 256,
                 overhead_mb: int | None = None, min_free_disk_mb: int = 1024,
                 disk_reserve: int = 0) -> None:
        self.state_dir = state_dir
        self.max_sandboxes = max_sandboxes
        self.memory_overcommit = memory_overcommit
        self.explicit_budget = memory_budget_mb is not None
        self.memory_budget_mb = (memory_budget_mb if memory_budget_mb is not None
                                 else int(memory_overcommit * mem_available_mb()))
        self.memory_reserve_mb = memory_reserve_mb
        self.overhead_mb = overhead_mb
        self.min_free_disk_mb = min_free_disk_mb
        self.disk_reserve = disk_reserve  # bytes blockd keeps free (AENV_DISK_RESERVE)
        self._reserved: list[Reservation] = []
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
        env = os.environ if env is None else env
        budget = env_number(env, "AENV_MEMORY_BUDGET_MB", None)
        overhead = env_number(env, "AENV_SANDBOX_OVERHEAD_MB", None)
        admission = cls(
            state_dir,
            max_sandboxes=int(env_number(env, "AENV_MAX_SANDBOXES", 0) or 0),
            memory_budget_mb=int(budget) if budget is not None else None,
            memory_overcommit=float(env_number(env, "AENV_MEMORY_OVERCOMMIT", 1.0, float,
                                                minimum=0.1) or 1.0),
            memory_reserve_mb=int(env_number(env, "AENV_MEMORY_RESERVE_MB", 256) or 0),
            overhead_mb=int(overhead) if overhead is not None else None,
            min_free_disk_mb=int(env_number(env, "AENV_MIN_FREE_DISK_MB", 1024) or 0),
            disk_reserve=int(env_number(env, "AENV_DISK_RESERVE", DEFAULT_RESERVE) or 0),
        )
        log.info("admission limits", extra={
            "max_sandboxes": admission.max_sandboxes, "memory_budget_mb": admission.memory_budget_mb,
            "memory_reserve_mb": admission.memory_reserve_mb,
            "min_free_disk_mb": admission.min_free_disk_mb,
            "disk_reserve": admission.disk_reserve})
        return admission

    def sandbox_mb(self, memory_mb: int, cpu_count: int) -> int:
        """What one sandbox costs the host: guest memory + QEMU's overhead."""
        overhead = (self.overhead_mb if self.overhead_mb is not None
                    else QEMU_BASE_OVERHEAD_MIB + DEFAULT_TB_MIB + 4 * cpu_count)
        return memory_mb + overhead

    def holding(self, records: Iterable[SandboxRecord]) -> tuple[int, int]:
        """(count, MiB) of the sandboxes that hold a VM, plus outstanding reservations."""
        count, memory = 0, 0
        for rec in records:
            if rec.state.holds_vm:
                count += 1
                memory += self.sandbox_mb(rec.memory_mb, rec.cpu_count)
        for held in self._reserved:
            count += held.count
            memory += held.memory_mb
        return count, memory

    def admit(self, what: str, records: Iterable[SandboxRecord], memory_mb: int, cpu_count: int,
              count: int = 1) -> Reservation:
        """Check every limit for `count` new VMs of this size; raises AdmissionRefused naming
        the limit. The reservation counts until released (the caller releases it once the
        sandboxes' records hold the VMs, or on failure)."""
        need = self.sandbox_mb(memory_mb, cpu_count) * count
        held_count, held_mb = self.holding(records)
        if self.quotas is not None:  # a standalone node: every sandbox is its one team's
            try:
                self.quotas.check("sandboxes", LOCAL_TEAM, held_count, count)
            except QuotaExceeded as exc:
                self.refusals["team_sandboxes"] = self.refusals.get("team_sandboxes", 0) + 1
                raise AdmissionRefused(exc.message, 429, "team_sandboxes") from None
        if self.max_sandboxes and held_count + count > self.max_sandboxes:
            self._refuse("max_sandboxes", 429, f"cannot {what}: sandbox limit reached", (
                f"{held_count} of {self.max_sandboxes} running, {count} more asked; "),
                "AENV_MAX_SANDBOXES")
        if held_mb + need > self.memory_budget_mb:
            source = ("AENV_MEMORY_BUDGET_MB" if self.explicit_budget else
                      f"{self.memory_overcommit:g} x MemAvailable at start, "
                      "AENV_MEMORY_OVERCOMMIT")
            self._refuse("memory_budget", 429, f"cannot {what}: memory budget exhausted", (
                f"{held_mb} MiB of {self.memory_budget_mb} MiB in use, {need} MiB more "
                "asked; "), source)
        available = mem_available_mb()
        if available < self.memory_reserve_mb:
            self._refuse("host_memory", 503, f"cannot {what}: host memory low", (
                f"MemAvailable {available} MiB, reserve {self.memory_reserve_mb} MiB; "),
                "AENV_MEMORY_RESERVE_MB")
        self._check_disk(what)
        held = Reservation(need, count)
        self._reserved.append(held)
        return held

    def _check_disk(self, what: str) -> None:
        """503 below the larger of AENV_MIN_FREE_DISK_MB and AENV_DISK_RESERVE: under the
        reserve blockd refuses every disk's growth, so a new sandbox could not write."""
        free = shutil.disk_usage(self.state_dir).free
        floor, setting = self.min_free_disk_mb << 20, "AENV_MIN_FREE_DISK_MB"
        if self.disk_reserve > floor:
            floor, setting = self.disk_reserve, "AENV_DISK_RESERVE"
        if free < floor:
            self._refuse("disk", 503, f"cannot {what}: free disk low", (
                f"the state filesystem under {self.state_dir} has {free >> 20} MiB free, "
                f"{floor >> 20} MiB must stay free; "), setting)

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

    def _refuse(self, limit: str, status: int, reason: str, figures: str, setting: str) -> None:
        """Refuse naming the limit and its setting; with the node's figures unless the node is
        `shared` (they are in the node's log either way)."""
        self.refusals[limit] = self.refusals.get(limit, 0) + 1
        full = f"{reason} ({figures}{setting})"
        log.warning("admission refused", extra={"limit": limit, "reason": full})
        raise AdmissionRefused(f"{reason} ({setting})" if self.shared else full, status, limit)
