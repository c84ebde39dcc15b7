"""A scripted sandbox backend for in-process tests of the node's state machine.

It implements the backend protocol (node/backend.py) over plain dictionaries: `running` are the
"VMs", `snapshots` the snapshot data "on disk". A test scripts what the next call of an
operation does: fail before its effect (`fail`), fail after it (`fail(..., after=True)`, e.g. a
pause whose snapshot is written), let the node process die there (`crash`), or wait until the
test lets it go on (`hold`), so transitional states can be looked at. Faults the real backends
produce only by chance (a VM dying mid-pause, a node killed between snapshot and record) are
what this is for; everything else in these tests is the real node code.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from agentenv.node.backend import (
    BackendError,
    DefaultTemplate,
    ForkOutcome,
    MetricSample,
    PauseResult,
    Placement,
    SandboxSpec,
    SnapshotRef,
    TemplateRef,
)


class Crash(BaseException):
    """The node process dies here (as with kill -9): nothing after this point of it runs."""


@dataclass
class Hold:
    """A call stopped at its start: `entered` once it got there; `release()` lets it go on."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event = field(default_factory=asyncio.Event)

    def release(self) -> None:
        self.gate.set()


@dataclass
class _Fault:
    error: BaseException
    after: bool


BASE = DefaultTemplate("base", TemplateRef("template", {"builtin": True}, ("layer-base",)),
                       cpu_count=1, memory_mb=256, disk_size_mb=1024, envd_version="0.5.7")


