"""Routes of E2B's volume API (`/volumes`, with the API key, scoped to the request's team) and
of the volume content API (`/volumecontent/{id}/...`, with the volume's bearer token: the SDK
reaches it at E2B_VOLUME_API_URL, which is this node's URL); node/volumes.py does the work."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentenv.api.bodies import Endpoint, read_model
from agentenv.api.errors import ApiError, BadRequest, Conflict, sandbox_not_found
from agentenv.api.tenancy import scope_team
from agentenv.api.volume_models import (
    NewVolume,
    VolumeCommit,
    VolumeMetadataUpdate,
)
from agentenv.envd_client import EnvdClient, EnvdClientError
from agentenv.node.orchestrator import Orchestrator
from agentenv.node.records import State, VolumeRecord
from agentenv.node.views import entry_json, volume_json
from agentenv.node.volume_files import parse_path
from agentenv.node.volumes import Volumes

READ_CHUNK = 1 << 20
MAX_DEPTH = 100
#: how long the sandbox may take to archive its mount
COMMIT_SECONDS = 1800


def _int(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be a whole number, got {raw!r}") from None


def _flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0", ""):
        raise BadRequest(f"{name} must be true or false, got {raw!r}")
    return raw in ("true", "1")


class VolumeApi:
    def __init__(self, volumes: Volumes, orchestrator: Orchestrator) -> None:
        self.volumes = volumes
        self.orchestrator = orchestrator

    def handlers(self) -> dict[str, Endpoint]:
        """The operations of the route table (agentenv.api.routes) this serves."""
        return {
            "listVolumes": self.list_volumes, "createVolume": self.create_volume,
            "getVolume": self.get_volume, "deleteVolume": self.delete_volume,
            "commitVolume": self.commit, "statVolumePath": self.stat,
            "updateVolumePath": self.update, "removeVolumePath": self.remove,
            "listVolumeDir": self.list_dir, "makeVolumeDir": self.make_dir,
            "readVolumeFile": self.read_file, "writeVolumeFile": self.write_file,
        }

    # --- volumes (the API key; the request's team) ---------------------------------------------

    async def list_volumes(self, request: Request) -> Response:
        return JSONResponse([volume_json(v) for v in self.volumes.of_team(
            scope_team(request.scope))])

    async def create_volume(self, request: Request) -> Response:
        body = await read_model(request, NewVolume)
        rec = await self.volumes.create(scope_team(request.scope), body.name, body.sizeMB)
        return JSONResponse(volume_json(rec, self.volumes.token(rec)), status_code=201)

    async def get_volume(self, request: Request) -> Response:
        rec = self.volumes.get(scope_team(request.scope), request.path_params["volume_id"])
        return JSONResponse(volume_json(rec, self.volumes.token(rec)))

    async def delete_volume(self, request: Request) -> Response:
        await self.volumes.delete(scope_team(request.scope), request.path_params["volume_id"])
        return Response(status_code=204)

    async def commit(self, request: Request) -> Response:
        """The volume's content becomes what a running sandbox's copy-on-write mount of it
        holds (docs/volumes.md §8): the guest archives the mount (the tools disk's busybox
        tar, into its /tmp), the node downloads the archive (bounded by the volume's size),
        unpacks it safely into a new directory and swaps it in. Sandboxes mount the new
        content from their next create on."""
        team = scope_team(request.scope)
        rec = self.volumes.get(team, request.path_params["volume_id"])
        body = await read_model(request, VolumeCommit)
        sandbox = self.orchestrator.sandbox(body.sandboxID)
        if sandbox is None or sandbox.team != team or sandbox.state == State.KILLING:
            raise sandbox_not_found(body.sandboxID)
        mounts = [m for m in sandbox.volume_mounts if m.volume_id == rec.volume_id
                  and m.mode in ("cow", "rw") and body.path in (None, m.path)]
        if len(mounts) != 1:
            raise BadRequest(f"sandbox {body.sandboxID} has {len(mounts)} writable mounts "
                             f"of volume {rec.name!r}{f' at {body.path}' if body.path else ''}"
                             f"{': name its path' if mounts else ''}")
        writer = self.orchestrator.volume_writers().get(rec.volume_id)
        if writer is not None and writer != body.sandboxID:
            raise Conflict(f"volume {rec.name!r} is mounted read-write by sandbox {writer}: "
                           "only that sandbox commits to it")
        placement = sandbox.placement
        if placement is None or sandbox.state != State.RUNNING:
            raise Conflict(f"sandbox {body.sandboxID} is not running: a commit reads its "
                           "mount (resume it first)")
        token = sandbox.envd_access_token if sandbox.secure else None
        envd = EnvdClient(placement.envd_url, token, http=self.orchestrator.http)
        what = f"the commit of {mounts[0].path} of sandbox {body.sandboxID}"
        guest_tar = f"/tmp/.aenv-volume-commit-{uuid.uuid4().hex}.tar"
        work = self.volumes.dir / "work"
        work.mkdir(exist_ok=True)
        archive = work / f"commit-{rec.volume_id}-{uuid.uuid4().hex}.tar"
        try:
            made = await envd.run("/agentenv/bin/busybox", [
                "tar", "-c", "-f", guest_tar, "-C", mounts[0].path, "."], user="root",
                timeout=COMMIT_SECONDS)
            if made.exit_code != 0:
                raise ApiError(f"{what}: tar in the sandbox failed: {made.stderr[-300:]}",
                               status=500)
            # a tar holds a 512-byte header per entry beside the content
            await envd.download_file(guest_tar, archive, 2 * rec.size_bytes + (64 << 20),
                                     user="root")
            await self.volumes.replace_content(rec, archive, what)
        except EnvdClientError as exc:
            raise ApiError(f"{what}: {exc}", status=502) from None
        finally:
            archive.unlink(missing_ok=True)
            with contextlib.suppress(EnvdClientError):
                await envd.run("/agentenv/bin/busybox", ["rm", "-f", guest_tar], user="root",
                               timeout=60)
        return JSONResponse(volume_json(rec))

    # --- content (the volume's token) ----------------------------------------------------------

    def _volume(self, request: Request) -> VolumeRecord:
        return self.volumes.authorized(request.path_params["volume_id"],
                                       request.headers.get("authorization"))

    async def stat(self, request: Request) -> Response:
        rec = self._volume(request)
        parts = parse_path(request.query_params.get("path"))
        entry = await asyncio.to_thread(self.volumes.files(rec).stat, parts)
        return JSONResponse(entry_json(entry))

    async def update(self, request: Request) -> Response:
        rec = self._volume(request)
        parts = parse_path(request.query_params.get("path"))
        body = await read_model(request, VolumeMetadataUpdate, optional=True)
        entry = await self.volumes.update(rec, parts, body.uid, body.gid, body.mode)
        return JSONResponse(entry_json(entry))

    async def remove(self, request: Request) -> Response:
        rec = self._volume(request)
        await self.volumes.remove(rec, parse_path(request.query_params.get("path")))
        return Response(status_code=204)

    async def list_dir(self, request: Request) -> Response:
        rec = self._volume(request)
        parts = parse_path(request.query_params.get("path"))
        depth = _int(request, "depth")
        if depth is not None and not 0 <= depth <= MAX_DEPTH:
            raise BadRequest(f"depth must be between 0 and {MAX_DEPTH}, got {depth}")
        found = await asyncio.to_thread(self.volumes.files(rec).list, parts, depth or 1)
        return JSONResponse([entry_json(e) for e in found])

    async def make_dir(self, request: Request) -> Response:
        rec = self._volume(request)
        entry = await self.volumes.make_dir(
            rec, parse_path(request.query_params.get("path")), _int(request, "uid"),
            _int(request, "gid"), _int(request, "mode"), _flag(request, "force"))
        return JSONResponse(entry_json(entry), status_code=201)

    async def read_file(self, request: Request) -> Response:
        rec = self._volume(request)
        fd, size = await self.volumes.read(rec, parse_path(request.query_params.get("path")))

        async def chunks() -> AsyncIterator[bytes]:
            try:
                offset = 0
                while offset < size:
                    data = await asyncio.to_thread(
                        os.pread, fd, min(READ_CHUNK, size - offset), offset)
                    if not data:
                        break
                    offset += len(data)
                    yield data
            finally:
                os.close(fd)

        return StreamingResponse(chunks(), media_type="application/octet-stream",
                                 headers={"Content-Length": str(size)})

    async def write_file(self, request: Request) -> Response:
        rec = self._volume(request)
        parts = parse_path(request.query_params.get("path"))
        declared = request.headers.get("content-length")
        entry = await self.volumes.write(
            rec, parts, request.stream(), int(declared) if declared and declared.isdigit()
            else None, _int(request, "uid"), _int(request, "gid"), _int(request, "mode"),
            _flag(request, "force"))
        return JSONResponse(entry_json(entry), status_code=201)
