"""Trajectories for RL training loops, over the official e2b `AsyncSandbox` (issue 27).

A training loop sets an environment up once, checkpoints it, branches N trajectories from the
checkpoint, steps each, branches again at interesting states and resets. `RolloutPool` does the
sandbox side of that with bounded concurrency; a `Trajectory` is one sandbox:

    async with RolloutPool(template="base", concurrency=16) as pool:
        root = await pool.create()
        await root.step("pip install -e .")
        # The policy thinks: after `idle_pause_after` seconds (30) without a step the node
        # pauses the VM itself, and the next step resumes it (node/idle.py). Or explicitly:
        await root.pause()
        branches = await root.branch(8)         # from the paused checkpoint; root stays paused
        results = await pool.map(lambda t: t.step("python rollout.py"), branches)
        await branches[0].rollback()            # back to its last pause, in place

It is a thin convenience over the E2B API, not a second client: every call is the SDK's
(`create`, `commands.run`, `files.write`, `pause`, `connect`, the class `fork`, `kill`), except
rollback, an AgentENV extension (`POST /sandboxes/{id}/rollback`) sent with httpx to the same
API URL and key, after which the SDK's `connect` gives the re-keyed sandbox. The SDK retries
429/503 a few times itself; the pool retries a refused create, fork or resume again with
backoff (`retries`, `backoff`), which is what a node full for a moment needs.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from agentenv.node.idle import IDLE_PAUSE_METADATA

T = TypeVar("T")

#: exception class names of the SDK that mean "not now": the node is full or busy
_RETRYABLE = ("RateLimitException", "ServiceBusyException")


class RolloutError(Exception):
    """A lifecycle call of the pool failed (its message names the call and the cause)."""


@dataclass(frozen=True)
class RolloutConfig:
    template: str = "base"
    #: at most this many lifecycle calls at once (creates, forks, resumes, rollbacks)
    concurrency: int = 8
    #: each sandbox's time to live (seconds), renewed by resume and rollback
    timeout: int = 300
    #: attempts after a 429/503 beyond the SDK's own, and the first wait (doubled each time)
    retries: int = 5
    backoff: float = 0.5
    #: seconds a trajectory may go without a step before the node pauses it (memory kept;
    #: the next step resumes it transparently): a policy's thinking time holds no host
    #: memory. Sent as the metadata key aenv.idlePauseAfter (the SDK has no field for it);
    #: branches inherit it. 0: never; None: the template's or node's default.
    idle_pause_after: int | None = 30
    #: the node or gateway (else E2B_API_URL); sandbox traffic goes to `sandbox_url` (else
    #: E2B_SANDBOX_URL, else the API URL: an AgentENV node or gateway serves both)
    api_url: str | None = None
    api_key: str | None = None
    sandbox_url: str | None = None


class Trajectory:
    """One sandbox of the pool: step it, pause it while the policy thinks, branch, roll back."""

    def __init__(self, pool: RolloutPool, sandbox: Any) -> None:
        self.pool = pool
        #: the SDK's AsyncSandbox; replaced by resume and rollback (a new envd token)
        self.sandbox = sandbox

    @property
    def sandbox_id(self) -> str:
        return str(self.sandbox.sandbox_id)

    async def step(self, command: str, **kwargs: Any) -> Any:
        """Run a command (the SDK's commands.run) and return its result."""
        return await self.sandbox.commands.run(command, **kwargs)

    async def write(self, path: str, data: str | bytes) -> None:
        await self.sandbox.files.write(path, data)

    async def read(self, path: str) -> str:
        return str(await self.sandbox.files.read(path))

    async def pause(self) -> None:
        """Pause (memory kept); resume() or branch() continue from here."""
        await self.pool._call(f"pause {self.sandbox_id}", self.sandbox.pause)

    async def resume(self) -> None:
        self.sandbox = await self.pool._call(
            f"resume {self.sandbox_id}",
            lambda: self.pool._sdk().connect(self.sandbox_id, timeout=self.pool.config.timeout,
                                             **self.pool._opts()))

    async def branch(self, count: int) -> list[Trajectory]:
        """`count` new trajectories from this one's current state (running: a checkpoint in
        place; paused: its pause, and it stays paused). A child that failed raises here after
        the others are cleaned up: a training step wants all its branches."""
        results = await self.pool._call(
            f"branch {self.sandbox_id} x{count}",
            lambda: self.pool._sdk().fork(self.sandbox_id, count=count,
                                          timeout=self.pool.config.timeout, **self.pool._opts()))
        made = [self.pool._adopt(r) for r in results if not isinstance(r, BaseException)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(t.close() for t in made), return_exceptions=True)
            raise RolloutError(f"branch of {self.sandbox_id}: {len(failed)} of {count} "
                               f"children failed: {failed[0]}") from failed[0]
        return made

    async def snapshot(self, name: str | None = None) -> str:
        """A named checkpoint of this trajectory (the SDK's create_snapshot); its id."""
        info = await self.pool._call(f"snapshot {self.sandbox_id}",
                                     lambda: self.sandbox.create_snapshot(name=name)
                                     if name else self.sandbox.create_snapshot())
        return str(info.snapshot_id)

    async def rollback(self, snapshot_id: str | None = None) -> None:
        """Back to `snapshot_id` (one of this trajectory's) or to its last pause, in place:
        same sandbox id, a new envd token (the SDK handle is replaced)."""
        body = {"snapshotID": snapshot_id} if snapshot_id else {}
        body["timeout"] = self.pool.config.timeout

        async def call() -> Any:
            answer = await self.pool._http().post(f"/sandboxes/{self.sandbox_id}/rollback",
                                                  json=body)
            if answer.status_code in (429, 503):
                raise _Busy(answer.text)
            if answer.status_code != 200:
                raise RolloutError(f"rollback of {self.sandbox_id}: {answer.status_code} "
                                   f"{answer.text[:300]}")
            return await self.pool._sdk().connect(self.sandbox_id,
                                                  timeout=self.pool.config.timeout,
                                                  **self.pool._opts())

        self.sandbox = await self.pool._call(f"rollback {self.sandbox_id}", call)

    async def close(self) -> None:
        """Kill the sandbox (once); the pool forgets it."""
        self.pool._live.pop(self.sandbox_id, None)
        await self.sandbox.kill()


class _Busy(Exception):
    """A 429/503 of a call the pool makes with httpx."""


class RolloutPool:
    def __init__(self, config: RolloutConfig | None = None, **overrides: Any) -> None:
        base = config or RolloutConfig()
        self.config = RolloutConfig(**{**base.__dict__, **overrides})
        self._limit = asyncio.Semaphore(self.config.concurrency)
        self._live: dict[str, Trajectory] = {}
        self._client: httpx.AsyncClient | None = None
        #: calls retried after a 429/503 (a node full for a moment), for the caller's figures
        self.retried = 0

    async def __aenter__(self) -> RolloutPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Kill every trajectory still alive."""
        await asyncio.gather(*(t.close() for t in list(self._live.values())),
                             return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # --- making trajectories ------------------------------------------------------------------

    async def create(self, template: str | None = None, **kwargs: Any) -> Trajectory:
        """A new trajectory from a template or snapshot (the SDK's AsyncSandbox.create)."""
        chosen = template or self.config.template
        if self.config.idle_pause_after is not None:
            kwargs["metadata"] = {IDLE_PAUSE_METADATA: str(self.config.idle_pause_after),
                                  **(kwargs.get("metadata") or {})}
        sandbox = await self._call(f"create from {chosen}", lambda: self._sdk().create(
            template=chosen, timeout=self.config.timeout, **self._opts(), **kwargs))
        return self._adopt(sandbox)

    async def map(self, work: Callable[[Trajectory], Awaitable[T]],
                  trajectories: Iterable[Trajectory]) -> list[T]:
        """`work` on every trajectory at once, at most `concurrency` at a time."""
        async def bounded(t: Trajectory) -> T:
            async with self._limit:
                return await work(t)

        return list(await asyncio.gather(*(bounded(t) for t in trajectories)))

    @property
    def live(self) -> list[Trajectory]:
        return list(self._live.values())

    # --- plumbing -----------------------------------------------------------------------------

    def _adopt(self, sandbox: Any) -> Trajectory:
        trajectory = Trajectory(self, sandbox)
        self._live[trajectory.sandbox_id] = trajectory
        return trajectory

    @staticmethod
    def _sdk() -> Any:
        from e2b import AsyncSandbox  # the official SDK, a test/extra dependency

        return AsyncSandbox

    def _opts(self) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        url = self.config.api_url or os.environ.get("E2B_API_URL")
        if url:
            opts["api_url"] = url
            # E2B_SANDBOX_URL goes with E2B_API_URL: a pool given its own API URL does not
            # send its sandboxes' traffic where the environment points another API's
            from_env = None if self.config.api_url else os.environ.get("E2B_SANDBOX_URL")
            opts["sandbox_url"] = self.config.sandbox_url or from_env or url
        if self.config.api_key:
            opts["api_key"] = self.config.api_key
        return opts

    def _http(self) -> httpx.AsyncClient:
        """For the extensions the SDK has no call for, to the SDK's API URL with its key."""
        if self._client is None:
            url = self.config.api_url or os.environ.get("E2B_API_URL")
            key = self.config.api_key or os.environ.get("E2B_API_KEY")
            if not url or not key:
                raise RolloutError("rollback needs the API URL and key (api_url/api_key, or "
                                   "E2B_API_URL/E2B_API_KEY)")
            self._client = httpx.AsyncClient(base_url=url, headers={"X-API-KEY": key},
                                             timeout=600, trust_env=False)
        return self._client

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """One lifecycle call within the concurrency bound, retried after a 429/503."""
        delay = self.config.backoff
        for attempt in range(self.config.retries + 1):
            async with self._limit:
                try:
                    return await call()
                except Exception as exc:
                    busy = isinstance(exc, _Busy) or type(exc).__name__ in _RETRYABLE
                    if not busy or attempt == self.config.retries:
                        if isinstance(exc, RolloutError):
                            raise
                        raise RolloutError(f"{what}: {exc}") from exc
            self.retried += 1
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")
