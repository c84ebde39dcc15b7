"""Snapshots that move between nodes: the node's side of `aenv snapshot push/pull`.

    POST /aenv/snapshots/push {snapshot, ref}      -> {ref, snapshot, parts, bytes, bytes_sent, digest}
    POST /aenv/snapshots/pull {ref, name?, download?}
                                                   -> {templateID, names, snapshot, bytes_fetched,
                                                       bytes_total, lazy_parts}
    POST /aenv/snapshots/delete {ref}              -> {ref, digest, deleted}

`snapshot` is a template (id, name or name:tag: its build snapshot), an API snapshot (its
id or name) or a paused sandbox (its pause snapshot). `ref` is a registry reference
(`host/repo:tag`) or a shared directory (`dir:///path/NAME`, or an absolute path); see
snapshot/repository.py. A pulled snapshot is registered as a template of kind "snapshot", so
`Sandbox.create(name or templateID)` restores it on this node (VM backend only). From a
registry, its memory and disk layers stay remote (blockd's chunk cache fetches what a restore
touches) unless `download` is true.

Tokens. The snapshot's envd holds the token of the sandbox it was taken from, and the artifact
carries it (`guest_token` in its meta: the node needs it for the first /init, and the memory
image holds it anyway). Every restore re-keys: envd's /init, authenticated with that token,
sets the new sandbox's own, so the token read from the repository opens no restored sandbox.

AENV_SNAPSHOT_PUBLISH=PREFIX publishes every template build once it is ready, to
`PREFIX/<team>/<template name>:<build id>` (a registry repository prefix) or
`PREFIX/<team>/<template name>-<build id>` (a shared directory): template names are per team,
so the team is part of the repository's name, and under PREFIX a team pushes and pulls only
its own (`PREFIX/<team>/...`; anything else under PREFIX is another team's: 404 for a pull,
400 for a push, 403 for a delete). The same holds under AENV_SNAPSHOT_REPOSITORY when the node
knows it (the cluster's snapshot repository, where the gateway has nodes push a batch's
snapshot for its spill-over, PREFIX/<team>/spill:<id>). A delete (the gateway's, when the team
deletes a spilled snapshot) removes the reference's manifest from its registry; a cluster's
team deletes only under its own part of a repository (PREFIX/<team>/NAME), and with no node
credentials, as it pushes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentenv.api.bodies import Endpoint, read_json
from agentenv.api.errors import ApiError, BadRequest, Conflict, NotFound
from agentenv.api.tenancy import LOCAL_TEAM, scope_team
from agentenv.errors import AgentEnvError
from agentenv.node.backend import TemplateRef
from agentenv.node.orchestrator import Orchestrator
from agentenv.node.records import TemplateRecord
from agentenv.node.security import new_id
from agentenv.node.vm_backend import VmBackend
from agentenv.registry.reference import parse_reference
from agentenv.settings import get_settings
from agentenv.snapshot import repository
from agentenv.template.layeraccess import LayerAccess
from agentenv.template.layercache import layer_cache_dir

log = logging.getLogger("agentenv.node.snapshot_api")

PUBLISH_ENV = "AENV_SNAPSHOT_PUBLISH"
REPOSITORY_ENV = "AENV_SNAPSHOT_REPOSITORY"


def published_ref(prefix: str, team: str, template_name: str, build_id: str) -> str:
    """Where a team's template build is published under PREFIX (AENV_SNAPSHOT_PUBLISH)."""
    prefix = prefix.rstrip("/")
    tag = "-" if prefix.startswith(("/", "dir://")) else ":"
    return f"{prefix}/{team}/{template_name}{tag}{build_id}"


def _location(ref: str) -> str:
    """A repository reference in one form, to compare with the publish prefix: a directory's
    normalised path (no `..` left to climb out of a team's directory), a registry's lowercase
    `host/repository` (OCI repositories are lowercase)."""
    ref = ref.strip()
    if ref.startswith(("dir://", "/")):
        return "dir:" + os.path.normpath(ref.removeprefix("dir://"))
    return "oci:" + ref.removeprefix("oci://").lower()


