"""The E2B template build API of the node (docs/e2b-api.md §1.7, docs/templates.md §3).

    POST /v3/templates {name, cpuCount?, memoryMB?}          -> 202 {templateID, buildID, ...}
    GET  /templates/{tid}/files/{hash}                        -> 201 {present, url?}
    PUT  /template-files/{tid}/{hash}?expires=&signature=     the upload URL handed out above
    POST /v2/templates/{tid}/builds/{bid} {fromImage|fromTemplate, steps, startCmd, readyCmd}
                                                              -> 202, the build runs in the background
    GET  /templates/{tid}/builds/{bid}/status?logsOffset=N    -> 200 {status, logEntries, reason?}
    GET  /templates/aliases/{alias}, GET /templates, GET /v2/templates, GET/DELETE /templates/{id}
    GET  /templates/{id}/tags -> 200 [{tag, buildID, createdAt}]
    POST /templates/tags {target: "name[:tag]", tags} -> 201 {tags, buildID}
    DELETE /templates/tags {name, tags} -> 204

Tags (E2B template versions, node/template_tags.py): `POST /v3/templates` with "name:tag" or
`tags` gives the build those tags once it is ready; without tags it gets "default", which is
what the bare name means. Builds other tags still name stay usable ("name:tag" at create).

A template keeps its id across builds; every build gets a new UUID. A build boots a VM from an
image (pulled and converted by agentenv.template.pull) or from another template's snapshot,
runs the steps through envd (agentenv.template.build), pauses the VM into the template's boot
snapshot and only then registers the template with the orchestrator, so a failed build leaves
no half template and its VM is killed. A rebuild moves the tags it was asked for once it
succeeds; the build no tag names any more is deleted (sandboxes made from it keep its files
until they end).

Build records (status, logs, the final user/workdir/env) are JSON files under
<state>/template-builds/; uploaded build files are kept per team under <state>/template-files/
and a build uses one only once its content matched its hash (node/template_files.py).
Builds run one at a time (AENV_TEMPLATE_BUILDS, default 1): TCG guests share few cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentenv.errors import AgentEnvError
from agentenv.fsutil import (
    InsufficientSpace,
    disk_reserve,
    free_bytes,
    require_free_space,
)
from agentenv.node import models
from agentenv.node.api import page, read_model
from agentenv.node.backend import BackendError, SandboxSpec
from agentenv.node.errors import ApiError, BadRequest, Conflict, NotFound
from agentenv.node.events import BUILD_FAILED, BUILD_FINISHED, BUILD_STARTED, Event
from agentenv.node.orchestrator import Orchestrator
from agentenv.node.records import DEFAULT_TAG, BuildSnapshot, TemplateRecord
from agentenv.node.security import new_id
from agentenv.node.template_files import TeamFiles
from agentenv.node.template_models import (
    UPLOAD_PREFIX,
    AssignTemplateTagsRequest,
    DeleteTemplateTagsRequest,
    TemplateBuildRequestV3,
    TemplateBuildStartV2,
)
from agentenv.node.template_tags import normalize_tags, split_tag
from agentenv.node.tenancy import LOCAL_TEAM, scope_team
from agentenv.registry.auth import Credentials

log = logging.getLogger("agentenv.node.template_api")

UPLOAD_URL_SECONDS = 3600
MAX_UPLOAD_BYTES = 8 << 30
UPLOAD_SPACE_CHECK = 16 << 20
MAX_LOG_ENTRIES = 20_000
#: finished build records kept per team beyond those still needed (failed builds, ready ones
#: no tag names any more): the oldest go, so requests that fail cannot grow the records (each
#: up to AENV_BUILD_LOG_TAIL of logs, in memory and on disk) or the scans over them forever
KEEP_FINISHED_BUILDS = 50
BUILD_TIMEOUT_ENV = "AENV_BUILD_TIMEOUT_SECONDS"


def log_tail_bytes() -> int:
    """Bytes of build log kept per build, the newest (AENV_BUILD_LOG_TAIL, default 1 MiB):
    RUN output is unbounded, and the record lives in memory and on disk."""
    raw = os.environ.get("AENV_BUILD_LOG_TAIL", "")
    try:
        return max(int(raw), 4096) if raw else 1 << 20
    except ValueError:
        raise AgentEnvError(f"AENV_BUILD_LOG_TAIL must be a number of bytes, got {raw!r}") from None


def build_timeout_seconds() -> float:
    """Seconds a build may run once it has its slot (AENV_BUILD_TIMEOUT_SECONDS, default 3600,
    0 = no limit): the guest is the team's, and a build holds a VM until it ends."""
    raw = os.environ.get(BUILD_TIMEOUT_ENV, "")
    try:
        seconds = float(raw) if raw else 3600.0
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise AgentEnvError(f"{BUILD_TIMEOUT_ENV} must be a number of seconds (0 = no limit), "
                            f"got {raw!r}")
    return seconds


LOGS_PER_CALL = 100  # the SDK keeps polling until a call returns no entries
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HASH = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
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
    #: the team that asked for the build (node/tenancy.py): the template is that team's
    team: str = LOCAL_TEAM

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


