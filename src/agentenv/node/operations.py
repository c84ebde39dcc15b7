"""One operation per sandbox at a time, and the states a call waits through (node/orchestrator.py).

- At most one operation per sandbox runs at a time (`running`). A call that finds the sandbox
  in a transitional state waits for that operation and looks again (`await_state`), joins it
  (kill joins kill), or gets 409, as docs/e2b-api.md §4 says.
- Every operation runs in its own task and the caller awaits it through `asyncio.shield`
  (`launch`): a client that disconnects never leaves a sandbox half paused or half created.
- The garbage collector holds operations that start while it marks and sweeps (`held`).

Also the small helpers the orchestrator's collaborators share: the answer to a backend failure,
an event's reason and execution, the log of an operation the node began itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from typing import Any, TypeVar

from agentenv.api.errors import (
    ApiError,
    BadRequest,
    Conflict,
    Internal,
    Unavailable,
    sandbox_not_found,
)
from agentenv.api.models import iso
from agentenv.node.backend import BackendError
from agentenv.node.idle import IDLE_REASON
from agentenv.node.records import SandboxRecord, State

#: the orchestrator's logger: its collaborators (this module's siblings) log under it too
log = logging.getLogger("agentenv.node.orchestrator")
T = TypeVar("T")

#: How long a call waits for another operation on the same sandbox before giving up with 409.
WAIT_TRANSITION_SECONDS = 60.0

STABLE = frozenset({State.RUNNING, State.PAUSED})


def unless_idle(refusal: Callable[[SandboxRecord], ApiError]
                ) -> Callable[[SandboxRecord], ApiError | None]:
    """`refusal`, except for a sandbox being paused for idleness: running as far as the
    caller knows, so the call waits for the pause and goes on (await_state)."""
    return lambda rec: None if rec.pause_reason == IDLE_REASON else refusal(rec)


def gone(rec: SandboxRecord) -> ApiError:
    """404, as E2B answers for a sandbox this call cannot act on (paused, being killed)."""
    return sandbox_not_found(rec.sandbox_id)


class Operations:
    """The operations under way on the node's sandboxes (`sandboxes`, the orchestrator's
    records) and the work it runs beside its callers (`background`)."""

    def __init__(self, sandboxes: dict[str, SandboxRecord],
                 on_op: Callable[[str, str, float], None]) -> None:
        self.sandboxes = sandboxes
        #: sandbox id -> the task of its one operation under way
        self.running: dict[str, asyncio.Task[Any]] = {}
        #: cleared while the garbage collector marks and sweeps (held): an operation
        #: starting then waits, so it never writes a snapshot the pass did not see
        self._allowed = asyncio.Event()
        self._allowed.set()
        #: work run beside the callers (in_background); shutdown waits for it
        self.background: set[asyncio.Task[Any]] = set()
        self._on_op = on_op

    def get(self, sandbox_id: str) -> SandboxRecord:
        rec = self.sandboxes.get(sandbox_id)
        if rec is None:
            raise sandbox_not_found(sandbox_id)
        return rec

    def in_background(self, work: Awaitable[Any]) -> None:
        """Run `work` beside the callers; shutdown waits for it."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def launch(self, sandbox_id: str, op: str, work: Awaitable[T]) -> T:
        """Run `work` as this sandbox's one operation; the caller may go away, the work won't."""
        return await asyncio.shield(self.start(sandbox_id, op, work))

    def start(self, sandbox_id: str, op: str, work: Awaitable[T]) -> asyncio.Task[T]:
        """Register `work` as the sandbox's operation at once (no await), so nobody ever sees a
        transitional state without the task that will end it."""

        async def timed() -> T:
            began = time.monotonic()
            outcome = "error"
            try:
                await self._allowed.wait()  # at once, unless a GC pass is sweeping
                result = await work
                outcome = "ok"
                return result
            finally:
                self._on_op(op, outcome, time.monotonic() - began)

        task = asyncio.create_task(timed(), name=f"{op}:{sandbox_id}")
        self.running[sandbox_id] = task

        def done(t: asyncio.Task[Any]) -> None:
            if self.running.get(sandbox_id) is t:
                del self.running[sandbox_id]
            if not t.cancelled():
                t.exception()  # consumed here so an abandoned task logs nothing spurious

        task.add_done_callback(done)
        return task

    async def wait(self, sandbox_id: str, state: State) -> None:
        task = self.running.get(sandbox_id)
        if task is None:
            # a transitional state without a task cannot happen; never spin on it
            raise Conflict(f"sandbox {sandbox_id!r} is stuck in '{state.value}' state")
        done, _ = await asyncio.wait({task}, timeout=WAIT_TRANSITION_SECONDS)
        if not done:
            raise Conflict(f"sandbox {sandbox_id!r} stayed in '{state.value}' state too long")

    async def await_state(
        self, sandbox_id: str, proceed: Collection[State],
        refuse: Mapping[State, Callable[[SandboxRecord], ApiError | None]] | None = None,
    ) -> SandboxRecord:
        """The record once its state is in `proceed`; in a state of `refuse`, that error (None:
        wait after all); in any other (another operation under way), wait for that operation
        and look again."""
        while True:
            rec = self.get(sandbox_id)
            if rec.state in proceed:
                return rec
            error = refuse[rec.state](rec) if refuse and rec.state in refuse else None
            if error is not None:
                raise error
            await self.wait(sandbox_id, rec.state)

    async def wait_idle(self, timeout: float) -> None:
        """Return once no operation is under way (each may be writing files no record names
        yet), or after about `timeout` seconds on a node too busy ever to be idle."""
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            await asyncio.wait(list(self.running.values()), timeout=1.0)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """While this lasts, operations that start wait before they do anything (the garbage
        collector's pass: a pause begun between its marks and its sweep wrote a snapshot
        directory no mark named, deleted under it with a zero grace period)."""
        self._allowed.clear()
        try:
            yield
        finally:
            self._allowed.set()


def backend_failure(message: str, exc: BackendError) -> ApiError:
    """503 when the host cannot serve right now (blockd down: retry later), 400 when the
    sandbox's source cannot do what was asked, else 500."""
    if getattr(exc, "unavailable", False):
        return Unavailable(message)
    return BadRequest(message) if getattr(exc, "bad_request", False) else Internal(message)


def failure_reason(exc: BaseException) -> str:
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else str(exc) or type(exc).__name__


def execution(rec: SandboxRecord) -> dict[str, Any]:
    """E2B's eventData.execution of a paused or killed sandbox: the run that just ended."""
    return {"started_at": iso(rec.started_at), "vcpu_count": rec.cpu_count,
            "memory_mb": rec.memory_mb,
            "execution_time": int((time.time() - rec.started_at) * 1000)}


async def log_reap(sandbox_id: str, work: Awaitable[None], done: str) -> None:
    """Await an operation the node began itself (a timeout, an idle pause, a lost sandbox):
    `done` logged when it is over, a failure logged instead of raised."""
    try:
        await work
        log.info(done, extra={"sandbox_id": sandbox_id})
    except Exception as exc:
        log.error(
            "timeout handling failed", extra={"sandbox_id": sandbox_id, "error": str(exc)}
        )