def _team_prefixes() -> list[tuple[str, str, str]]:
    """(prefix, its setting, what lives there) of the repositories whose PREFIX/<team>/ parts
    are the teams' own: the published builds and, when the node knows it, the cluster's
    snapshot repository (the gateway's spill-overs)."""
    settings = get_settings()
    found = [(settings.snapshot_publish, PUBLISH_ENV, "the published snapshots"),
             (settings.snapshot_repository, REPOSITORY_ENV, "the cluster's snapshot repository")]
    return [(prefix.strip().rstrip("/"), env, what) for prefix, env, what in found
            if prefix.strip().rstrip("/")]


def outside_team_scope(ref: str, team: str) -> str | None:
    """Why `team` may not push to, pull from or delete `ref`: it is under the publish prefix
    (or the cluster's snapshot repository, set on the node) but not in the team's own part of
    it (PREFIX/<team>/); None otherwise."""
    where = _location(ref)
    for prefix, env, what in _team_prefixes():
        base = _location(prefix)
        if where != base and not where.startswith(base + "/"):
            continue  # not there: the caller's own repository
        if where.startswith(f"{base}/{team}/"):
            continue
        return (f"{ref!r} is under {what} ({env}) but not this team's: a team's are under "
                f"{prefix}/{team}/")
    return None


def not_the_teams(ref: str, team: str) -> str | None:
    """Why a team of a cluster may not delete `ref`: a team deletes only in a repository of
    its own name's part of a prefix (PREFIX/<team>/NAME, as the gateway names what it has a
    node push for the team: PREFIX/<team>/spill:<snapshot id>); None when it may."""
    try:
        reference = parse_reference(repository.parse_ref(ref).location)
    except AgentEnvError as exc:
        return str(exc)
    parts = reference.repository.split("/")
    if len(parts) >= 2 and parts[-2] == team:
        return None
    return (f"{ref!r} is not this team's to delete: a team deletes only references under its "
            f"own part of a repository (PREFIX/{team}/NAME)")


