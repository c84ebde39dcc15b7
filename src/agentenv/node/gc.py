"""Garbage collection of the node's layer and snapshot files (mark and sweep).

Mark: everything something still needs.
- every template and snapshot record (their snapshot directories and the files those name),
- every template build a tag still names (node/template_tags.py; "default" is the template
  record's own snapshot): a build no tag names is left to the sweep once no sandbox uses it,
- every sandbox, running or paused: its source template's files (a fork child of a paused
  sandbox: that sandbox's pause snapshot), its pause snapshot and its last pause (a rollback
  target); a snapshot's files name the files of those it grew from, so a fork tree's layers
  stay while any descendant needs them,
- what the backend's live VMs use (sandboxes, template-build VMs, ready-pool VMs): memory
  and disk layers, work directories, RAM files with a reference, built-in templates,
- what blockd has open (every device's upper and the lowers of its image config),
- images recorded by `aenv pull` (<state>/images/*/image.json) for the layer cache.
A snapshot record that cannot be read pins its whole directory (never guess at a record).

Sweep: what the node owns on disk and nothing marks, and only when older than a grace period
(`AENV_GC_GRACE_SECONDS`, default 60): a snapshot being written right now (a pause between the
runtime's write and the node's record, a template build) is fresh, so it is never taken.
A pass also waits (up to `BUSY_WAIT_SECONDS`) until no sandbox operation is under way.

VM backend (<state>/vm-backend/): snapshot directories (memory layers, device state, sealed
disk layers), memory files the runtime materialised without a user, `sandboxes/<id>.json`
ownership lists of sandboxes that are gone, blockd devices whose upper directory was deleted
(left by a node killed in the middle of a teardown); <state>/templates/base/rootfs-*.layer of
earlier base builds; the content-addressed layer cache <state>/layer-cache entries nothing
references (never while a template build runs). The built-in template's current boot snapshot
and layer are always marked.
Process backend (<state>/process-backend/): directories of sandboxes that are gone and
snapshot copies no template or sandbox names.
Volumes (<state>/volumes/layers/): sealed versions that are no volume's current one and that
no sandbox mounts and no snapshot names (docs/volumes.md §6).
Template build uploads (<state>/template-files/<team>/): an archive no waiting or running build's
steps name, once it has not been uploaded or asked about (`present`) for
`AENV_TEMPLATE_FILES_TTL` seconds (default 3600, an upload URL's lifetime: the SDK may ask,
upload the other files, then start); upload temp files left by a dead node after the grace.

The orchestrator runs a pass at startup (after adoption) and a debounced one after every kill,
snapshot or template delete; metrics count the files and bytes reclaimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.node.backend import TemplateRef
from agentenv.node.template_files import UNVERIFIED_SUFFIX
from agentenv.settings import get_settings
from agentenv.snapshot.record import SnapshotRecord
from agentenv.template.layercache import CONVERTER_KIND, LAYER_FILE, NATIVE_KIND, REMOTE_KIND

if TYPE_CHECKING:
    from agentenv.node.metrics import NodeMetrics
    from agentenv.node.orchestrator import Orchestrator

log = logging.getLogger("agentenv.node.gc")

DEFAULT_DEBOUNCE_SECONDS = 1.0
BUSY_WAIT_SECONDS = 30.0
RELEASED_MARK = ".released"  # vm_backend's own marker; not a reason to keep or to delete


@dataclass
class GcReport:
    """What one pass did."""

    reason: str
    files: int = 0
    bytes: int = 0
    deleted: list[str] = field(default_factory=list)
    kept_fresh: list[str] = field(default_factory=list)
    devices_released: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "files": self.files,
            "bytes": self.bytes,
            "deleted": self.deleted,
            "keptFresh": self.kept_fresh,
            "devicesReleased": self.devices_released,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class _Marks:
    """The sweep's input, gathered on the event loop at one instant."""

    refs: list[TemplateRef]
    sandbox_ids: set[str]
    in_use: set[Path]
    device_uppers: dict[str, Path]  # blockd device id -> its upper directory
    device_files: set[Path]
    current_base_layer: Path | None = None


def _resolve(path: Path | str) -> Path:
    try:
        return Path(path).resolve()
    except OSError:
        return Path(os.path.abspath(path))


def _usage(path: Path) -> tuple[int, int]:
    """(files, allocated bytes) under `path` (a file or a directory)."""
    try:
        if path.is_file() or path.is_symlink():
            return 1, path.lstat().st_blocks * 512
    except OSError:
        return 0, 0
    files = size = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                files += 1
    return files, size