class ScriptedBackend:
    """Backend protocol + the optional crash-recovery hooks the VM backend has."""

    name = "scripted"
    enforces_network_policy = False

    def __init__(self, envd: tuple[str, int] = ("127.0.0.1", 9)) -> None:
        """`envd`: where every sandbox's envd (and every other port) is said to listen."""
        self.envd_host, self.envd_port = envd
        #: True: create/resume/fork return after their own /init (the node skips its own)
        self.initialises_envd = True
        self.running: dict[str, Placement] = {}
        self.snapshots: dict[str, SnapshotRef] = {}
        #: the pause snapshot written for a sandbox, as recover_pause finds it on disk
        self.pause_written: dict[str, PauseResult] = {}
        #: children (by position) a fork fails to start, with the reason
        self.fork_child_errors: dict[int, str] = {}
        self.adopt_failures: dict[str, str] = {}
        #: the envd token each rollback's new "VM" was given
        self.rolled_back_tokens: dict[str, str | None] = {}
        self.on_sandbox_lost: Callable[[str, str], None] | None = None
        #: called when a scripted crash happens: the test stops the node's writes there
        self.on_crash: Callable[[], None] = lambda: None
        self.calls: list[tuple[str, str]] = []
        self._faults: dict[str, list[_Fault]] = defaultdict(list)
        self._holds: dict[str, Hold] = {}
        self._ids = itertools.count(1)

    # --- scripting ---------------------------------------------------------------------------

    def fail(self, op: str, *, retryable: bool = True, unavailable: bool = False,
             after: bool = False) -> None:
        """The next call of `op` raises BackendError (before its effect, or `after` it)."""
        error = BackendError(f"scripted {op} failure", retryable=retryable,
                             unavailable=unavailable)
        self._faults[op].append(_Fault(error, after))

    def crash(self, op: str, *, after: bool = True) -> None:
        """The node dies during the next call of `op` (by default once its effect is done)."""
        self._faults[op].append(_Fault(Crash(op), after))

    def hold(self, op: str) -> Hold:
        held = self._holds[op] = Hold()
        return held

    def called(self, op: str) -> list[str]:
        return [sid for name, sid in self.calls if name == op]

    async def _enter(self, op: str, sid: str) -> _Fault | None:
        self.calls.append((op, sid))
        held = self._holds.pop(op, None)
        if held is not None:
            held.entered.set()
            await held.gate.wait()
        fault = self._faults[op].pop(0) if self._faults[op] else None
        if fault is not None and not fault.after:
            self._raise(fault)
        return fault

    def _leave(self, fault: _Fault | None) -> None:
        if fault is not None:
            self._raise(fault)

    def _raise(self, fault: _Fault) -> None:
        if isinstance(fault.error, Crash):
            self.on_crash()
        raise fault.error

    def _placement(self, sid: str) -> Placement:
        return Placement(self.envd_host, self.envd_port, {"vm": sid}, "0.5.7")

    def _snapshot(self, sid: str, kind: str) -> SnapshotRef:
        key = f"{kind}-{sid}-{next(self._ids)}"
        ref = TemplateRef("snapshot", {"key": key}, (f"layer-{key}",))
        self.snapshots[key] = ref
        return ref

    # --- the protocol ------------------------------------------------------------------------

    async def start(self) -> None:
        self.calls.append(("start", ""))

    async def close(self) -> None:
        self.calls.append(("close", ""))

    async def default_templates(self) -> list[DefaultTemplate]:
        return [BASE]

    async def create(self, spec: SandboxSpec) -> Placement:
        fault = await self._enter("create", spec.sandbox_id)
        self.running[spec.sandbox_id] = placement = self._placement(spec.sandbox_id)
        self._leave(fault)  # after: a VM is left behind for the node to kill
        return placement

    async def pause(self, sandbox_id: str, placement: Placement, memory: bool) -> PauseResult:
        try:
            fault = await self._enter("pause", sandbox_id)
        except BackendError as exc:
            if not exc.retryable:
                self.running.pop(sandbox_id, None)
            raise
        self.running.pop(sandbox_id, None)
        result = PauseResult(self._snapshot(sandbox_id, "pause"), memory)
        self.pause_written[sandbox_id] = result
        self._leave(fault)
        return result

    async def resume(self, spec: SandboxSpec, snapshot: SnapshotRef,
                     memory: bool = True) -> Placement:
        await self._enter("resume", spec.sandbox_id)
        if snapshot.data["key"] not in self.snapshots:
            raise BackendError(f"snapshot {snapshot.data['key']} is gone", retryable=False)
        self.pause_written.pop(spec.sandbox_id, None)
        self.running[spec.sandbox_id] = placement = self._placement(spec.sandbox_id)
        return placement

    async def snapshot(self, sandbox_id: str, placement: Placement,
                       snapshot_id: str) -> SnapshotRef:
        try:
            fault = await self._enter("snapshot", sandbox_id)
        except BackendError as exc:
            if not exc.retryable:
                self.running.pop(sandbox_id, None)
            raise
        ref = self._snapshot(sandbox_id, snapshot_id)
        self._leave(fault)
        return ref

    async def fork(self, spec: SandboxSpec, placement: Placement,
                   children: list[SandboxSpec]) -> list[ForkOutcome]:
        try:
            await self._enter("fork", spec.sandbox_id)
        except BackendError as exc:
            if not exc.retryable:
                self.running.pop(spec.sandbox_id, None)
            raise
        out = []
        for index, child in enumerate(children):
            error = self.fork_child_errors.get(index)
            if error is not None:
                out.append(ForkOutcome(child.sandbox_id, error=error))
                continue
            self.running[child.sandbox_id] = self._placement(child.sandbox_id)
            out.append(ForkOutcome(child.sandbox_id, self.running[child.sandbox_id]))
        return out

    # --- optional: snapshot branching (fork of a paused sandbox, rollback) --------------------

    async def fork_snapshot(self, snapshot: SnapshotRef,
                            children: list[SandboxSpec]) -> list[ForkOutcome]:
        await self._enter("fork_snapshot", str(snapshot.data["key"]))
        if snapshot.data["key"] not in self.snapshots:
            raise BackendError(f"snapshot {snapshot.data['key']} is gone", retryable=False)
        for child in children:
            self.running[child.sandbox_id] = self._placement(child.sandbox_id)
        return [ForkOutcome(c.sandbox_id, self.running[c.sandbox_id]) for c in children]

    async def rollback(self, spec: SandboxSpec, placement: Placement | None,
                       snapshot: SnapshotRef) -> Placement:
        """A new "VM" (another placement) from the snapshot; a failure leaves the old one."""
        if snapshot.data["key"] not in self.snapshots:
            raise BackendError(f"snapshot {snapshot.data['key']} is gone")
        fault = await self._enter("rollback", spec.sandbox_id)
        self.rolled_back_tokens[spec.sandbox_id] = spec.access_token
        self.running[spec.sandbox_id] = new = Placement(
            self.envd_host, self.envd_port, {"vm": spec.sandbox_id,
                                             "vm_id": f"{spec.sandbox_id}-{next(self._ids)}"},
            "0.5.7")
        self._leave(fault)  # after: the new VM runs, the node did not record it
        return new

    async def release_snapshots(self, sandbox_id: str, keep: list[SnapshotRef]) -> None:
        """Releases the sandbox's pauses (this backend owns no fork points) not in `keep`."""
        kept = {str(ref.data.get("key")) for ref in keep}
        for key in [k for k in self.snapshots if k.startswith(f"pause-{sandbox_id}-")]:
            if key not in kept:
                await self._enter("release", key)
                self.snapshots.pop(key, None)

    async def kill(self, sandbox_id: str, placement: Placement | None) -> None:
        await self._enter("kill", sandbox_id)
        self.running.pop(sandbox_id, None)

    async def delete_snapshot(self, ref: SnapshotRef) -> None:
        await self._enter("delete_snapshot", str(ref.data.get("key")))
        self.snapshots.pop(str(ref.data.get("key")), None)

    async def discard_paused(self, sandbox_id: str, snapshot: SnapshotRef) -> None:
        await self._enter("discard_paused", sandbox_id)
        self.snapshots.pop(snapshot.data["key"], None)
        self.pause_written.pop(sandbox_id, None)

    async def adopt(self) -> dict[str, Placement]:
        self.calls.append(("adopt", ""))
        return dict(self.running)

    async def metrics(self, sandbox_id: str, placement: Placement) -> MetricSample:
        await self._enter("metrics", sandbox_id)
        return MetricSample(0.0, 1, 1.0, 1 << 20, 256 << 20, 0, 1 << 20, 1 << 30)

    # --- optional: crash recovery ------------------------------------------------------------

    async def recover_pause(self, sandbox_id: str, placement: Placement,
                            since: float) -> PauseResult | None:
        self.calls.append(("recover_pause", sandbox_id))
        result = self.pause_written.get(sandbox_id)
        if result is None or result.snapshot.data["key"] not in self.snapshots:
            return None
        return result

    def lose(self, sandbox_id: str) -> None:
        """The sandbox's VM dies on its own: the backend tells the node, as the VM one does."""
        self.running.pop(sandbox_id, None)
        if self.on_sandbox_lost is not None:
            self.on_sandbox_lost(sandbox_id, "scripted: the VM died")
