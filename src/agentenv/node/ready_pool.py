"""Pre-restored, warmed VMs per hot template: what makes a VM-backend create fast.

Under TCG most of a fresh restore's first envd request is QEMU translating the guest's network
and HTTP paths (every QEMU starts with an empty translation cache), so a create that restores
spends ~0.3-0.5 s before its `/init` answers. The pool does that work ahead of time: a
background task restores VMs from a template's snapshot exactly as a create would (its own
writable disk layers, network slot and fresh vmgenid; the runtime's `/init` sets the clock),
sends them a few harmless envd requests (`/health`, a `Stat` RPC, a `/bin/true` command, a
second `/init`) so the request path is translated, and parks them running. A create takes one
(`take`), gives it its identity with one more `/init`, and the pool refills in the background.

Rules:
- A VM is handed out at most once: `take` pops it without an `await` in between.
- A parked VM that died is discarded (its resources were released by the runtime's watcher).
- Pools are keyed by the snapshot directory; `drop` (template deleted or rebuilt) kills its VMs,
  and a fill that finishes for a dropped pool kills what it made.
- Parked VMs are not sandboxes: the orchestrator never sees them. Each has a manifest under
  `manifest_dir` so a node restarted after a crash ends them (and frees their blockd devices).
- Sizing: a pool's target starts at `low`, doubles (up to `high`) when a take empties it, and
  falls back to `low` after `decay_seconds` without a take. One fill runs at a time on the node
  (restores are CPU-bound); a fill waits for a moment when no create is under way (up to
  MAX_YIELD_SECONDS) and while the host has less than `min_free_mib` available.
  Templates other than the pinned ones lose their pool after `idle_seconds` without a create;
  at most `max_templates` pools exist (least recently used goes first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field

from agentenv.envd_client import EnvdClient, EnvdClientError, read_reply
from agentenv.errors import AgentEnvError
from agentenv.fsutil import atomic_write_json
from agentenv.runtime.adopt import vm_manifest
from agentenv.settings import setting_text

log = logging.getLogger("agentenv.node.ready_pool")

#: The longest a fill waits for a moment without creates under way before it restores anyway.
MAX_YIELD_SECONDS = 30.0
#: seconds each warm-up call may take (the httpx client's per-read timeout was 30 s)
WARM_TIMEOUT = 30.0


class ReadyPoolConfig(BaseModel):
    """Watermarks of the ready pools (env: AENV_VM_POOL_LOW, _HIGH, _TEMPLATES, _IDLE)."""

    #: VMs kept ready per hot template; 0 disables the pools.
    low: int = Field(default=2, ge=0, le=64)
    #: the most VMs a pool grows to under bursts of creates
    high: int = Field(default=4, ge=0, le=64)
    #: templates pooled at once, the pinned `base` included
    max_templates: int = Field(default=3, ge=1, le=64)
    #: seconds without a create after which a template (not pinned) loses its pool
    idle_seconds: float = Field(default=600.0, gt=0)
    #: seconds without a take after which a grown pool shrinks back to `low`
    decay_seconds: float = Field(default=60.0, gt=0)
    #: fills wait while the host's MemAvailable is below this (MiB)
    min_free_mib: int = Field(default=1024, ge=0)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReadyPoolConfig:
        names = {"low": "AENV_VM_POOL_LOW", "high": "AENV_VM_POOL_HIGH",
                 "max_templates": "AENV_VM_POOL_TEMPLATES", "idle_seconds": "AENV_VM_POOL_IDLE"}
        raw: dict[str, Any] = {}
        for key, name in names.items():
            value = setting_text(name, env)
            if not value:
                continue
            try:
                raw[key] = float(value) if key == "idle_seconds" else int(value)
            except ValueError:
                raise AgentEnvError(f"{name} must be a number, got {value!r}") from None
        try:
            config = cls(**raw)
        except ValueError as exc:
            raise AgentEnvError(f"bad ready-pool setting: {exc}") from None
        if config.high < config.low:
            config.high = config.low
        return config

    @property
    def enabled(self) -> bool:
        return self.low > 0


@dataclass
class _Pool:
    key: str
    record: Any  # SnapshotRecord
    pinned: bool
    target: int
    guest_token: str | None = None  # the envd token the snapshot's guest holds, if any
    # a port whose server (a built-in template's, the code interpreter's) has POST /aenv/warm
    warm_port: int | None = None
    ready: deque[Any] = field(default_factory=deque)  # runtime VMs, oldest first
    filling: int = 0  # restores under way for this pool
    task: asyncio.Task[None] | None = None
    last_used: float = field(default_factory=time.monotonic)
    last_take: float = field(default_factory=time.monotonic)
    failures: int = 0
    dropped: bool = False


def _mem_available_mib() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) >> 10
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 30


class ReadyPool:
    """Pools of running, warmed VMs keyed by snapshot directory (see the module doc)."""

    def __init__(self, runtime: Any, config: ReadyPoolConfig, manifest_dir: Path,
                 *, on_change: Callable[[], None] | None = None,
                 busy: Callable[[], bool] | None = None) -> None:
        self.runtime = runtime  # agentenv.runtime.Runtime
        self.config = config
        self.manifest_dir = manifest_dir
        self._pools: dict[str, _Pool] = {}
        self._fill_lock = asyncio.Lock()  # one restore for the pools at a time
        self._cleanup: set[asyncio.Task[None]] = set()
        self._janitor: asyncio.Task[None] | None = None
        self._closed = False
        self._on_change = on_change or (lambda: None)
        self._busy = busy or (lambda: False)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0), trust_env=False,
                                       limits=httpx.Limits(max_keepalive_connections=0))
        self.stats = {"taken": 0, "missed": 0, "filled": 0, "discarded": 0, "fill_failures": 0}

    # --- what the backend calls --------------------------------------------------------------

    def start(self) -> None:
        self.manifest_dir.mkdir(parents=True, exist_ok=True)
        if self._janitor is None:
            self._janitor = asyncio.create_task(self._janitor_loop(), name="ready-pool-janitor")

    def want(self, key: str, record: Any, *, pinned: bool = False,
             guest_token: str | None = None, warm_port: int | None = None) -> None:
        """Keep VMs of `record` ready under `key` (its snapshot directory); called for the
        pinned templates at start and by every create (a use makes a template hot).
        `warm_port`: see _Pool."""
        if self._closed or not self.config.enabled:
            return
        pool = self._pools.get(key)
        if pool is None:
            pool = _Pool(key, record, pinned, self.config.low, guest_token, warm_port)
            self._pools[key] = pool
            self._evict_beyond_limit()
            log.info("ready pool added", extra={"pool": key, "target": pool.target,
                                                "pinned": pinned})
        pool.pinned = pool.pinned or pinned
        pool.warm_port = pool.warm_port or warm_port
        pool.last_used = time.monotonic()
        self._kick(pool)

    def take(self, key: str) -> Any | None:
        """A running, warmed VM of `key`'s snapshot, now owned by the caller; None when the
        pool is empty. No `await` here: a VM goes to exactly one caller."""
        pool = self._pools.get(key)
        if pool is None:
            return None
        vm = None
        while pool.ready:
            candidate = pool.ready.popleft()
            if candidate.state == "running" and not candidate.process.died.is_set():
                vm = candidate
                break
            self._discard(candidate, "died while parked")
        now = time.monotonic()
        pool.last_used = now
        pool.last_take = now
        if vm is None:
            self.stats["missed"] += 1
        else:
            self.stats["taken"] += 1
        if not pool.ready:  # a burst emptied it: keep more ready next time
            pool.target = min(max(self.config.high, self.config.low), max(1, pool.target * 2))
        self._kick(pool)
        return vm

    def handed_over(self, vm: Any) -> None:
        """The caller made `vm` a sandbox (its own manifest is written): forget the pool's."""
        self._manifest(vm).unlink(missing_ok=True)

    def vm_died(self, vm: Any) -> None:
        """The runtime saw a VM's QEMU exit on its own: if it was parked here, discard it."""
        for pool in self._pools.values():
            if vm in pool.ready:
                pool.ready.remove(vm)
                self._discard(vm, f"died while parked: {vm.error}")
                self._kick(pool)
                return

    async def drop(self, key: str) -> None:
        """The template behind `key` was deleted or rebuilt: end its pool and its VMs."""
        pool = self._pools.pop(key, None)
        if pool is None:
            return
        await self._end_pool(pool)
        log.info("ready pool dropped", extra={"pool": key})

    def count(self, key: str | None = None) -> int:
        """VMs parked (in `key`'s pool, or in all pools)."""
        pools = [self._pools[key]] if key in self._pools else [] if key else self._pools.values()
        return sum(len(p.ready) for p in pools)

    def vms(self) -> list[Any]:
        """Every VM the pools hold (parked)."""
        return [vm for p in self._pools.values() for vm in p.ready]

    def pooled_keys(self) -> list[str]:
        return list(self._pools)

    def target(self, key: str) -> int:
        pool = self._pools.get(key)
        return pool.target if pool else 0

    async def wait_ready(self, key: str, count: int, timeout: float) -> bool:
        """Wait until `key`'s pool holds `count` VMs (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self.count(key) < count:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def close(self) -> None:
        """Stop filling and kill every parked VM (a graceful stop: they are not sandboxes)."""
        self._closed = True
        if self._janitor is not None:
            self._janitor.cancel()
            with contextlib.suppress(BaseException):
                await self._janitor
            self._janitor = None
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await self._end_pool(pool)
        while self._cleanup:
            await asyncio.gather(*list(self._cleanup), return_exceptions=True)
        await self._http.aclose()

    # --- filling -----------------------------------------------------------------------------

    def _kick(self, pool: _Pool) -> None:
        if self._closed or pool.dropped:
            return
        if len(pool.ready) + pool.filling >= pool.target:
            return
        if pool.task is None or pool.task.done():
            pool.task = asyncio.create_task(self._fill(pool), name=f"ready-pool-fill:{pool.key}")

    async def _fill(self, pool: _Pool) -> None:
        while not (self._closed or pool.dropped) and len(pool.ready) < pool.target:
            if self.config.min_free_mib and _mem_available_mib() < self.config.min_free_mib:
                await asyncio.sleep(2.0)  # the host is short of memory: sandboxes go first
                continue
            # Creates first: a restore started while one is under way takes CPU from it (on
            # 2 cores, a pooled create's /init went from ~50 to ~160 ms). Under a saturating
            # stream of creates the pool cannot keep up anyway, and a pooled VM costs more
            # CPU than a plain restore (the warm-up), so the fill waits for a gap (2 s
            # runs with pool ready lowered sustained creates/s by ~13 %).
            waited = 0.0
            while self._busy() and waited < MAX_YIELD_SECONDS:
                await asyncio.sleep(0.02)
                waited += 0.02
            async with self._fill_lock:
                if self._closed or pool.dropped or len(pool.ready) >= pool.target:
                    return
                pool.filling += 1
                try:
                    vm = await self._make(pool)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    vm = None
                    pool.failures += 1
                    self.stats["fill_failures"] += 1
                    log.warning("ready pool fill failed",
                                extra={"pool": pool.key, "error": str(exc),
                                       "failures": pool.failures})
                finally:
                    pool.filling -= 1
            if vm is None:
                # Back off (1, 2, 4 ... 60 s): a broken snapshot must not eat the host's CPU.
                await asyncio.sleep(min(60.0, 2.0 ** min(pool.failures - 1, 6)))
                continue
            pool.failures = 0
            if self._closed or pool.dropped or vm.state != "running":
                self._discard(vm, "pool ended while it was made")
                continue
            pool.ready.append(vm)
            self.stats["filled"] += 1
            self._on_change()

    async def _make(self, pool: _Pool) -> Any:
        t0 = time.perf_counter()
        vm = await self.runtime.restore(pool.record, guest_token=pool.guest_token)
        t1 = time.perf_counter()
        try:
            self._write_manifest(vm)
            await self._warm(vm, pool.guest_token, pool.warm_port)
        except BaseException:
            self._discard(vm, "warming failed")
            raise
        vm.timings["pool_restore_ms"] = (t1 - t0) * 1e3
        vm.timings["pool_warm_ms"] = (time.perf_counter() - t1) * 1e3
        log.info("ready pool VM parked", extra={
            "pool": pool.key, "vm": vm.id, "restore_ms": round((t1 - t0) * 1e3, 1),
            "warm_ms": round(vm.timings["pool_warm_ms"], 1)})
        return vm

    async def _warm(self, vm: Any, guest_token: str | None, warm_port: int | None) -> None:
        """Requests shaped like a sandbox's first ones, so TCG has translated their paths and
        the restored memory they touch is faulted in: `/health`, a filesystem RPC, a command
        start (`bash -l -c true`, as the SDK starts commands; no trace left, envd forgets
        ended processes), `POST /aenv/warm` on `warm_port` if the pool has one (the code
        interpreter: a first run_code in a pooled VM was ~0.5 s slower than the next, where
        envd's first command was not) and another `/init` (nothing but the clock). A
        template's envd holds no access token; a snapshot of a secure sandbox holds that
        sandbox's (`guest_token`)."""
        # Every answer is read within envd_client's bounds: a snapshot's guest may have put
        # a server of its own on envd's port before it was snapshotted.
        envd = EnvdClient(vm.envd_url, access_token=guest_token, http=self._http)
        await envd.health()
        await envd.stat("/")
        await envd.run("/bin/bash", ["-l", "-c", "true"], timeout=WARM_TIMEOUT)
        if warm_port is not None:
            guest = vm.envd_url.rsplit(":", 1)[0]
            # the code-interpreter server takes envd's token (guest/codeint/app.py)
            answer = await read_reply(self._http, "POST", f"{guest}:{warm_port}/aenv/warm",
                                      what="the code interpreter's /aenv/warm",
                                      timeout=WARM_TIMEOUT,
                                      headers={"X-Access-Token": guest_token} if guest_token
                                      else None)
            if not answer.is_success:
                raise EnvdClientError(f"the code interpreter's /aenv/warm answered "
                                      f"{answer.status_code}")
        await self.runtime.envd_init(vm, guest_token=guest_token)

    # --- ending VMs and pools ----------------------------------------------------------------

    def _manifest(self, vm: Any) -> Path:
        return self.manifest_dir / f"{vm.id}.vm.json"

    def _write_manifest(self, vm: Any) -> None:
        atomic_write_json(self._manifest(vm), vm_manifest(vm))

    def _discard(self, vm: Any, reason: str) -> None:
        self.stats["discarded"] += 1
        log.info("ready pool VM discarded", extra={"vm": vm.id, "reason": reason})
        task = asyncio.create_task(self._kill(vm))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def _kill(self, vm: Any) -> None:
        try:
            await self.runtime.kill(vm)
        except Exception as exc:
            log.warning("ending a pooled VM failed", extra={"vm": vm.id, "error": str(exc)})
        self._manifest(vm).unlink(missing_ok=True)

    async def _end_pool(self, pool: _Pool) -> None:
        pool.dropped = True
        if pool.task is not None and not pool.task.done():
            pool.task.cancel()
            with contextlib.suppress(BaseException):
                await pool.task
        while pool.ready:
            vm = pool.ready.popleft()
            self.stats["discarded"] += 1
            await self._kill(vm)

    def _evict_beyond_limit(self) -> None:
        while len(self._pools) > self.config.max_templates:
            unpinned = [p for p in self._pools.values() if not p.pinned]
            if not unpinned:
                return
            oldest = min(unpinned, key=lambda p: p.last_used)
            self._pools.pop(oldest.key, None)
            self._spawn_end(oldest, "evicted (least recently used)")

    def _spawn_end(self, pool: _Pool, reason: str) -> None:
        log.info("ready pool dropped", extra={"pool": pool.key, "reason": reason})
        task = asyncio.create_task(self._end_pool(pool))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def _janitor_loop(self) -> None:
        """Every few seconds: drop idle or vanished templates' pools, shrink grown ones,
        discard dead VMs, and restart fills that stopped."""
        while True:
            await asyncio.sleep(2.0)
            now = time.monotonic()
            for pool in list(self._pools.values()):
                if not Path(pool.key).is_dir() or (Path(pool.key) / ".released").exists():
                    self._pools.pop(pool.key, None)
                    self._spawn_end(pool, "snapshot gone")
                    continue
                if not pool.pinned and now - pool.last_used > self.config.idle_seconds:
                    self._pools.pop(pool.key, None)
                    self._spawn_end(pool, "idle")
                    continue
                if pool.target > self.config.low and now - pool.last_take > \
                        self.config.decay_seconds:
                    pool.target = self.config.low
                    while len(pool.ready) > pool.target:
                        self._discard(pool.ready.pop(), "pool shrank")
                for vm in [v for v in pool.ready if v.process.died.is_set()]:
                    pool.ready.remove(vm)
                    self._discard(vm, "died while parked")
                self._kick(pool)