def _newest_mtime(path: Path) -> float:
    """The newest modification time in `path` (a directory being written keeps changing)."""
    try:
        newest = path.lstat().st_mtime
    except OSError:
        return 0.0
    if path.is_dir():
        for dirpath, dirs, names in os.walk(path):
            for name in [*names, *dirs]:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    return newest


def _config_lowers(config: Path) -> list[Path]:
    """Layer files an overlaybd image config (blockd's or `aenv pull`'s image.json) names."""
    try:
        doc = json.loads(config.read_text())
    except (OSError, ValueError):
        return []
    found: list[Path] = []
    for entry in doc.get("lowers", []) if isinstance(doc, dict) else []:
        raw = entry.get("file") if isinstance(entry, dict) else entry
        if isinstance(raw, str):
            found.append(Path(raw) if os.path.isabs(raw) else config.parent / raw)
    return found


class LayerCollector:
    """Finds and deletes the layer and snapshot files no sandbox, snapshot, template or
    operation in flight needs (see the module doc)."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        state_dir: Path,
        metrics: NodeMetrics | None = None,
        *,
        grace_seconds: float | None = None,
        debounce_seconds: float = DEFAULT_DEBOUNCE_SECONDS,
    ) -> None:
        self.orchestrator = orchestrator
        #: the templates and snapshots whose layers the marks keep (node/catalogue.py)
        self.catalogue = orchestrator.catalogue
        #: the backend's optional capabilities, resolved once at assembly (node/server.py)
        self.capabilities = orchestrator.capabilities
        self.state_dir = state_dir
        self.metrics = metrics
        settings = get_settings()
        self.grace_seconds = (grace_seconds if grace_seconds is not None
                              else settings.gc_grace_seconds)
        self.debounce_seconds = debounce_seconds
        self.files_ttl = settings.template_files_ttl
        self.last: GcReport | None = None
        self._lock = asyncio.Lock()
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # --- scheduling --------------------------------------------------------------------------

    def request(self) -> None:
        """Ask for a pass soon; calls within the debounce interval make one pass."""
        if self._closed:
            return
        self._wanted.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._debounced(), name="layer-gc")

    async def _debounced(self) -> None:
        while self._wanted.is_set() and not self._closed:
            await asyncio.sleep(self.debounce_seconds)
            self._wanted.clear()
            try:
                await self.collect("after a delete")
            except Exception:
                log.exception("garbage collection pass failed")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    # --- one pass ----------------------------------------------------------------------------

    async def collect(self, reason: str = "requested") -> GcReport:
        async with self._lock:
            started = time.monotonic()
            # Operations under way may be writing a snapshot no record names yet; the grace
            # period covers a node too busy ever to be idle.
            await self.orchestrator.wait_idle(BUSY_WAIT_SECONDS)
            report = GcReport(reason=reason)
            # No operation starts between the marks and the sweep: what it would write no
            # mark names (on a node too busy to be idle, the grace period still covers those
            # under way).
            async with self.orchestrator.operations_held():
                marks = await self._marks()
                await asyncio.to_thread(self._sweep, marks, report)
            layers = self.capabilities.layers
            for device_id, upper in marks.device_uppers.items():
                if layers is None or not self._stale_device(upper):
                    continue
                try:
                    await layers.release_device(device_id)
                except Exception as exc:
                    log.warning("stray blockd device not released",
                                extra={"device": device_id, "error": str(exc)})
                else:
                    report.devices_released.append(device_id)
            report.seconds = time.monotonic() - started
            self.last = report
            if self.metrics is not None:
                self.metrics.record_gc(report.files, report.bytes, len(report.devices_released),
                                       report.seconds)
            if report.files or report.devices_released:
                log.info("garbage collected", extra={
                    "reason": reason, "files": report.files, "bytes": report.bytes,
                    "deleted": report.deleted[:50], "devices": report.devices_released,
                    "seconds": round(report.seconds, 3)})
            return report

    async def _marks(self) -> _Marks:
        orch = self.orchestrator
        layers = self.capabilities.layers
        refs: list[TemplateRef] = list(self.catalogue.refs())
        for rec in orch.all_sandboxes():
            refs.append(rec.source)
            if rec.pause_snapshot is not None:
                refs.append(rec.pause_snapshot)
            if rec.last_pause is not None:  # a rollback target after the sandbox resumed
                refs.append(rec.last_pause)
        in_use = {_resolve(p) for p in layers.files_in_use()} if layers else set()
        device_uppers: dict[str, Path] = {}
        device_files: set[Path] = set()
        if layers is not None:
            for dev in await layers.blockd_devices():
                if dev.upper_dir:
                    upper = _resolve(dev.upper_dir)
                    device_files.add(upper)
                    device_uppers[dev.id] = upper
                if dev.source:
                    source = Path(dev.source)
                    device_files.add(_resolve(source))
                    if source.suffix == ".json":
                        device_files.update(_resolve(p) for p in _config_lowers(source))
        # volumes: every volume's current version, and what sandboxes mount (a create that
        # sealed one may not run its VM yet); older versions go (node/volumes.py)
        in_use.update(_resolve(p) for p in orch.volume_layers())
        for rec in orch.all_sandboxes():
            in_use.update(_resolve(m.layer) for m in rec.volume_mounts if m.layer)
        current_layer = None
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            meta = json.loads((self.state_dir / "templates" / "base" / "template.json").read_text())
            current_layer = _resolve(meta["layer"])
        sandbox_ids = {r.sandbox_id for r in orch.all_sandboxes()}
        return _Marks(refs=refs, sandbox_ids=sandbox_ids, in_use=in_use,
                      device_uppers=device_uppers, device_files=device_files,
                      current_base_layer=current_layer)

    def _stale_device(self, upper: Path) -> bool:
        """A blockd device of ours whose upper directory is gone: its VM was torn down by a
        node that died before releasing it."""
        vm_dir = _resolve(self.state_dir / "vm-backend" / "runtime" / "vms")
        return upper.is_relative_to(vm_dir) and not upper.exists()

    # --- the sweep (in a thread) -------------------------------------------------------------

    def _delete(self, path: Path, report: GcReport, now: float) -> None:
        if now - _newest_mtime(path) < self.grace_seconds:
            report.kept_fresh.append(str(path))
            return
        files, size = _usage(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        if path.exists():
            log.warning("could not delete", extra={"path": str(path)})
            return
        report.files += files
        report.bytes += size
        report.deleted.append(str(path))

    def _sweep(self, marks: _Marks, report: GcReport) -> None:
        now = time.time()
        files = set(marks.in_use)
        if (self.state_dir / "vm-backend").is_dir():
            files = self._sweep_vm(marks, report, now)
        if (self.state_dir / "process-backend").is_dir():
            self._sweep_process(marks, report, now)
        self._sweep_template_files(report, now)
        self._sweep_volume_layers(files, report, now)

    def _sweep_volume_layers(self, files: set[Path], report: GcReport, now: float) -> None:
        """Sealed versions of volumes no volume, sandbox or snapshot names (an older version,
        or every version of a deleted volume, once nothing mounts it)."""
        layers = self.state_dir / "volumes" / "layers"
        if layers.is_dir():
            for layer in sorted(layers.glob("*.layer")):
                if _resolve(layer) not in files:
                    self._delete(layer, report, now)

    def _files_wanted(self) -> set[str] | None:
        """filesHash of every step of a waiting or running build (None: a record could not
        be read, so nothing is known to be unwanted)."""
        wanted: set[str] = set()
        for path in (self.state_dir / "template-builds").glob("*.json"):
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                return None
            if not isinstance(rec, dict) or rec.get("status") not in ("waiting", "building"):
                continue
            for step in ((rec.get("request") or {}).get("steps") or []):
                if isinstance(step, dict) and isinstance(step.get("filesHash"), str):
                    wanted.add(step["filesHash"])
        return wanted

    def _sweep_template_files(self, report: GcReport, now: float) -> None:
        files = self.state_dir / "template-files"
        if not files.is_dir():
            return
        wanted = self._files_wanted()
        if wanted is None:
            return
        for path in sorted(files.iterdir()):
            if not path.is_dir():  # an upload of the layout before teams: no build reads it
                self._delete(path, report, now)
        for path in sorted(p for team in files.iterdir() if team.is_dir()
                           for p in team.iterdir()):  # a directory per team
            if path.name.startswith("."):  # an upload being written (or left by a dead node)
                self._delete(path, report, now)
            elif path.name.removesuffix(UNVERIFIED_SUFFIX) not in wanted:
                if now - _newest_mtime(path) >= self.files_ttl:
                    self._delete(path, report, now)
                else:
                    report.kept_fresh.append(str(path))

    def _live_vm_files(self, marks: _Marks) -> tuple[set[Path], set[Path]]:
        """(files, directories) the marks pin, following snapshot records."""
        files: set[Path] = set(marks.in_use) | set(marks.device_files)
        dirs: set[Path] = set()
        record_dirs: set[Path] = set()
        for ref in marks.refs:
            raw = ref.data.get("record_dir")
            if raw:
                record_dirs.add(_resolve(raw))
            files.update(_resolve(p) for p in ref.layers)
        for path in list(files):
            if (path / "snapshot.json").is_file():
                record_dirs.add(path)
        for record_dir in record_dirs:
            dirs.add(record_dir)
            try:
                record = SnapshotRecord.load(record_dir)
            except Exception as exc:  # an unreadable record pins its directory, nothing more
                log.warning("snapshot record unreadable, kept",
                            extra={"record_dir": str(record_dir), "error": str(exc)})
                continue
            files.update(_resolve(x.path) for x in record.memory_layers)
            files.add(_resolve(record.device_state))
            for disk in record.disks:
                files.update(_resolve(x.path) for x in disk.layers)
                if disk.file:
                    files.add(_resolve(disk.file))
        dirs.update(p.parent for p in files)
        dirs.update(p for p in files if p.is_dir())
        return files, dirs

    def _sweep_vm(self, marks: _Marks, report: GcReport, now: float) -> set[Path]:
        """Sweeps the VM backend's files; what is in use (the files the marks pin)."""
        base = self.state_dir / "vm-backend"
        files, dirs = self._live_vm_files(marks)
        snapshots = base / "runtime" / "snapshots"
        if snapshots.is_dir():
            for snap in sorted(snapshots.iterdir()):
                if _resolve(snap) not in dirs:
                    self._delete(snap, report, now)
        memory = base / "runtime" / "memory"
        if memory.is_dir():
            for mem in sorted(memory.glob("*.mem")):
                if not mem.name.startswith("zero-") and _resolve(mem) not in files:
                    self._delete(mem, report, now)
        owned = base / "sandboxes"
        if owned.is_dir():
            for entry in sorted(owned.glob("*.json")):
                if entry.name.endswith(".vm.json"):
                    continue  # manifests of live VMs: the backend's own
                if entry.stem not in marks.sandbox_ids:
                    self._delete(entry, report, now)
        base_template = self.state_dir / "templates" / "base"
        if base_template.is_dir():
            for layer in sorted(base_template.glob("rootfs-*.layer")):
                path = _resolve(layer)
                if path not in files and path != marks.current_base_layer:
                    self._delete(layer, report, now)
        self._sweep_layer_cache(files, report, now)
        return files

    def _builds_running(self) -> bool:
        for path in (self.state_dir / "template-builds").glob("*.json"):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                if json.loads(path.read_text()).get("status") in ("waiting", "building"):
                    return True
        return False

    def _sweep_layer_cache(self, files: set[Path], report: GcReport, now: float) -> None:
        """Entries of <state>/layer-cache that no template, sandbox, pulled image or blockd
        device names (a cache elsewhere, $AENV_LAYER_CACHE, is shared and not ours)."""
        cache = self.state_dir / "layer-cache"
        if not cache.is_dir() or self._builds_running():
            return
        wanted = set(files)
        for config in (self.state_dir / "images").glob("*/image.json"):
            wanted.update(_resolve(p) for p in _config_lowers(config))
        for kind in (CONVERTER_KIND, NATIVE_KIND, REMOTE_KIND):  # base/: the shared empty ext4, kept
            for entry in sorted((cache / kind).glob("*")):
                if entry.is_dir() and _resolve(entry / LAYER_FILE) not in wanted:
                    self._delete(entry, report, now)

    def _sweep_process(self, marks: _Marks, report: GcReport, now: float) -> None:
        base = self.state_dir / "process-backend"
        named = {_resolve(ref.data["dir"]) for ref in marks.refs if ref.data.get("dir")}
        sandboxes = base / "sandboxes"
        if sandboxes.is_dir():
            for sdir in sorted(sandboxes.iterdir()):
                if sdir.name not in marks.sandbox_ids and not _runs_envd(sdir):
                    self._delete(sdir, report, now)
        snapshots = base / "snapshots"
        if snapshots.is_dir():
            for snap in sorted(snapshots.iterdir()):
                if snap.is_dir() and _resolve(snap) not in named:
                    self._delete(snap, report, now)
                    version = snap.with_name(snap.name + ".version")
                    if not snap.exists() and version.exists():
                        version.unlink(missing_ok=True)


def _runs_envd(sandbox_dir: Path) -> bool:
    """A process-backend sandbox directory whose envd still runs (an adopted sandbox the node
    has not recorded yet is never swept from under its process)."""
    try:
        pid = int(json.loads((sandbox_dir / "run.json").read_text())["handle"]["pid"])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return str(sandbox_dir).encode() in f.read()
    except (OSError, ValueError, KeyError, TypeError):
        return False