class SnapshotMoveApi:
    def __init__(self, orchestrator: Orchestrator, state_dir: Path) -> None:
        self.orchestrator = orchestrator
        #: the templates and snapshots pulled ones join (node/catalogue.py)
        self.catalogue = orchestrator.catalogue
        #: the node's settings (node/orchestrator.py NodeConfig), fixed once it is assembled
        self.config = orchestrator.config
        #: which team may use which blob the node holds (template/layeraccess.py)
        self.access = LayerAccess(layer_cache_dir(state_dir))
        self._publishing: set[asyncio.Task[None]] = set()

    def handlers(self) -> dict[str, Endpoint]:
        """The operations of the route table (agentenv.api.routes) this serves."""
        return {"pushSnapshot": self.push, "pullSnapshot": self.pull,
                "deleteSnapshotRef": self.delete}

    def _backend(self) -> VmBackend:
        backend = self.orchestrator.backend
        if not isinstance(backend, VmBackend):
            raise BadRequest("snapshots move between nodes with the VM backend only")
        return backend

    def _resolve(self, name: str, team: str) -> tuple[TemplateRef, dict[str, Any]]:
        """The snapshot behind a template, API snapshot or paused sandbox of `team`, and its
        metadata."""
        rec = self.orchestrator.sandbox(name)
        if rec is not None and rec.team == team:
            if rec.pause_snapshot is None:
                raise Conflict(f"sandbox {name!r} is not paused: pause it, or snapshot it "
                               "(POST /sandboxes/{id}/snapshots) and push the snapshot")
            # Its envd holds the sandbox's own token: the first /init of a copy must show it.
            return rec.pause_snapshot, {"cpu_count": rec.cpu_count, "memory_mb": rec.memory_mb,
                                        "disk_size_mb": rec.disk_size_mb,
                                        "envd_version": rec.envd_version, "names": [],
                                        "guest_token": rec.envd_access_token}
        try:
            tpl = self.catalogue.resolve(name, team)
        except ApiError as exc:
            raise NotFound(f"no template, snapshot or paused sandbox {name!r}") from exc
        return tpl.ref, {"cpu_count": tpl.cpu_count, "memory_mb": tpl.memory_mb,
                         "disk_size_mb": tpl.disk_size_mb, "envd_version": tpl.envd_version,
                         "names": list(tpl.names), "guest_token": tpl.ref.data.get("guest_token")}

    @staticmethod
    def _check_repository(ref: str, team: str) -> None:
        """A shared directory is a path on this node, open to whoever names it: only the
        standalone node's own team (`local`) may push to or pull from one."""
        try:
            kind = repository.parse_ref(ref).kind
        except AgentEnvError as exc:
            raise BadRequest(str(exc)) from exc
        if kind == "dir" and team != LOCAL_TEAM:
            raise BadRequest(f"{ref!r}: shared-directory repositories are not open to the teams "
                             "of a cluster (every team of the node could read and write them): "
                             "use a registry")

    async def _body(self, request: Request, *required: str) -> dict[str, Any]:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        for key in required:
            if not isinstance(body.get(key), str) or not body[key]:
                raise BadRequest(f"{key!r} (a string) is required")
        return body

    async def push(self, request: Request) -> Response:
        body = await self._body(request, "snapshot", "ref")
        team = scope_team(request.scope)
        problem = outside_team_scope(body["ref"], team)
        if problem is not None:  # another team's published repository is not to overwrite
            raise BadRequest(problem)
        self._check_repository(body["ref"], team)
        result = await self.push_snapshot(body["snapshot"], body["ref"], team,
                                          node_credentials=team == LOCAL_TEAM)
        return JSONResponse(result)

    async def push_snapshot(self, name: str, ref: str, team: str, *,
                            node_credentials: bool = True) -> dict[str, Any]:
        """`node_credentials`: the node's Docker credentials may be used (the standalone
        node's own team, the operator's AENV_SNAPSHOT_PUBLISH); a cluster's team pushes with
        none, as its builds pull (one team must not write with what the operator configured)."""
        backend = self._backend()
        tref, meta = self._resolve(name, team)
        record = backend.snapshots.load(tref)
        record_dir = Path(record.device_state).parent
        try:
            return await asyncio.to_thread(repository.push, record_dir, ref, meta, team=team,
                                           access=self.access,
                                           use_docker_config=node_credentials)
        except AgentEnvError as exc:
            raise BadRequest(f"push of {name} to {ref} failed: {exc}") from exc

    async def pull(self, request: Request) -> Response:
        body = await self._body(request, "ref")
        name = body.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise BadRequest("'name' must be a non-empty string")
        download = body.get("download", False)
        if not isinstance(download, bool):
            raise BadRequest("'download' must be true or false")
        team = scope_team(request.scope)
        problem = outside_team_scope(body["ref"], team)
        if problem is not None:  # another team's published snapshot is not found
            raise NotFound(problem)
        self._check_repository(body["ref"], team)
        backend = self._backend()
        if name is not None:
            owner = self.catalogue.name_owner(name, team)
            if owner is not None:
                raise Conflict(f"name {name!r} is already used by {owner}")
        with self.orchestrator.hold_snapshot_quota():  # a pulled snapshot is the team's
            return await self._pull(body["ref"], name, download, team, backend)

    async def _pull(self, ref: str, name: str | None, download: bool, team: str,
                    backend: VmBackend) -> Response:
        try:
            # The tools disk of a snapshot is this node's own when the guest assets match.
            fetched = await asyncio.to_thread(repository.fetch, ref, backend.snapshots.root,
                                              lazy=not download,
                                              local_files=[backend.assets.tools_image],
                                              team=team, access=self.access,
                                              # a cluster's team: no node credentials
                                              use_docker_config=team == LOCAL_TEAM)
        except AgentEnvError as exc:
            raise BadRequest(f"pull of {ref} failed: {exc}") from exc
        record = fetched.record
        if record.mode != backend.runtime.accel:
            raise BadRequest(f"snapshot {record.id} was taken under {record.mode} and this node "
                             f"runs {backend.runtime.accel}: it cannot be restored here")
        meta = fetched.meta
        tref = backend.snapshots.ref(record, "snapshot")
        if meta.get("guest_token"):
            tref.data["guest_token"] = meta["guest_token"]
        now = time.time()
        rootfs = next((d.size for d in record.machine.disks if d.name == "rootfs"), 0)
        tpl = TemplateRecord(
            template_id=new_id("s"), kind="snapshot", names=[name] if name else [], ref=tref,
            cpu_count=int(meta.get("cpu_count") or record.machine.vcpus),
            memory_mb=int(meta.get("memory_mb") or record.machine.memory_mib),
            disk_size_mb=int(meta.get("disk_size_mb") or rootfs >> 20),
            envd_version=str(meta.get("envd_version")
                             or self.config.default_envd_version),
            created_at=now, updated_at=now, team=team)
        await self.catalogue.register(tpl)
        log.info("snapshot pulled", extra={"ref": ref, "snapshot": record.id,
                                           "template_id": tpl.template_id,
                                           "bytes": fetched.bytes_fetched,
                                           "lazy_parts": fetched.lazy_parts})
        return JSONResponse({"templateID": tpl.template_id, "names": tpl.names,
                             "snapshot": record.id, "bytes_fetched": fetched.bytes_fetched,
                             "bytes_total": fetched.bytes_total, "lazy_parts": fetched.lazy_parts,
                             "seconds": fetched.seconds, "existed": fetched.existed})

    async def delete(self, request: Request) -> Response:
        """`POST /aenv/snapshots/delete {ref}`: the artifact a registry reference names,
        deleted from its registry (its manifest; the registry's garbage collection frees the
        blobs). The gateway's way to remove a spill-over's tag once the team deleted the
        snapshot. A cluster's team deletes only in its own part of a repository
        (PREFIX/<team>/NAME, and under AENV_SNAPSHOT_PUBLISH or AENV_SNAPSHOT_REPOSITORY
        only under PREFIX/<team>/), with no node credentials, as it pushes: 403 otherwise.
        A ref gone already is no error (`deleted`: false); a registry that refuses deletes
        is a 400 saying so."""
        body = await self._body(request, "ref")
        team = scope_team(request.scope)
        ref = body["ref"]
        self._check_repository(ref, team)
        problem = outside_team_scope(ref, team)
        if problem is None and team != LOCAL_TEAM:
            problem = not_the_teams(ref, team)
        if problem is not None:
            raise ApiError(problem, status=403)
        try:
            result = await asyncio.to_thread(repository.delete, ref,
                                             use_docker_config=team == LOCAL_TEAM)
        except AgentEnvError as exc:
            raise BadRequest(f"delete of {ref} failed: {exc}") from exc
        log.info("repository reference deleted", extra={"ref": ref, "team": team, **result})
        return JSONResponse(result)

    def publish_build(self, template_name: str, build_id: str, template_id: str) -> None:
        """Publish a ready template build when AENV_SNAPSHOT_PUBLISH names a repository."""
        prefix = get_settings().snapshot_publish.strip().rstrip("/")
        if not prefix:
            return
        template = self.catalogue.get(template_id)
        if template is None:
            return
        ref = published_ref(prefix, template.team, template_name, build_id)

        async def run() -> None:
            try:
                result = await self.push_snapshot(template_id, ref, template.team)
                log.info("template published", extra={"template_id": template_id, **result})
            except Exception as exc:
                log.warning("template not published", extra={"template_id": template_id,
                                                              "ref": ref, "error": str(exc)})

        task = asyncio.get_running_loop().create_task(run())
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)