def _redacted(request: dict[str, Any]) -> dict[str, Any]:
    """A build request as it may be kept: registry credentials are used for the pull, in
    memory, and never written anywhere (the record keeps who, not the secret)."""
    creds = request.get("fromImageRegistry")
    if isinstance(creds, dict):
        request["fromImageRegistry"] = {
            k: ("[redacted]" if k not in ("type", "username") else v) for k, v in creds.items()}
    return request


def _entry_json(entry: dict[str, Any]) -> dict[str, Any]:
    out = {"timestamp": models.iso(entry["timestamp"]), "level": entry["level"],
           "message": entry["message"]}
    if entry.get("step") is not None:
        out["step"] = entry["step"]
    return out


def _line(entry: dict[str, Any]) -> str:
    return f"{models.iso(entry['timestamp'])} [{entry['level']}] {entry['message']}"


class TemplateBuildApi:
    """The routes and the background builds. Wired in by node/server.py (`extra_routes`)."""

    def __init__(self, orchestrator: Orchestrator, state_dir: Path, api_key: str) -> None:
        #: called with (name, build id, template id) once a build is ready
        self.on_published: Callable[[str, str, str], None] | None = None
        self.orchestrator = orchestrator
        self.catalogue = orchestrator.catalogue
        self.state_dir = state_dir
        self.builds_dir = state_dir / "template-builds"
        self.files_dir = state_dir / "template-files"
        self._signing_key = hashlib.sha256(b"aenv-template-upload:" + api_key.encode()).digest()
        self.builds: dict[str, BuildRecord] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loaded = False
        self._slots: asyncio.Semaphore | None = None
        self.concurrency = max(1, int(os.environ.get("AENV_TEMPLATE_BUILDS") or 1))
        self.build_timeout = build_timeout_seconds()

    # --- records -----------------------------------------------------------------------------

    def _load(self) -> None:
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
                self._save(rec)
            self.builds[rec.build_id] = rec

    def _save(self, rec: BuildRecord) -> None:
        self.builds_dir.mkdir(parents=True, exist_ok=True)
        path = self.builds_dir / f"{rec.build_id}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(rec)))
        tmp.replace(path)

    def _builds_of(self, template_id: str, *, released: bool = False) -> list[BuildRecord]:
        """Newest first: the builds under way or failed, and the ready ones still kept (a
        ready build no tag names any more was released with its snapshot: only with
        `released`)."""
        return sorted((b for b in self.builds.values()
                       if b.template_id == template_id and (released or not self._released(b))),
                      key=lambda b: b.created_at, reverse=True)

    def _released(self, rec: BuildRecord) -> bool:
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

    def _pending_template(self, id_or_name: str, team: str) -> BuildRecord | None:
        """The newest build of `team`'s template that has never been ready (not registered
        yet)."""
        for rec in sorted(self.builds.values(), key=lambda b: b.created_at, reverse=True):
            if id_or_name in (rec.template_id, rec.name) and rec.team == team and \
                    rec.template_id not in self.catalogue:
                return rec
        return None

    def _registered(self, id_or_name: str, team: str) -> TemplateRecord | None:
        with contextlib.suppress(NotFound):
            return self.catalogue.resolve(id_or_name, team)
        return None

    def _context_of(self, template_id: str, build_id: str | None = None
                    ) -> dict[str, Any] | None:
        """The final user/workdir/env of build `build_id`, else of the newest ready build."""
        tagged = self.builds.get(build_id) if build_id else None
        if tagged is not None and tagged.context is not None:
            return tagged.context
        for rec in self._builds_of(template_id):
            if rec.status == "ready" and rec.context is not None:
                return rec.context
        return None

    # --- routes ------------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        r = Route
        return [
            r("/v3/templates", self.create, methods=["POST"]),
            r("/templates/tags", self.assign_tags, methods=["POST"]),
            r("/templates/tags", self.remove_tags, methods=["DELETE"]),
            r("/templates/aliases/{alias:path}", self.alias, methods=["GET"]),
            r("/templates/{template_id}/files/{files_hash}", self.file_link, methods=["GET"]),
            r(UPLOAD_PREFIX + "{template_id}/{files_hash}", self.upload, methods=["PUT"]),
            r("/v2/templates/{template_id}/builds/{build_id}", self.start, methods=["POST"]),
            r("/templates/{template_id}/builds/{build_id}/status", self.status, methods=["GET"]),
            r("/templates/{template_id}/tags", self.tags, methods=["GET"]),
            r("/templates", self.list_v1, methods=["GET"]),
            r("/v2/templates", self.list_v2, methods=["GET"]),
            r("/templates/{template_id:path}", self.detail, methods=["GET"]),
            r("/templates/{template_id:path}", self.delete, methods=["DELETE"]),
        ]

    async def create(self, request: Request) -> Response:
        self._load()
        body = await read_model(request, TemplateBuildRequestV3)
        name = body.name or body.alias
        if not name:
            raise BadRequest("the template's name is required")
        name, name_tag = split_tag(name)  # "team/name:tag": this node has one team
        tags = normalize_tags(([name_tag] if name_tag is not None else []) + (body.tags or []))
        if not _NAME.match(name):
            raise BadRequest(f"invalid template name {name!r}: letters, digits, '.', '_' and '-'")
        if self.orchestrator.capabilities.templates is None:
            raise BadRequest(f"template builds need the VM backend; this node runs the "
                             f"'{self.orchestrator.backend.name}' backend")
        team = scope_team(request.scope)
        existing = self._registered(name, team)
        if existing is not None:
            if existing.kind != "template" or self._builtin(existing):
                raise BadRequest(f"name {name!r} is taken by {existing.kind} "
                                 f"{existing.template_id}, which cannot be rebuilt")
            template_id = existing.template_id
            cpu = body.cpuCount or existing.cpu_count
            memory = body.memoryMB or existing.memory_mb
        else:
            pending = self._pending_template(name, team)
            if pending is None and self.orchestrator.admission is not None:
                self.orchestrator.admission.check_quota("templates", self._template_count(team))
            template_id = pending.template_id if pending else new_id("t")
            cpu, memory = body.cpuCount or 2, body.memoryMB or 1024
        for other in self._builds_of(template_id):
            if other.status == "building":
                raise Conflict(f"template {name!r} has a build in progress ({other.build_id})")
            if other.status == "waiting":  # requested but never started: superseded
                other.status = "error"
                other.reason = {"message": "superseded by a newer build request"}
                other.finished_at = other.updated_at = time.time()
                self._save(other)
        tags = tags or [DEFAULT_TAG]
        self.catalogue.tags.check_room(template_id, tags)
        if existing is None and DEFAULT_TAG not in tags:
            tags.insert(0, DEFAULT_TAG)  # a template's first build is what its name means
        now = time.time()
        rec = BuildRecord(template_id=template_id, build_id=str(uuid.uuid4()), name=name,
                          cpu_count=cpu, memory_mb=memory, status="waiting", created_at=now,
                          updated_at=now, tags=tags, team=team)
        self.builds[rec.build_id] = rec
        self._save(rec)
        self._purge_finished(team)
        log.info("template build requested",
                 extra={"template_id": template_id, "build_id": rec.build_id, "template_name": name})
        return JSONResponse({"templateID": template_id, "buildID": rec.build_id, "public": False,
                             "names": [name], "tags": tags, "aliases": [name]}, status_code=202)

    def _purge_finished(self, team: str) -> None:
        """Drop `team`'s oldest finished build records past KEEP_FINISHED_BUILDS."""
        finished = sorted((b for b in self.builds.values() if b.team == team and (
            b.status == "error" or self._released(b))), key=lambda b: b.created_at,
            reverse=True)
        for rec in finished[KEEP_FINISHED_BUILDS:]:
            self.builds.pop(rec.build_id, None)
            (self.builds_dir / f"{rec.build_id}.json").unlink(missing_ok=True)

    def _template_count(self, team: str) -> int:
        """`team`'s templates built through this API: registered, or requested and not failed."""
        built = {t.template_id for t in self.catalogue.templates.values()
                 if t.kind == "template" and t.team == team and not self._builtin(t)}
        requested = {b.template_id for b in self.builds.values()
                     if b.status in ACTIVE and b.team == team}
        return len(built | requested)

    def _template_of_request(self, template_id: str, team: str) -> str:
        """A template id of `team` the API knows (built, or with a build requested)."""
        if any(b.template_id == template_id and b.team == team for b in self.builds.values()):
            return template_id
        registered = self._registered(template_id, team)
        if registered is not None:
            return registered.template_id
        raise NotFound(f"template '{template_id}' not found")

    def _signature(self, team: str, template_id: str, files_hash: str, expires: int) -> str:
        # The URL is the only permission an upload carries: it names the team it stores for.
        message = json.dumps([team, template_id, files_hash, expires]).encode()
        return hmac.new(self._signing_key, message, hashlib.sha256).hexdigest()

    async def file_link(self, request: Request) -> Response:
        self._load()
        template_id = self._template_of_request(request.path_params["template_id"], scope_team(request.scope))
        files_hash = request.path_params["files_hash"]
        if not _HASH.match(files_hash):
            raise BadRequest(f"invalid files hash {files_hash!r}")
        team = scope_team(request.scope)
        present = TeamFiles(self.files_dir, team).verified(files_hash)
        if present.is_file():
            # The SDK skips the upload and starts a build with it soon: fresh again for the
            # garbage collector (node/gc.py keeps unused uploads AENV_TEMPLATE_FILES_TTL).
            with contextlib.suppress(OSError):
                os.utime(present)
            return JSONResponse({"present": True}, status_code=201)
        expires = int(time.time()) + UPLOAD_URL_SECONDS
        base = str(request.base_url).rstrip("/")
        query = urlencode({"expires": expires, "team": team,
                           "signature": self._signature(team, template_id, files_hash, expires)})
        url = f"{base}{UPLOAD_PREFIX}{template_id}/{files_hash}?{query}"
        return JSONResponse({"present": False, "url": url}, status_code=201)

    async def upload(self, request: Request) -> Response:
        """The upload URL (no API key: the signature in the URL is the permission)."""
        self._load()
        template_id = request.path_params["template_id"]
        files_hash = request.path_params["files_hash"]
        try:
            expires = int(request.query_params.get("expires", ""))
        except ValueError:
            raise ApiError("upload URL without a valid expiry", status=403) from None
        given = request.query_params.get("signature", "")
        team = request.query_params.get("team", "")
        if not _HASH.match(files_hash) or not hmac.compare_digest(
                given, self._signature(team, template_id, files_hash, expires)):
            raise ApiError("invalid upload signature", status=403)
        if expires < time.time():
            raise ApiError("the upload URL has expired; ask for a new one", status=403)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > MAX_UPLOAD_BYTES:
            raise ApiError(f"upload over {MAX_UPLOAD_BYTES} bytes", status=413)
        files = TeamFiles(self.files_dir, team)
        files.dir.mkdir(parents=True, exist_ok=True)
        what = f"the upload of files {files_hash}"
        length = int(declared) if declared and declared.isdigit() else 0
        replaced = files.unverified(files_hash)  # a newer upload of a hash replaces the older
        held = files.held_bytes(skip=(replaced,))
        files.check_budget(held, length)
        reserve, setting = self._space_reserve()
        try:
            require_free_space(self.files_dir, length, what, reserve=reserve, setting=setting)
        except InsufficientSpace as exc:
            raise ApiError(str(exc), status=507) from None
        fd, tmp_name = tempfile.mkstemp(prefix=f".{files_hash}.", dir=files.dir)
        size = 0
        checked = 0
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > MAX_UPLOAD_BYTES:
                        raise ApiError(f"upload over {MAX_UPLOAD_BYTES} bytes", status=413)
                    files.check_budget(held, size)
                    if size - checked >= UPLOAD_SPACE_CHECK:
                        # No length given (or a wrong one), and the team's other uploads
                        # grow too: look again every few MiB.
                        checked = size
                        held = files.held_bytes(skip=(replaced, Path(tmp_name)))
                        files.check_budget(held, size)
                        if free_bytes(self.files_dir) < reserve:
                            raise ApiError(f"not enough free disk space for {what}: less than "
                                           f"{setting} left after "
                                           f"{size >> 20} MiB; upload stopped", status=507)
                    await asyncio.to_thread(out.write, chunk)
            stored = files.store(Path(tmp_name), files_hash)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise
        log.info("build files uploaded", extra={"files_hash": files_hash, "bytes": size,
                                                "kept": stored})
        return Response(status_code=200)

    def _space_reserve(self) -> tuple[int, str]:
        """(bytes, setting) a team's upload or pull leaves free: never less than what the node
        needs to admit a create (AENV_MIN_FREE_DISK_MB), so they cannot refuse other teams'
        creates."""
        reserve, setting = disk_reserve(), "AENV_DISK_RESERVE"
        admission = self.orchestrator.admission
        if admission is not None and admission.min_free_disk_mb << 20 > reserve:
            reserve, setting = admission.min_free_disk_mb << 20, "AENV_MIN_FREE_DISK_MB"
        return reserve, setting

    def _build_of(self, request: Request) -> BuildRecord:
        """The build named by the path's template_id and build_id (404 if they don't match)."""
        self._load()
        template_id = request.path_params["template_id"]
        build_id = request.path_params["build_id"]
        rec = self.builds.get(build_id)
        if rec is None or rec.template_id != template_id or rec.team != scope_team(request.scope):
            raise NotFound(f"build '{build_id}' of template '{template_id}' not found")
        return rec

    async def start(self, request: Request) -> Response:
        from agentenv.template.build import BuildSpecError, parse_steps

        rec = self._build_of(request)
        template_id, build_id = rec.template_id, rec.build_id
        body = await read_model(request, TemplateBuildStartV2)
        if body.fromImage and body.fromTemplate:
            raise BadRequest("give fromImage or fromTemplate, not both")
        if not body.fromImage and not body.fromTemplate:
            raise BadRequest("fromImage or fromTemplate is required")
        builder = self.orchestrator.capabilities.templates
        if body.fromImage and builder is not None and not builder.builds_from_images:
            raise BadRequest(f"this node's {self.orchestrator.backend.name} backend builds "
                             "templates from another template only (fromTemplate); a build "
                             "from an image needs the VM backend")
        if body.fromImageRegistry and body.fromImageRegistry.get("type", "registry") != "registry":
            raise BadRequest(f"registry credentials of type {body.fromImageRegistry.get('type')!r} "
                             "are not supported yet (only type 'registry')")
        try:
            steps = parse_steps(None if body.steps is None else
                                [step.model_dump(exclude_none=True) for step in body.steps])
        except BuildSpecError as exc:
            raise BadRequest(str(exc)) from exc
        files = TeamFiles(self.files_dir, scope_team(request.scope))
        for step in steps:
            if step.files_hash and not files.uploaded(step.files_hash):
                raise BadRequest(f"the files of step '{step.describe()}' (hash {step.files_hash}) "
                                 "were not uploaded")
        if body.fromTemplate:
            parent = self._registered(body.fromTemplate, rec.team)
            if parent is None:
                raise BadRequest(f"template '{body.fromTemplate}' not found")
            if parent.template_id == template_id:
                raise BadRequest("a template cannot be built from itself")
        if rec.status != "waiting":
            raise BadRequest(f"build {build_id} is {rec.status}, not waiting")
        for step in steps:
            if step.files_hash:  # reads the archive: off the event loop
                await asyncio.to_thread(files.verify, step.files_hash, step.args[0],
                                        step.args[1], f"step '{step.describe()}'")
        if rec.status != "waiting":  # started by another request while this one verified
            raise BadRequest(f"build {build_id} is {rec.status}, not waiting")
        rec.status = "building"  # no await since the check: a second start gets the 400 above
        rec.request = _redacted(body.model_dump(exclude_none=True))
        rec.updated_at = time.time()
        self._save(rec)
        task = asyncio.create_task(self._run(rec, steps, body, files.dir),
                                   name=f"build:{build_id}")
        self._tasks[build_id] = task
        task.add_done_callback(lambda t: self._tasks.pop(build_id, None))
        return Response(status_code=202)

    async def status(self, request: Request) -> Response:
        rec = self._build_of(request)
        raw = request.query_params.get("logsOffset", "0")
        try:
            offset = int(raw)
        except ValueError:
            raise BadRequest(f"logsOffset must be an integer, got {raw!r}") from None
        if offset < 0:
            raise BadRequest("logsOffset must not be negative")
        entries = rec.logs_from(offset, LOGS_PER_CALL)
        body: dict[str, Any] = {
            "templateID": rec.template_id, "buildID": rec.build_id, "status": rec.status,
            "logs": [_line(e) for e in entries], "logEntries": [_entry_json(e) for e in entries],
        }
        if rec.status == "error" and rec.reason:
            body["reason"] = {k: v for k, v in rec.reason.items() if v is not None}
        return JSONResponse(body)

    async def alias(self, request: Request) -> Response:
        self._load()
        alias = request.path_params["alias"]
        tpl = self._registered(alias, scope_team(request.scope))
        if tpl is not None:
            return JSONResponse({"templateID": tpl.template_id, "public": False})
        pending = self._pending_template(alias, scope_team(request.scope))
        if pending is not None and pending.status in ACTIVE:
            return JSONResponse({"templateID": pending.template_id, "public": False})
        raise NotFound(f"template alias '{alias}' not found")

    # --- listing, detail, delete -------------------------------------------------------------

    def _template_json(self, tpl: TemplateRecord | None, builds: list[BuildRecord]
                       ) -> dict[str, Any]:
        if tpl is not None:
            body = models.template_json(tpl)
            if builds:
                latest = builds[0]
                body["buildID"] = latest.build_id
                body["buildStatus"] = latest.status
                body["buildCount"] = len(builds)
            return body
        latest = builds[0]
        return {
            "templateID": latest.template_id, "buildID": latest.build_id,
            "cpuCount": latest.cpu_count, "memoryMB": latest.memory_mb,
            "diskSizeMB": latest.disk_size_mb, "public": False, "aliases": [latest.name],
            "names": [latest.name], "createdAt": models.iso(min(b.created_at for b in builds)),
            "updatedAt": models.iso(latest.updated_at), "createdBy": None,
            "lastSpawnedAt": None, "spawnCount": 0, "buildCount": len(builds),
            "envdVersion": latest.envd_version or "unknown", "buildStatus": latest.status,
        }

    def _all_templates(self, team: str) -> list[tuple[float, str, dict[str, Any]]]:
        """The templates `team` sees, with the builds of its own under way or failed."""
        out = []
        for tpl in self.catalogue.templates.values():
            if tpl.kind == "template" and self.catalogue.visible(tpl, team):
                out.append((tpl.created_at, tpl.template_id,
                            self._template_json(tpl, self._builds_of(tpl.template_id))))
        seen = set(self.catalogue.templates)
        for rec in self.builds.values():
            if rec.template_id not in seen and rec.team == team:
                seen.add(rec.template_id)
                builds = self._builds_of(rec.template_id)
                if builds and (any(b.status in ACTIVE for b in builds)
                               or builds[0].status == "error"):
                    out.append((min(b.created_at for b in builds), rec.template_id,
                                self._template_json(None, builds)))
        return out

    async def list_v1(self, request: Request) -> Response:
        self._load()
        return JSONResponse([body for _, _, body in sorted(self._all_templates(scope_team(request.scope)),
                                                           key=lambda x: (x[0], x[1]))])

    async def list_v2(self, request: Request) -> Response:
        self._load()
        items, token = page(self._all_templates(scope_team(request.scope)), lambda x: (x[0], x[1]), request, True)
        headers = {"X-Next-Token": token} if token else None
        return JSONResponse([body for _, _, body in items], headers=headers)

    async def detail(self, request: Request) -> Response:
        self._load()
        id_or_name = request.path_params["template_id"]
        tpl = self._registered(id_or_name, scope_team(request.scope))
        builds = self._builds_of(tpl.template_id) if tpl else []
        if tpl is None:
            pending = self._pending_template(id_or_name, scope_team(request.scope))
            if pending is None:
                raise NotFound(f"template '{id_or_name}' not found")
            builds = self._builds_of(pending.template_id)
        body = self._template_json(tpl, builds)
        if tpl is not None and not builds:
            body["builds"] = models.template_detail_json(tpl)["builds"]
        else:
            body["builds"] = [{
                "buildID": b.build_id, "status": b.status, "createdAt": models.iso(b.created_at),
                "updatedAt": models.iso(b.updated_at),
                **({"finishedAt": models.iso(b.finished_at)} if b.finished_at else {}),
                "cpuCount": b.cpu_count, "memoryMB": b.memory_mb, "diskSizeMB": b.disk_size_mb,
                "envdVersion": b.envd_version or "unknown",
            } for b in builds]
        return JSONResponse(body)

    async def delete(self, request: Request) -> Response:
        self._load()
        id_or_name = request.path_params["template_id"]
        tpl = self._registered(id_or_name, scope_team(request.scope))
        template_id = tpl.template_id if tpl else None
        if template_id is None:
            pending = self._pending_template(id_or_name, scope_team(request.scope))
            template_id = pending.template_id if pending else None
        if template_id is None:
            raise NotFound(f"template '{id_or_name}' not found")
        if tpl is not None and tpl.kind == "template" and (
                self.catalogue.is_builtin(template_id)
                or tpl.ref.data.get("builtin")):
            raise BadRequest(f"template '{id_or_name}' is built into this node and cannot "
                             "be deleted")
        for rec in self._builds_of(template_id):
            task = self._tasks.get(rec.build_id)
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if tpl is not None:
            await self.catalogue.delete(template_id, scope_team(request.scope))
        for rec in self._builds_of(template_id, released=True):
            self.builds.pop(rec.build_id, None)
            (self.builds_dir / f"{rec.build_id}.json").unlink(missing_ok=True)
        return Response(status_code=204)

    # --- tags (node/template_tags.py) --------------------------------------------------------

    def _newest_ready(self, template_id: str) -> str | None:
        ready = [b for b in self._builds_of(template_id) if b.status == "ready"]
        return ready[0].build_id if ready else None

    def _builtin(self, tpl: TemplateRecord) -> bool:
        return self.catalogue.is_builtin(tpl.template_id) or \
            bool(tpl.ref.data.get("builtin"))

    async def _tagged_template(self, id_or_name: str, team: str,
                               change: bool = True) -> TemplateRecord:
        """A registered template built through this API (its tag records made if it predates
        them). Snapshots and built-in templates have no tags: 400 when `change`-ing them."""
        tpl = self._registered(id_or_name, team)
        if tpl is None:
            pending = self._pending_template(id_or_name, team)
            if pending is not None:
                raise NotFound(f"template '{id_or_name}' has no ready build yet ({pending.build_id}"
                               f" is {pending.status}): tags name ready builds")
            raise NotFound(f"template '{id_or_name}' not found")
        if not change and (tpl.kind != "template" or self._builtin(tpl)):
            return tpl
        if tpl.kind != "template":
            raise BadRequest(f"'{id_or_name}' is a sandbox snapshot, not a template: "
                             "snapshots have no tags")
        if self._builtin(tpl):
            raise BadRequest(f"template '{id_or_name}' is built into this node: it has no tags")
        await self.catalogue.tags.adopt_untagged(
            tpl.template_id, self._newest_ready(tpl.template_id))
        return self.catalogue.templates[tpl.template_id]

    async def tags(self, request: Request) -> Response:
        self._load()
        id_or_name = request.path_params["template_id"]
        if ":" in id_or_name:
            raise BadRequest(f"give a template id or name without a tag, not {id_or_name!r}")
        tpl = await self._tagged_template(split_tag(id_or_name)[0], scope_team(request.scope), change=False)
        return JSONResponse([
            {"tag": t.tag, "buildID": t.build_id, "createdAt": models.iso(t.assigned_at)}
            for t in self.catalogue.tags.of(tpl.template_id)])

    async def assign_tags(self, request: Request) -> Response:
        self._load()
        body = await read_model(request, AssignTemplateTagsRequest)
        name, source = split_tag(body.target)
        if not name:
            raise BadRequest("target must be 'name:tag' (or 'name' for its default build)")
        if not body.tags:
            raise BadRequest("tags must name at least one tag to assign")
        tags = normalize_tags(body.tags)
        source = DEFAULT_TAG if source is None or not source.strip() else source
        tpl = await self._tagged_template(name, scope_team(request.scope))
        build = await self.catalogue.tags.assign(tpl.template_id, source, tags)
        log.info("template tags assigned", extra={"template_id": tpl.template_id,
                                                  "build_id": build.build_id, "tags": tags})
        return JSONResponse({"tags": tags, "buildID": build.build_id}, status_code=201)

    async def remove_tags(self, request: Request) -> Response:
        self._load()
        body = await read_model(request, DeleteTemplateTagsRequest)
        name, tag = split_tag(body.name)
        if tag is not None:
            raise BadRequest(f"name is a template name without a tag, not {body.name!r}; "
                             "list the tags to remove in tags")
        if not body.tags:
            raise BadRequest("tags must name at least one tag to remove")
        tags = normalize_tags(body.tags)
        tpl = await self._tagged_template(name, scope_team(request.scope))
        await self.catalogue.tags.remove(tpl.template_id, tags)
        log.info("template tags removed", extra={"template_id": tpl.template_id, "tags": tags})
        return Response(status_code=204)

    # --- the build itself --------------------------------------------------------------------

    async def _run(self, rec: BuildRecord, steps: list[Any], body: TemplateBuildStartV2,
                   files_dir: Path) -> None:
        from agentenv.template.build import BASE_STEP, BuildFailed

        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        t0 = time.monotonic()
        self._build_event(BUILD_STARTED, rec)
        try:
            if self._slots.locked():
                rec.log("info", "waiting for another build to finish", BASE_STEP)
            async with self._slots:
                await self._build_in_time(rec, steps, body, files_dir)
        except BuildFailed as exc:
            self._fail(rec, exc.message, exc.step)
        except asyncio.CancelledError:
            self._fail(rec, "the build was cancelled", None)
            raise
        except (AgentEnvError, BackendError) as exc:
            self._fail(rec, str(exc), BASE_STEP)
        except Exception as exc:
            log.exception("template build crashed", extra={"build_id": rec.build_id})
            self._fail(rec, f"internal error: {type(exc).__name__}: {exc}", None)
        else:
            self._build_event(BUILD_FINISHED, rec, seconds=round(time.monotonic() - t0, 1))
            rec.log("info", f"build ready in {time.monotonic() - t0:.1f} s", None)
            log.info("template built", extra={"template_id": rec.template_id,
                                              "build_id": rec.build_id,
                                              "seconds": round(time.monotonic() - t0, 1)})
        finally:
            self._save(rec)
            self.catalogue.collect_soon()  # its uploads may be unused now (node/gc.py)

    async def _build_in_time(self, rec: BuildRecord, steps: list[Any],
                             body: TemplateBuildStartV2, files_dir: Path) -> None:
        """`_build` within the build deadline; past it, the build is cancelled (which kills
        its VM) and fails."""
        from agentenv.template.build import BuildFailed

        try:
            async with asyncio.timeout(self.build_timeout or None) as limit:
                await self._build(rec, steps, body, files_dir)
        except TimeoutError:
            if not limit.expired():
                raise
            raise BuildFailed(f"the build did not finish within {self.build_timeout:g} s "
                              f"({BUILD_TIMEOUT_ENV}); its VM was stopped", None) from None

    def _build_event(self, kind: str, rec: BuildRecord, **data: Any) -> None:
        if self.orchestrator.events is not None:
            self.orchestrator.events.record(Event(
                type=kind, team=rec.team, template_id=rec.template_id, build_id=rec.build_id,
                data={"name": rec.name, **data}))

    def _fail(self, rec: BuildRecord, message: str, step: str | None) -> None:
        rec.status = "error"
        rec.reason = {"message": message, "step": step}
        rec.log("error", message, step)
        rec.finished_at = rec.updated_at = time.time()
        self._build_event(BUILD_FAILED, rec, reason=rec.reason)
        log.warning("template build failed", extra={"template_id": rec.template_id,
                                                    "build_id": rec.build_id, "error": message})

    async def _build(self, rec: BuildRecord, steps: list[Any], body: TemplateBuildStartV2,
                     files_dir: Path) -> None:
        from agentenv.envd_client import EnvdClient
        from agentenv.template.build import BASE_STEP, BuildContext, StepRunner

        backend = self.orchestrator.backend
        builder = self.orchestrator.capabilities.templates
        assert builder is not None  # builds are refused at the request otherwise
        vm_id = new_id("b")
        placement = None
        envd = None
        try:
            if body.fromTemplate:
                parent = self.catalogue.resolve(body.fromTemplate, rec.team)
                rec.log("info", f"FROM template {parent.names[0] if parent.names else parent.template_id}"
                        f" ({parent.template_id})", BASE_STEP)
                if (rec.cpu_count, rec.memory_mb) != (parent.cpu_count, parent.memory_mb):
                    rec.log("warn", f"the VM keeps the base template's size ({parent.cpu_count} "
                            f"vCPUs, {parent.memory_mb} MiB): a snapshot cannot be resized",
                            BASE_STEP)
                rec.cpu_count, rec.memory_mb = parent.cpu_count, parent.memory_mb
                rec.disk_size_mb = parent.disk_size_mb
                context = BuildContext.from_json(
                    self._context_of(parent.template_id, parent.build_id) or {})
                spec = SandboxSpec(
                    sandbox_id=vm_id, source=parent.ref, cpu_count=parent.cpu_count,
                    memory_mb=parent.memory_mb, disk_size_mb=parent.disk_size_mb, env_vars={},
                    access_token=None, allow_internet_access=True, metadata={})
                placement = await self._start_vm(rec, vm_id, lambda: backend.create(spec))
            else:
                assert body.fromImage is not None
                lowers, disk_bytes, config = await self._pull(rec, body)
                rec.disk_size_mb = disk_bytes >> 20
                context = BuildContext.from_image_config(config)
                rec.log("info", f"booting the build VM ({rec.cpu_count} vCPUs, "
                        f"{rec.memory_mb} MiB)", BASE_STEP)
                t0 = time.monotonic()
                placement = await self._start_vm(rec, vm_id, lambda: builder.boot_image(
                    vm_id, lowers, disk_bytes, rec.cpu_count, rec.memory_mb))
                rec.log("info", f"build VM up in {time.monotonic() - t0:.1f} s", BASE_STEP)
            rec.envd_version = placement.envd_version
            envd = EnvdClient(placement.envd_url)
            runner = StepRunner(envd, context, rec.log, files_dir)
            try:
                await runner.prepare()
                await runner.run_steps(steps)
                await runner.start_and_wait_ready(body.startCmd, body.readyCmd)
                await runner.finish()
            finally:
                await runner.detach()
            rec.log("info", "pausing the VM into the template's snapshot", None)
            ref = await builder.capture_template(vm_id)
            placement = None  # the VM is gone; its snapshot is the template's
            await self._publish(rec, ref, context)
        finally:
            if envd is not None:
                await envd.close()
            if placement is not None:
                with contextlib.suppress(Exception):
                    await backend.kill(vm_id, placement)

    async def _start_vm(self, rec: BuildRecord, vm_id: str,
                        start: Callable[[], Awaitable[Any]]) -> Any:
        """Start the build VM; one more try when the first fails (seen on loaded hosts: QEMU's
        spawn failing in its network namespace, a TCG assertion at boot)."""
        from agentenv.template.build import BASE_STEP

        try:
            return await start()
        except Exception as exc:
            rec.log("warn", f"starting the build VM failed ({type(exc).__name__}: {exc}); "
                    "trying once more", BASE_STEP)
            log.warning("build VM start failed, retrying",
                        extra={"build_id": rec.build_id, "error": repr(exc)})
            with contextlib.suppress(Exception):
                await self.orchestrator.backend.kill(vm_id, None)
        return await start()

    async def _pull(self, rec: BuildRecord, body: TemplateBuildStartV2) -> tuple[list[Path], int, dict[str, Any]]:
        from agentenv.template.build import BASE_STEP, BuildFailed
        from agentenv.template.convert import VIRTUAL_SIZE
        from agentenv.template.layercache import layer_cache_dir
        from agentenv.template.pull import pull_image

        assert body.fromImage is not None
        rec.log("info", f"FROM image {body.fromImage}: pulling", BASE_STEP)
        credentials = None
        creds = body.fromImageRegistry or {}
        if creds.get("username") or creds.get("password"):
            # In memory for this pull only: no docker config file, nothing in the record.
            credentials = Credentials(str(creds.get("username", "")), str(creds.get("password", "")))
        try:
            # Never the node's docker config: a team pulls with what its request carries only.
            pulled = await asyncio.to_thread(
                pull_image, body.fromImage, state_dir=self.state_dir,
                cache_dir=layer_cache_dir(self.state_dir), credentials=credentials,
                use_docker_config=False, team=rec.team, reserve=self._space_reserve())
        except AgentEnvError as exc:
            raise BuildFailed(f"pulling {body.fromImage} failed: {exc}", BASE_STEP) from exc
        rec.log("info", f"pulled {pulled.reference} ({pulled.manifest_digest[:19]}): "
                f"{pulled.layers_converted} layers converted, {pulled.layers_cached} cached, "
                f"{pulled.layers_fetched} overlaybd layers fetched as they are, "
                f"{pulled.bytes_downloaded / 1e6:.1f} MB in {pulled.seconds:.1f} s", BASE_STEP)
        if pulled.format == "converted":
            disk_bytes = VIRTUAL_SIZE
        else:
            from agentenv.storage.layer import inspect_layer

            disk_bytes = int(inspect_layer(pulled.lowers[-1])["virtual_size"])
        return pulled.lowers, disk_bytes, pulled.config

    async def _publish(self, rec: BuildRecord, ref: Any, context: Any) -> None:
        """Register the build under its tags (a new template, or its new "default" snapshot);
        the build no tag names any more is released (node/template_tags.py)."""
        old = self.catalogue.get(rec.template_id)
        now = time.time()
        tpl = TemplateRecord(
            template_id=rec.template_id, kind="template", names=[rec.name], ref=ref,
            cpu_count=rec.cpu_count, memory_mb=rec.memory_mb, disk_size_mb=rec.disk_size_mb,
            envd_version=rec.envd_version or self.orchestrator.config.default_envd_version,
            created_at=old.created_at if old else now, updated_at=now,
            spawn_count=old.spawn_count if old else 0,
            last_spawned_at=old.last_spawned_at if old else None, build_status="ready",
            team=rec.team)
        build = BuildSnapshot(
            build_id=rec.build_id, template_id=rec.template_id, ref=ref, cpu_count=rec.cpu_count,
            memory_mb=rec.memory_mb, disk_size_mb=rec.disk_size_mb, envd_version=tpl.envd_version,
            created_at=rec.created_at)
        try:
            if old is not None:
                await self.catalogue.tags.adopt_untagged(
                    rec.template_id, self._newest_ready(rec.template_id))
            await self.catalogue.tags.publish(tpl, build, rec.tags or [DEFAULT_TAG])
        except BaseException:
            with contextlib.suppress(Exception):
                await self.orchestrator.backend.delete_snapshot(ref)
            raise
        rec.context = context.to_json()
        rec.status = "ready"
        rec.finished_at = rec.updated_at = time.time()
        if self.on_published is not None:  # AENV_SNAPSHOT_PUBLISH (node/snapshot_api.py)
            self.on_published(rec.name, rec.build_id, rec.template_id)
