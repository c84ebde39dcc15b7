"""The snapshot store: snapshot directories under <state>/vm-backend/runtime/snapshots/, who owns
them, and when one may go.

A later snapshot names the layer files of the ones it grew from (memory and disk lineages), so
a snapshot directory is only deleted once it is released (killed sandbox, deleted snapshot:
RELEASED_MARK) AND no remaining snapshot names a file in it AND no VM runs from it (collect).
A sandbox's own snapshots (pauses, fork points) are listed in <state>/vm-backend/sandboxes/
<id>.json and released with it."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

from agentenv.fsutil import atomic_write_json
from agentenv.node.backend import BackendError, TemplateRef
from agentenv.node.base_template import snapshot_layers
from agentenv.snapshot.record import SnapshotRecord

log = logging.getLogger("agentenv.node.vm_backend")

RELEASED_MARK = ".released"


def record_dirs(record: SnapshotRecord) -> set[Path]:
    """The snapshot directories a record's files are in (its own and its ancestors')."""
    return {Path(p).parent for p in (*snapshot_layers(record), record.device_state)}


def record_dir(record: SnapshotRecord) -> Path:
    return Path(record.device_state).parent


class SnapshotStore:
    def __init__(self, base: Path) -> None:
        """`base`: the backend's directory (<state>/vm-backend)."""
        self.root = base / "runtime" / "snapshots"
        self._owners = base / "sandboxes"
        #: built-in template name -> the boot snapshot directory of its current build
        self.builtin: dict[str, Path] = {}
        self._lock = asyncio.Lock()

    # --- what a sandbox owns --------------------------------------------------------------------

    def _owned_file(self, sandbox_id: str) -> Path:
        return self._owners / f"{sandbox_id}.json"

    def owned(self, sandbox_id: str) -> list[str]:
        """Snapshot directories this sandbox made for itself (pauses, fork points)."""
        try:
            return list(json.loads(self._owned_file(sandbox_id).read_text()))
        except (OSError, ValueError):
            return []

    def own(self, sandbox_id: str, directory: Path) -> None:
        owned = self.owned(sandbox_id)
        owned.append(str(directory))
        atomic_write_json(self._owned_file(sandbox_id), owned)

    def disown(self, sandbox_id: str, directory: str | None = None) -> None:
        """Forget one of the sandbox's snapshot directories (None: all of them)."""
        if directory is None:
            self._owned_file(sandbox_id).unlink(missing_ok=True)
            return
        owned = self.owned(sandbox_id)
        if directory in owned:
            owned.remove(directory)
            atomic_write_json(self._owned_file(sandbox_id), owned)

    # --- records and refs -----------------------------------------------------------------------

    def ref(self, record: SnapshotRecord, kind: str) -> TemplateRef:
        return TemplateRef(kind=kind, data={"record_dir": str(record_dir(record))},
                           layers=snapshot_layers(record))

    def load(self, ref: TemplateRef) -> SnapshotRecord:
        builtin = ref.data.get("builtin")
        directory = self.builtin.get(builtin) if builtin else ref.data.get("record_dir")
        if not directory:
            raise BackendError(f"{ref.kind} has no VM snapshot (made by another backend?)",
                               retryable=False)
        try:
            return SnapshotRecord.load(Path(directory))
        except Exception as exc:  # missing, unreadable or invalid record
            raise BackendError(f"snapshot {directory} cannot be read: {exc}",
                               retryable=False) from exc

    def find_pause_record(self, vm_id: str, since: float) -> SnapshotRecord | None:
        """The newest complete, unreleased snapshot of VM `vm_id` taken after `since`."""
        best: SnapshotRecord | None = None
        if not self.root.is_dir():
            return None
        for snap in self.root.iterdir():
            if not snap.is_dir() or (snap / RELEASED_MARK).exists():
                continue
            try:
                record = SnapshotRecord.load(snap)
                if record.source_vm != vm_id or record.created_ms < since * 1000:
                    continue
                record.check_files()
            except Exception:  # half-written or damaged: not a pause snapshot to resume
                continue
            if best is None or record.created_ms > best.created_ms:
                best = record
        return best

    # --- release and collection -----------------------------------------------------------------

    def _is_ours(self, path: Path) -> bool:
        try:
            path.resolve().relative_to(self.root.resolve())
        except ValueError:
            return False
        return path.resolve() != self.root.resolve()

    def mark_released(self, directories: list[str]) -> int:
        """Mark snapshot directories as unused; how many were marked."""
        marked = 0
        for raw in directories:
            path = Path(raw)
            if self._is_ours(path) and path.is_dir():
                (path / RELEASED_MARK).touch()
                marked += 1
        return marked

    async def collect(self, files_in_use: set[Path], dirs_in_use: set[Path]) -> None:
        """Delete the released directories: whole when no snapshot names a file in them and
        no running VM reads one (`files_in_use`), else every file but those; `dirs_in_use`
        (restores under way) are kept whole."""
        async with self._lock:
            await asyncio.to_thread(self._collect, files_in_use, dirs_in_use)

    def _collect(self, files_in_use: set[Path], dirs_in_use: set[Path]) -> None:
        if not self.root.is_dir():
            return
        needed: set[Path] = {p.resolve() for p in files_in_use}
        released: list[Path] = []
        for snap in self.root.iterdir():
            if not snap.is_dir():
                continue
            if (snap / RELEASED_MARK).exists():
                released.append(snap)
                continue
            try:
                record = SnapshotRecord.load(snap)
            except Exception:  # a half-written snapshot pins nothing
                continue
            needed.update(Path(p).resolve() for p in snapshot_layers(record))
        needed_dirs = {p.parent for p in needed}
        kept_whole = {p.resolve() for p in dirs_in_use}
        for snap in released:
            where = snap.resolve()
            if where in kept_whole:
                continue
            if where not in needed_dirs:
                shutil.rmtree(snap, ignore_errors=True)
                log.info("snapshot deleted", extra={"snapshot_dir": str(snap)})
                continue
            # A later snapshot grew from some of its layers (a sealed disk upper, memory not
            # yet compacted): those stay, its own memory, device state and record go.
            trimmed = [f for f in snap.iterdir() if f.is_file() and f.name != RELEASED_MARK
                       and f.resolve() not in needed]
            for f in trimmed:
                f.unlink(missing_ok=True)
            if trimmed:
                log.info("released snapshot trimmed to the layers still named", extra={
                    "snapshot_dir": str(snap), "deleted": [f.name for f in trimmed]})
