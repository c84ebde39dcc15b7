"""What a starting node makes of the last run (node/orchestrator.py runs it at start).

- Running sandboxes are re-adopted from the backend after a SIGKILL; records the backend no
  longer runs are removed, VMs no record names are killed.
- A pause is recorded as pending (store.pending_ops) before the backend writes its snapshot;
  a node killed between that write and the paused record finds the snapshot again here through
  the backend's optional `recover_pause(sandbox_id, placement, since)`: complete on disk -> the
  sandbox is paused with it; none -> the VM, if it still runs, is adopted, else the sandbox is
  gone (its half-written files are garbage for node/gc.py).
- A rollback cut short: whichever VM runs decides which envd token the sandbox has.
- Adopted sandboxes get their network policies again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from agentenv.node.backend import BackendError, Capabilities, Placement, SandboxBackend, SandboxSpec
from agentenv.node.operations import log
from agentenv.node.records import SandboxRecord, State
from agentenv.node.store import PendingOp, Store


def _same_vm(live: Placement, recorded: Placement | None) -> bool:
    """Whether an adopted VM is the one the record names (backends name VMs by `vm_id`)."""
    return recorded is not None and live.handle.get("vm_id") == recorded.handle.get("vm_id")


class Recovery:
    """Fills `sandboxes` (the orchestrator's records, empty at start) from the store and what
    the backend still runs."""

    def __init__(self, store: Store, backend: SandboxBackend, capabilities: Capabilities,
                 sandboxes: dict[str, SandboxRecord],
                 spec: Callable[[SandboxRecord], SandboxSpec]) -> None:
        self.store = store
        self.backend = backend
        self.capabilities = capabilities
        self.sandboxes = sandboxes
        self._spec = spec

    async def reconcile(self) -> None:
        """Match the records of the last run with what the backend still runs."""
        records = await self.store.load_sandboxes()
        pending = await self.store.load_pending()
        adopted = await self.backend.adopt()
        #: why the backend could not take a VM over (e.g. blockd restarted under it)
        recovery = self.capabilities.crash_recovery
        failures: dict[str, str] = dict(recovery.adopt_failures) if recovery else {}
        known = {rec.sandbox_id for rec in records}
        for rec in records:
            sid = rec.sandbox_id
            op = pending.pop(sid, None)
            if op is not None:
                await self.store.delete_pending(sid)
            if rec.state == State.PAUSED:
                self.sandboxes[sid] = rec
                continue
            live = adopted.get(sid)
            if live is not None and rec.state not in (State.CREATING, State.KILLING):
                if rec.state == State.ROLLING_BACK and op is not None and op.op == "rollback" \
                        and not _same_vm(live, rec.placement):
                    # The rollback's VM was up (it holds the new token): the rollback is done.
                    rec.envd_access_token = str(op.doc["token"])
                # Also a pause cut short before its snapshot was complete: the VM goes on.
                rec.state, rec.placement, rec.pause_snapshot = State.RUNNING, live, None
                self.sandboxes[sid] = rec
                await self.store.put_sandbox(rec)
                log.info("adopted running sandbox", extra={"sandbox_id": sid})
            elif live is None and rec.state == State.PAUSING and await self._recover_pause(rec, op):
                log.info("pause completed after a node crash", extra={"sandbox_id": sid})
            elif live is None and rec.state in (State.RESUMING, State.ROLLING_BACK) \
                    and rec.pause_snapshot:
                rec.state, rec.placement = State.PAUSED, None
                self.sandboxes[sid] = rec
                await self.store.put_sandbox(rec)
            else:
                log.warning(
                    "sandbox lost across node restart",
                    extra={
                        "sandbox_id": sid,
                        "last_state": rec.state.value,
                        "reason": failures.get(sid)
                        or ("its VM no longer runs" if live is None else "it was being "
                            f"{'created' if rec.state == State.CREATING else 'killed'}"),
                    },
                )
                with contextlib.suppress(BackendError):
                    await self.backend.kill(sid, live)
                await self.store.delete_sandbox(sid)
                await self.store.set_layer_refs("sandbox", sid, [])
        for sid, placement in adopted.items():
            if sid not in known:
                log.warning("killing orphan sandbox", extra={"sandbox_id": sid})
                with contextlib.suppress(BackendError):
                    await self.backend.kill(sid, placement)
        for sid in pending:  # pending operations of sandboxes without a record
            await self.store.delete_pending(sid)

    async def reapply_network(self) -> None:
        """Adopted sandboxes get their policies again (their slots kept their own rules; the
        host's redirect sets and an adopted egress proxy's table kept theirs meanwhile, a
        restarted proxy starts empty); then the backend drops what no sandbox holds."""
        network = self.capabilities.network
        if network is None:
            return
        for rec in list(self.sandboxes.values()):
            if rec.state != State.RUNNING or rec.placement is None:
                continue
            spec = self._spec(rec)
            try:
                await network.set_network(rec.sandbox_id, rec.placement, spec.egress,
                                          spec.identity)
            except BackendError as exc:
                log.error("network policy not re-applied to an adopted sandbox",
                          extra={"sandbox_id": rec.sandbox_id, "error": str(exc)})
        await network.network_reapplied()

    async def _recover_pause(self, rec: SandboxRecord, op: PendingOp | None) -> bool:
        """A node killed while pausing `rec`: if the backend wrote the pause snapshot in full,
        the sandbox is paused with it (nothing is lost); False when there is none."""
        recovery = self.capabilities.crash_recovery
        if op is None or op.op != "pause" or recovery is None or rec.placement is None:
            return False
        try:
            result = await recovery.recover_pause(rec.sandbox_id, rec.placement, op.started_at)
        except Exception as exc:
            log.warning("pause snapshot not recovered",
                        extra={"sandbox_id": rec.sandbox_id, "error": str(exc)})
            return False
        if result is None:
            return False
        rec.placement = None
        rec.pause_snapshot = result.snapshot
        rec.pause_mode = "full" if result.memory else "filesystem"
        rec.pause_asked_memory = bool(op.doc.get("memory", True))
        rec.pause_reason = str(op.doc.get("reason", "request"))
        rec.last_pause = result.snapshot
        rec.state = State.PAUSED
        self.sandboxes[rec.sandbox_id] = rec
        await self.store.finish_pause(rec, [*rec.source.layers, *result.snapshot.layers])
        return True
