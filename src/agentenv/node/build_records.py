"""Template build records (node/template_api.py): a build's status, its log (the tail, with
stable offsets), its request (registry credentials redacted) and its final context, as JSON
files under <state>/template-builds/, and the questions the build API asks of them (a
template's builds, which ones no tag names any more, which template a request means).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentenv.api import models
from agentenv.api.errors import NotFound
from agentenv.api.tenancy import LOCAL_TEAM
from agentenv.errors import AgentEnvError
from agentenv.node.catalogue import TemplateCatalogue
from agentenv.node.records import TemplateRecord
from agentenv.settings import setting_text

log = logging.getLogger("agentenv.node.template_api")

MAX_LOG_ENTRIES = 20_000
#: finished build records kept per team beyond those still needed (failed builds, ready ones
#: no tag names any more): the oldest go, so requests that fail cannot grow the records (each
#: up to AENV_BUILD_LOG_TAIL of logs, in memory and on disk) or the scans over them forever
KEEP_FINISHED_BUILDS = 50


def log_tail_bytes() -> int:
    """Bytes of build log kept per build, the newest (AENV_BUILD_LOG_TAIL, default 1 MiB):
    RUN output is unbounded, and the record lives in memory and on disk."""
    raw = setting_text("AENV_BUILD_LOG_TAIL")
    try:
        return max(int(raw), 4096) if raw else 1 << 20
    except ValueError:
        raise AgentEnvError(f"AENV_BUILD_LOG_TAIL must be a number of bytes, got {raw!r}") from None



ACTIVE = ("waiting", "building")


@dataclass
class BuildRecord:
    template_id: str
    build_id: str
    name: str
    cpu_count: int
    memory_mb: int
    status: str  # waiting | building | ready | error
    created_at: float
    updated_at: float
    disk_size_mb: int = 0
    finished_at: float | None = None
    reason: dict[str, Any] | None = None
    request: dict[str, Any] | None = None
    context: dict[str, Any] | None = None  # BuildContext.to_json() once ready
    envd_version: str | None = None
    logs: list[dict[str, Any]] = field(default_factory=list)
    #: the tags the build gets once ready (records written before tags existed: "default")
    tags: list[str] = field(default_factory=list)
    #: log entries dropped from the front (only the tail is kept); offsets stay absolute
    logs_dropped: int = 0
    logs_bytes: int = 0
    #: the team that asked for the build (api/tenancy.py): the template is that team's
    team: str = LOCAL_TEAM
    #: the template's default idlePauseAfter from this build on (None: as it was)
    idle_pause_after: int | None = None
    #: the request's (or the rebuilt template's) cold-memory setting, ColdMemory's JSON; None:
    #: the base template's, else the node's default
    cold_memory: dict[str, Any] | None = None

    def log(self, level: str, message: str, step: str | None = None) -> None:
        entry: dict[str, Any] = {"timestamp": time.time(), "level": level, "message": message}
        if step is not None:
            entry["step"] = step
        self.logs.append(entry)
        self.logs_bytes += _entry_size(entry)
        limit = log_tail_bytes()
        if len(self.logs) > MAX_LOG_ENTRIES or self.logs_bytes > limit:
            # Drop the oldest down to 90% of both limits at once (not one per new line).
            cut, size = 0, self.logs_bytes
            while cut < len(self.logs) - 1 and (
                    len(self.logs) - cut > MAX_LOG_ENTRIES * 9 // 10 or size > limit * 9 // 10):
                size -= _entry_size(self.logs[cut])
                cut += 1
            del self.logs[:cut]
            self.logs_dropped += cut
            self.logs_bytes = size

    def logs_from(self, offset: int, count: int) -> list[dict[str, Any]]:
        """Entries from absolute position `offset` (what a client has read so far)."""
        start = max(0, offset - self.logs_dropped)
        return self.logs[start:start + count]


def _entry_size(entry: dict[str, Any]) -> int:
    return len(entry["message"]) + 48  # the message plus timestamp, level and step


def redacted(request: dict[str, Any]) -> dict[str, Any]:
    """A build request as it may be kept: registry credentials are used for the pull, in
    memory, and never written anywhere (the record keeps who, not the secret)."""
    creds = request.get("fromImageRegistry")
    if isinstance(creds, dict):
        request["fromImageRegistry"] = {
            k: ("[redacted]" if k not in ("type", "username") else v) for k, v in creds.items()}
    return request


def entry_json(entry: dict[str, Any]) -> dict[str, Any]:
    out = {"timestamp": models.iso(entry["timestamp"]), "level": entry["level"],
           "message": entry["message"]}
    if entry.get("step") is not None:
        out["step"] = entry["step"]
    return out


def log_line(entry: dict[str, Any]) -> str:
    return f"{models.iso(entry['timestamp'])} [{entry['level']}] {entry['message']}"



class BuildRecords:
    """Every build record of the node, read once from `builds_dir`."""

    def __init__(self, catalogue: TemplateCatalogue, state_dir: Path) -> None:
        self.catalogue = catalogue
        self.builds_dir = state_dir / "template-builds"
        self.files_dir = state_dir / "template-files"
        self.builds: dict[str, BuildRecord] = {}
        self._loaded = False

    def load(self) -> None:
        """Read the build records once; a build that was running when the node stopped failed."""
        if self._loaded:
            return
        self._loaded = True
        self.builds_dir.mkdir(parents=True, exist_ok=True)
        self.files_dir.mkdir(parents=True, exist_ok=True)
        for path in self.builds_dir.glob("*.json"):
            try:
                rec = BuildRecord(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("unreadable build record", extra={"path": str(path), "error": str(exc)})
                continue
            if rec.status in ACTIVE:
                rec.status = "error"
                rec.reason = {"message": "the node stopped during the build"}
                rec.finished_at = rec.updated_at = time.time()
                self.save(rec)
            self.builds[rec.build_id] = rec

    def save(self, rec: BuildRecord) -> None:
        self.builds_dir.mkdir(parents=True, exist_ok=True)
        path = self.builds_dir / f"{rec.build_id}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(rec)))
        tmp.replace(path)

    def of(self, template_id: str, *, released: bool = False) -> list[BuildRecord]:
        """Newest first: the builds under way or failed, and the ready ones still kept (a
        ready build no tag names any more was released with its snapshot: only with
        `released`)."""
        return sorted((b for b in self.builds.values()
                       if b.template_id == template_id and (released or not self.released(b))),
                      key=lambda b: b.created_at, reverse=True)

    def released(self, rec: BuildRecord) -> bool:
        if rec.status != "ready":
            return False
        tags = self.catalogue.tags
        tpl = self.catalogue.get(rec.template_id)
        if rec.build_id in tags.builds or (tpl is not None and tpl.build_id == rec.build_id):
            return False
        if tags.tags.get(rec.template_id):
            return True
        # A template built before tag records were kept: its newest ready build is its snapshot.
        newest = max((b for b in self.builds.values()
                      if b.template_id == rec.template_id and b.status == "ready"),
                     key=lambda b: b.created_at)
        return tpl is None or newest is not rec

    def pending(self, id_or_name: str, team: str) -> BuildRecord | None:
        """The newest build of `team`'s template that has never been ready (not registered
        yet)."""
        for rec in sorted(self.builds.values(), key=lambda b: b.created_at, reverse=True):
            if id_or_name in (rec.template_id, rec.name) and rec.team == team and \
                    rec.template_id not in self.catalogue:
                return rec
        return None

    def registered(self, id_or_name: str, team: str) -> TemplateRecord | None:
        with contextlib.suppress(NotFound):
            return self.catalogue.resolve(id_or_name, team)
        return None

    def context_of(self, template_id: str, build_id: str | None = None
                    ) -> dict[str, Any] | None:
        """The final user/workdir/env of build `build_id`, else of the newest ready build."""
        tagged = self.builds.get(build_id) if build_id else None
        if tagged is not None and tagged.context is not None:
            return tagged.context
        for rec in self.of(template_id):
            if rec.status == "ready" and rec.context is not None:
                return rec.context
        return None

    def purge_finished(self, team: str) -> None:
        """Drop `team`'s oldest finished build records past KEEP_FINISHED_BUILDS."""
        finished = sorted((b for b in self.builds.values() if b.team == team and (
            b.status == "error" or self.released(b))), key=lambda b: b.created_at,
            reverse=True)
        for rec in finished[KEEP_FINISHED_BUILDS:]:
            self.builds.pop(rec.build_id, None)
            (self.builds_dir / f"{rec.build_id}.json").unlink(missing_ok=True)

    def template_count(self, team: str) -> int:
        """`team`'s templates built through this API: registered, or requested and not failed."""
        built = {t.template_id for t in self.catalogue.templates.values()
                 if t.kind == "template" and t.team == team and not self.builtin(t)}
        requested = {b.template_id for b in self.builds.values()
                     if b.status in ACTIVE and b.team == team}
        return len(built | requested)

    def template_of_request(self, template_id: str, team: str) -> str:
        """A template id of `team` the API knows (built, or with a build requested)."""
        if any(b.template_id == template_id and b.team == team for b in self.builds.values()):
            return template_id
        registered = self.registered(template_id, team)
        if registered is not None:
            return registered.template_id
        raise NotFound(f"template '{template_id}' not found")

    def newest_ready(self, template_id: str) -> str | None:
        ready = [b for b in self.of(template_id) if b.status == "ready"]
        return ready[0].build_id if ready else None

    def builtin(self, tpl: TemplateRecord) -> bool:
        return self.catalogue.is_builtin(tpl.template_id) or \
            bool(tpl.ref.data.get("builtin"))
