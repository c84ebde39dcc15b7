"""The files of a template build's COPY steps (E2B's build file uploads): whether the node has
a tar by its hash, else a signed, expiring upload URL for it; and that URL's PUT, which needs
no API key (the signature is the permission, naming the team it stores for). Uploaded files
are kept per team under <state>/template-files/ (node/template_files.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentenv.api.errors import ApiError, BadRequest
from agentenv.api.template_models import (
    FILES_HASH,
    UPLOAD_PREFIX,
)
from agentenv.api.tenancy import scope_team
from agentenv.fsutil import (
    InsufficientSpace,
    SpaceGuard,
    require_free_space,
)
from agentenv.node.admission import space_reserve
from agentenv.node.build_records import BuildRecords
from agentenv.node.orchestrator import Orchestrator
from agentenv.node.template_files import TeamFiles

log = logging.getLogger("agentenv.node.template_api")

UPLOAD_URL_SECONDS = 3600
MAX_UPLOAD_BYTES = 8 << 30
#: an upload looks at its team's budget again after this many bytes
UPLOAD_BUDGET_CHECK = 16 << 20


class BuildUploads:
    def __init__(self, orchestrator: Orchestrator, records: BuildRecords, api_key: str) -> None:
        self.orchestrator = orchestrator
        self.records = records
        self._signing_key = hashlib.sha256(b"aenv-template-upload:" + api_key.encode()).digest()

    def signature(self, team: str, template_id: str, files_hash: str, expires: int) -> str:
        # The URL is the only permission an upload carries: it names the team it stores for.
        message = json.dumps([team, template_id, files_hash, expires]).encode()
        return hmac.new(self._signing_key, message, hashlib.sha256).hexdigest()

    async def file_link(self, request: Request) -> Response:
        self.records.load()
        template_id = self.records.template_of_request(request.path_params["template_id"], scope_team(request.scope))
        files_hash = request.path_params["hash"]
        if not FILES_HASH.fullmatch(files_hash):
            raise BadRequest(f"invalid files hash {files_hash!r}")
        team = scope_team(request.scope)
        present = TeamFiles(self.records.files_dir, team).verified(files_hash)
        if present.is_file():
            # The SDK skips the upload and starts a build with it soon: fresh again for the
            # garbage collector (node/gc.py keeps unused uploads AENV_TEMPLATE_FILES_TTL).
            with contextlib.suppress(OSError):
                os.utime(present)
            return JSONResponse({"present": True}, status_code=201)
        expires = int(time.time()) + UPLOAD_URL_SECONDS
        base = str(request.base_url).rstrip("/")
        query = urlencode({"expires": expires, "team": team,
                           "signature": self.signature(team, template_id, files_hash, expires)})
        url = f"{base}{UPLOAD_PREFIX}{template_id}/{files_hash}?{query}"
        return JSONResponse({"present": False, "url": url}, status_code=201)

    async def upload(self, request: Request) -> Response:
        """The upload URL (no API key: the signature in the URL is the permission)."""
        self.records.load()
        template_id = request.path_params["template_id"]
        files_hash = request.path_params["hash"]
        try:
            expires = int(request.query_params.get("expires", ""))
        except ValueError:
            raise ApiError("upload URL without a valid expiry", status=403) from None
        given = request.query_params.get("signature", "")
        team = request.query_params.get("team", "")
        if not FILES_HASH.fullmatch(files_hash) or not hmac.compare_digest(
                given, self.signature(team, template_id, files_hash, expires)):
            raise ApiError("invalid upload signature", status=403)
        if expires < time.time():
            raise ApiError("the upload URL has expired; ask for a new one", status=403)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > MAX_UPLOAD_BYTES:
            raise ApiError(f"upload over {MAX_UPLOAD_BYTES} bytes", status=413)
        files = TeamFiles(self.records.files_dir, team)
        files.dir.mkdir(parents=True, exist_ok=True)
        what = f"the upload of files {files_hash}"
        length = int(declared) if declared and declared.isdigit() else 0
        replaced = files.unverified(files_hash)  # a newer upload of a hash replaces the older
        held = files.held_bytes(skip=(replaced,))
        files.check_budget(held, length)
        reserve, setting = space_reserve(self.orchestrator.admission)
        try:
            require_free_space(self.records.files_dir, length, what, reserve=reserve, setting=setting)
        except InsufficientSpace as exc:
            raise ApiError(str(exc), status=507) from None
        fd, tmp_name = tempfile.mkstemp(prefix=f".{files_hash}.", dir=files.dir)
        size = 0
        checked = 0
        # No length given (or a wrong one), and the team's other uploads and the node's other
        # writers grow too: look again every few MiB (the disk: SpaceGuard).
        guard = SpaceGuard(self.records.files_dir, what, reserve=reserve, setting=setting)
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > MAX_UPLOAD_BYTES:
                        raise ApiError(f"upload over {MAX_UPLOAD_BYTES} bytes", status=413)
                    files.check_budget(held, size)
                    if size - checked >= UPLOAD_BUDGET_CHECK:
                        checked = size
                        held = files.held_bytes(skip=(replaced, Path(tmp_name)))
                        files.check_budget(held, size)
                    try:
                        guard.wrote(len(chunk))
                    except InsufficientSpace as exc:
                        raise ApiError(str(exc), status=507) from None
                    await asyncio.to_thread(out.write, chunk)
            stored = files.store(Path(tmp_name), files_hash)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise
        log.info("build files uploaded", extra={"files_hash": files_hash, "bytes": size,
                                                "kept": stored})
        return Response(status_code=200)
