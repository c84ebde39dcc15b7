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
import logging
import re
import time
import uuid
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentenv.api import models, paging
from agentenv.api.bodies import Endpoint, read_model
from agentenv.api.errors import BadRequest, Conflict, NotFound
from agentenv.api.template_models import (
    TemplateBuildRequestV3,
    TemplateBuildStartV2,
)
from agentenv.api.tenancy import scope_team
from agentenv.envd_client import ColdMemory
from agentenv.node import views
from agentenv.node.build_records import (
    ACTIVE,
    BuildRecord,
    BuildRecords,
    entry_json,
    log_line,
    redacted,
)
from agentenv.node.build_runner import BuildRunner
from agentenv.node.build_tags import TagRoutes
from agentenv.node.build_uploads import BuildUploads
from agentenv.node.idle import parse_seconds
from agentenv.node.orchestrator import Orchestrator
from agentenv.node.records import DEFAULT_TAG, TemplateRecord
from agentenv.node.security import new_id
from agentenv.node.template_files import TeamFiles
from agentenv.node.template_tags import normalize_tags, split_tag
from agentenv.template.build import BuildSpecError, parse_steps

log = logging.getLogger("agentenv.node.template_api")

LOGS_PER_CALL = 100  # the SDK keeps polling until a call returns no entries
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class TemplateBuildApi:
    """The routes of the build API; the records (build_records.py), the uploads
    (build_uploads.py), the tags (build_tags.py) and the builds (build_runner.py) are parts
    of their own. Its handlers are wired in by node/server.py."""

    def __init__(self, orchestrator: Orchestrator, state_dir: Path, api_key: str) -> None:
        self.orchestrator = orchestrator
        self.catalogue = orchestrator.catalogue
        #: the backend's optional capabilities, resolved once at assembly (node/server.py)
        self.capabilities = orchestrator.capabilities
        #: the node's settings (node/orchestrator.py NodeConfig), fixed once it is assembled
        self.config = orchestrator.config
        self.records = BuildRecords(self.catalogue, state_dir)
        self.uploads = BuildUploads(orchestrator, self.records, api_key)
        self.runner = BuildRunner(orchestrator, self.records, state_dir)
        self.tag_routes = TagRoutes(self.records)

    def handlers(self) -> dict[str, Endpoint]:
        """The operations of the route table (agentenv.api.routes) this serves."""
        return {
            "createTemplateV3": self.create, "assignTemplateTags": self.tag_routes.assign_tags,
            "deleteTemplateTags": self.tag_routes.remove_tags, "getTemplateByAlias": self.alias,
            "getTemplateFilesUploadLink": self.uploads.file_link,
            "uploadTemplateFiles": self.uploads.upload,
            "startTemplateBuildV2": self.start, "getTemplateBuildStatus": self.status,
            "getTemplateTags": self.tag_routes.tags, "listTemplates": self.list_v1,
            "listTemplatesV2": self.list_v2, "getTemplate": self.detail,
            "deleteTemplate": self.delete,
        }

    async def create(self, request: Request) -> Response:
        self.records.load()
        body = await read_model(request, TemplateBuildRequestV3)
        name = body.name or body.alias
        if not name:
            raise BadRequest("the template's name is required")
        name, name_tag = split_tag(name)  # "team/name:tag": this node has one team
        tags = normalize_tags(([name_tag] if name_tag is not None else []) + (body.tags or []))
        if not _NAME.match(name):
            raise BadRequest(f"invalid template name {name!r}: letters, digits, '.', '_' and '-'")
        idle_after = None if body.idlePauseAfter is None else parse_seconds(
            body.idlePauseAfter, "idlePauseAfter", self.config.max_timeout)
        if self.capabilities.templates is None:
            raise BadRequest(f"template builds need the VM backend; this node runs the "
                             f"'{self.orchestrator.backend_name}' backend")
        team = scope_team(request.scope)
        existing = self.records.registered(name, team)
        if existing is not None:
            if existing.kind != "template" or self.records.builtin(existing):
                raise BadRequest(f"name {name!r} is taken by {existing.kind} "
                                 f"{existing.template_id}, which cannot be rebuilt")
            template_id = existing.template_id
            cpu = body.cpuCount or existing.cpu_count
            memory = body.memoryMB or existing.memory_mb
            # a rebuild keeps the template's setting unless the request names one
            kept = (self.records.context_of(template_id, existing.build_id) or {}).get("coldMemory")
            cold = body.coldMemory or (ColdMemory.model_validate(kept) if kept else None)
        else:
            pending = self.records.pending(name, team)
            if pending is None:
                self.orchestrator.check_quota("templates", self.records.template_count(team))
            template_id = pending.template_id if pending else new_id("t")
            cpu, memory = body.cpuCount or 2, body.memoryMB or 1024
            cold = body.coldMemory
        for other in self.records.of(template_id):
            if other.status == "building":
                raise Conflict(f"template {name!r} has a build in progress ({other.build_id})")
            if other.status == "waiting":  # requested but never started: superseded
                other.status = "error"
                other.reason = {"message": "superseded by a newer build request"}
                other.finished_at = other.updated_at = time.time()
                self.records.save(other)
        tags = tags or [DEFAULT_TAG]
        self.catalogue.tags.check_room(template_id, tags)
        if existing is None and DEFAULT_TAG not in tags:
            tags.insert(0, DEFAULT_TAG)  # a template's first build is what its name means
        now = time.time()
        rec = BuildRecord(template_id=template_id, build_id=str(uuid.uuid4()), name=name,
                          cpu_count=cpu, memory_mb=memory, status="waiting", created_at=now,
                          updated_at=now, tags=tags, team=team, idle_pause_after=idle_after,
                          cold_memory=cold.model_dump() if cold else None)
        self.records.builds[rec.build_id] = rec
        self.records.save(rec)
        self.records.purge_finished(team)
        log.info("template build requested",
                 extra={"template_id": template_id, "build_id": rec.build_id, "template_name": name})
        return JSONResponse({"templateID": template_id, "buildID": rec.build_id, "public": False,
                             "names": [name], "tags": tags, "aliases": [name]}, status_code=202)

    def _build_of(self, request: Request) -> BuildRecord:
        """The build named by the path's template_id and build_id (404 if they don't match)."""
        self.records.load()
        template_id = request.path_params["template_id"]
        build_id = request.path_params["build_id"]
        rec = self.records.builds.get(build_id)
        if rec is None or rec.template_id != template_id or rec.team != scope_team(request.scope):
            raise NotFound(f"build '{build_id}' of template '{template_id}' not found")
        return rec

    async def start(self, request: Request) -> Response:
        rec = self._build_of(request)
        template_id, build_id = rec.template_id, rec.build_id
        body = await read_model(request, TemplateBuildStartV2)
        if body.fromImage and body.fromTemplate:
            raise BadRequest("give fromImage or fromTemplate, not both")
        if not body.fromImage and not body.fromTemplate:
            raise BadRequest("fromImage or fromTemplate is required")
        builder = self.capabilities.templates
        if body.fromImage and builder is not None and not builder.builds_from_images:
            raise BadRequest(f"this node's {self.orchestrator.backend_name} backend builds "
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
        files = TeamFiles(self.records.files_dir, scope_team(request.scope))
        for step in steps:
            if step.files_hash and not files.uploaded(step.files_hash):
                raise BadRequest(f"the files of step '{step.describe()}' (hash {step.files_hash}) "
                                 "were not uploaded")
        if body.fromTemplate:
            parent = self.records.registered(body.fromTemplate, rec.team)
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
        rec.request = redacted(body.model_dump(exclude_none=True))
        rec.updated_at = time.time()
        self.records.save(rec)
        task = asyncio.create_task(self.runner.run(rec, steps, body, files.dir),
                                   name=f"build:{build_id}")
        self.runner.tasks[build_id] = task
        task.add_done_callback(lambda t: self.runner.tasks.pop(build_id, None))
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
            "logs": [log_line(e) for e in entries], "logEntries": [entry_json(e) for e in entries],
        }
        if rec.status == "error" and rec.reason:
            body["reason"] = {k: v for k, v in rec.reason.items() if v is not None}
        return JSONResponse(body)

    async def alias(self, request: Request) -> Response:
        self.records.load()
        alias = request.path_params["alias"]
        tpl = self.records.registered(alias, scope_team(request.scope))
        if tpl is not None:
            return JSONResponse({"templateID": tpl.template_id, "public": False})
        pending = self.records.pending(alias, scope_team(request.scope))
        if pending is not None and pending.status in ACTIVE:
            return JSONResponse({"templateID": pending.template_id, "public": False})
        raise NotFound(f"template alias '{alias}' not found")

    def _template_json(self, tpl: TemplateRecord | None, builds: list[BuildRecord]
                       ) -> dict[str, Any]:
        if tpl is not None:
            body = views.template_json(tpl)
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
                            self._template_json(tpl, self.records.of(tpl.template_id))))
        seen = set(self.catalogue.templates)
        for rec in self.records.builds.values():
            if rec.template_id not in seen and rec.team == team:
                seen.add(rec.template_id)
                builds = self.records.of(rec.template_id)
                if builds and (any(b.status in ACTIVE for b in builds)
                               or builds[0].status == "error"):
                    out.append((min(b.created_at for b in builds), rec.template_id,
                                self._template_json(None, builds)))
        return out

    async def list_v1(self, request: Request) -> Response:
        self.records.load()
        return JSONResponse([body for _, _, body in sorted(self._all_templates(scope_team(request.scope)),
                                                           key=lambda x: (x[0], x[1]))])

    async def list_v2(self, request: Request) -> Response:
        self.records.load()
        items, token = paging.page(self._all_templates(scope_team(request.scope)),
                                   lambda x: (x[0], x[1]), request.query_params.get("nextToken"),
                                   paging.page_limit(request.query_params), True)
        headers = {"X-Next-Token": token} if token else None
        return JSONResponse([body for _, _, body in items], headers=headers)

    async def detail(self, request: Request) -> Response:
        self.records.load()
        id_or_name = request.path_params["template_id"]
        tpl = self.records.registered(id_or_name, scope_team(request.scope))
        builds = self.records.of(tpl.template_id) if tpl else []
        if tpl is None:
            pending = self.records.pending(id_or_name, scope_team(request.scope))
            if pending is None:
                raise NotFound(f"template '{id_or_name}' not found")
            builds = self.records.of(pending.template_id)
        body = self._template_json(tpl, builds)
        if tpl is not None and not builds:
            body["builds"] = views.template_detail_json(tpl)["builds"]
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
        self.records.load()
        id_or_name = request.path_params["template_id"]
        tpl = self.records.registered(id_or_name, scope_team(request.scope))
        template_id = tpl.template_id if tpl else None
        if template_id is None:
            pending = self.records.pending(id_or_name, scope_team(request.scope))
            template_id = pending.template_id if pending else None
        if template_id is None:
            raise NotFound(f"template '{id_or_name}' not found")
        if tpl is not None and tpl.kind == "template" and (
                self.catalogue.is_builtin(template_id)
                or tpl.ref.data.get("builtin")):
            raise BadRequest(f"template '{id_or_name}' is built into this node and cannot "
                             "be deleted")
        for rec in self.records.of(template_id):
            task = self.runner.tasks.get(rec.build_id)
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if tpl is not None:
            await self.catalogue.delete(template_id, scope_team(request.scope))
        for rec in self.records.of(template_id, released=True):
            self.records.builds.pop(rec.build_id, None)
            (self.records.builds_dir / f"{rec.build_id}.json").unlink(missing_ok=True)
        return Response(status_code=204)
