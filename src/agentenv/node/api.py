"""The node's HTTP front: the E2B control-plane API and the sandbox proxy on one port.

`NodeApp` is the ASGI entry point. Only origin-form request targets are served (400 otherwise).
Sandbox traffic (E2b-Sandbox-Id header, `{port}-{id}.{domain}` Host, or a signed file URL) goes
to the proxy without an API key; everything else is the
control plane, which needs `X-API-KEY` except for /health and /metrics, and the web console's
static files (agentenv.console at /console: what they show needs the key). Paths with dot,
empty or encoded-separator segments are refused before routing (relay/server.py path_problem).

Teams (api/tenancy.py): a request with the API key is of LOCAL_TEAM; a node of a cluster
serves only its gateway (its node key), which names the team of each request in
TEAM_HEADER, and every route applies that team's scope: another team's sandbox, template or
snapshot is not found, by id or by name, and listings show the team's own. A gateway request
without a team reaches only the team-less routes (TEAMLESS_PATHS). Every non-2xx answer of
the control plane is JSON `{"code": <status>, "message": ...}` (docs/e2b-api.md §1.2),
including unknown routes (404), wrong methods (405), bad bodies (400/422) and huge bodies (413).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import platform
import socket
import time
from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from typing import Any, Literal
from urllib.parse import unquote_plus

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentenv import __version__, console
from agentenv.api import models, paging
from agentenv.api.auth import bearer_is, carries_node_key, same_secret
from agentenv.api.bodies import Endpoint, error, read_model
from agentenv.api.errors import ApiError, BadRequest, sandbox_not_found
from agentenv.api.openapi import openapi_document
from agentenv.api.routes import ROUTES, Auth, Operation
from agentenv.api.serve import bind, starlette_path
from agentenv.api.tenancy import LOCAL_TEAM, SCOPE_KEY, TEAM_HEADER, TEAM_NAME, scope_team
from agentenv.node import views
from agentenv.node.layer_peers import HOLDERS_PATH
from agentenv.node.metrics import NodeMetrics
from agentenv.node.orchestrator import CreateParams, ForkResult, Orchestrator
from agentenv.node.proxy import SandboxProxy, route_of
from agentenv.node.records import SandboxRecord, State, TemplateRecord
from agentenv.relay.answers import send_json
from agentenv.relay.server import path_problem, request_target, target_problem

log = logging.getLogger("agentenv.node.api")

IDEMPOTENCY_SECONDS = 600.0


def _paths(*kinds: Auth) -> set[str]:
    return {op.path for op in ROUTES if op.auth in kinds and "{" not in op.path}


PUBLIC_PATHS = _paths(Auth.PUBLIC)
#: what a node is asked for no team, with the node key: which sandbox made a file
#: signature (the URL names no team; the answer names it), the node's metrics, and which peers
#: hold a layer (blockd's question, node/layer_peers.py), every team's events for the gateway's
#: collector (node/events_api.py). Not `/nodes`: a node's figures are always some team's view
#: (_node)
TEAMLESS_PATHS = _paths(Auth.PUBLIC, Auth.METRICS, Auth.NODE) | {HOLDERS_PATH}
#: Paths whose routes check a permission of their own instead of the API key (the signed upload
#: URLs of template build files, node/template_api.py; the volume content API, which takes the
#: volume's bearer token, node/volume_api.py): what comes before their first parameter.
SELF_AUTHENTICATED_PREFIXES = tuple(sorted({
    op.path.split("{")[0] for op in ROUTES if op.auth in (Auth.SIGNED, Auth.VOLUME_TOKEN)}))
class SignedFileRequest(BaseModel):
    """A signed file URL's method and raw query string (`POST SIGNATURE_OWNER_PATH`)."""

    method: Literal["GET", "POST"]
    query: str = Field(max_length=16384)


def parse_metadata_filter(raw: str | None) -> dict[str, str]:
    """E2B's metadata query: `k=v&k2=v2`, URL-encoded once more (docs/e2b-api.md §1.5)."""
    if not raw:
        return {}
    wanted: dict[str, str] = {}
    for pair in unquote_plus(raw).split("&"):
        if not pair:
            continue
        parts = pair.split("=")
        if len(parts) != 2:
            raise BadRequest(f"invalid metadata filter {pair!r}: expected key=value")
        wanted[unquote_plus(parts[0])] = unquote_plus(parts[1])
    return wanted


# --- the application ---------------------------------------------------------------------------


class NodeApp:
    """ASGI app: the proxy for sandbox traffic, the Starlette control plane for the rest."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        api_key: str,
        metrics: NodeMetrics | None = None,
        node_id: str | None = None,
        extra_routes: list[Route] | None = None,
        node_key: str | None = None,
        metrics_token: str | None = None,
        public_metrics: bool = False,
        handlers: Mapping[str, Endpoint] | None = None,
    ) -> None:
        """`node_key`: the node is part of a cluster and serves only its gateway: every
        request but /health must carry this node's key (NODE_KEY_HEADER; the gateway derives
        it from the cluster secret, which the node does not hold), which then stands in for
        the API key. /metrics also takes `Authorization: Bearer` with the cluster's
        `metrics_token` (the API key on a standalone node), or nothing when `public_metrics`.
        The routes are the route table's (agentenv.api.routes): `handlers` serve the operations
        of the node's other parts (template builds, volumes, events...) by operationId, this
        class the rest; `extra_routes` (tests) are matched before them."""
        self.orchestrator = orchestrator
        self.catalogue = orchestrator.catalogue
        #: the backend's optional capabilities, resolved once at assembly (node/server.py)
        self.capabilities = orchestrator.capabilities
        #: the node's settings (node/orchestrator.py NodeConfig), fixed once it is assembled
        self.config = orchestrator.config
        self.api_key = api_key
        self.node_key = node_key
        self.public_metrics = public_metrics
        self.metrics_token = metrics_token if node_key else api_key
        self.metrics = metrics or NodeMetrics()
        self.metrics.watch_states(orchestrator.count_by_state)
        counters = orchestrator.counters
        self.metrics.watch_idle(lambda: (counters.idle_pauses, counters.idle_resumes))
        self.node_id = node_id or socket.gethostname()
        self.client_id = hashlib.sha256(self.node_id.encode()).hexdigest()[:8]
        self.proxy = SandboxProxy(orchestrator, api_key, self.metrics)
        self.console = console.Console()
        #: (team, Idempotency-Key) -> when, and the create it started
        self._idempotent: dict[tuple[str, str], tuple[float, asyncio.Task[SandboxRecord]]] = {}
        self._started = time.time()
        self.api = Starlette(
            routes=[*(extra_routes or []), *self._routes(handlers or {})],
            exception_handlers={
                HTTPException: self._http_exception,
                ApiError: self._api_error,
                Exception: self._unexpected,
            },
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        try:
            await self.orchestrator.start()
        except BaseException:
            # a node that cannot start (its base template failed to build...) stops what it did
            # start, or its egress proxy and slots outlive it
            with contextlib.suppress(Exception):
                await self.orchestrator.shutdown()
            raise
        log.info("node ready", extra={"backend": self.orchestrator.backend_name})
        try:
            yield
        finally:
            await self.orchestrator.shutdown()
            await self.proxy.close()
            log.info("node stopped")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.api(scope, receive, send)
            return
        problem = target_problem(request_target(scope))
        if problem is not None:  # the node is no forward proxy: only origin-form targets
            await self._refuse(scope, send, 400, problem)
            return
        # Before the route: a signed /files URL names no sandbox, and finding its sandbox costs
        # a SHA-256 per sandbox (SandboxProxy.route); on a cluster's node only its gateway may
        # have that work done. /health and /metrics are no /files: route_of (headers and Host
        # only, no signature) says whether they are sandbox traffic.
        named = route_of(scope)
        scraper = named is None and scope["path"] == "/metrics" and (
            self.public_metrics or (self.metrics_token is not None
                                    and bearer_is(scope["headers"], self.metrics_token)))
        from_gateway = False
        if (self.node_key is not None and not scraper
                and (named is not None or scope["path"] != "/health")):
            if not carries_node_key(scope["headers"], self.node_key):
                await self._refuse(scope, send, 403, "this node serves its cluster's gateway only")
                return
            from_gateway = True
        route = named or self.proxy.route(scope)
        # sandbox traffic may end in '/' (an app's directory); the control API never does
        problem = path_problem(request_target(scope), trailing_slash=route is not None)
        if problem is not None:
            await self._refuse(scope, send, 400, problem)
            return
        scope[SCOPE_KEY] = LOCAL_TEAM
        if from_gateway:
            problem = self._team_problem(scope, route is None)
            if problem is not None:
                await self._refuse(scope, send, 403, problem)
                return
        if scope["type"] == "websocket":
            if route is None:  # the control plane has no WebSocket routes
                await send({"type": "websocket.close", "code": 1008})
            else:
                await self.proxy.websocket(scope, receive, send, route)
            self.metrics.requests.labels("proxy" if route else "api", "WEBSOCKET", "-").inc()
            return
        if route is not None:
            status = await self.proxy(scope, receive, send, route)
            self.metrics.requests.labels("proxy", scope["method"], str(status)).inc()
            return
        if console.claims(scope["path"]):  # files only: what they show needs the API key
            await self.console(scope, receive, send)
            return
        if (
            not from_gateway
            and not scraper
            and scope["path"] not in PUBLIC_PATHS
            and not scope["path"].startswith(SELF_AUTHENTICATED_PREFIXES)
        ):
            keys = [v for n, v in scope["headers"] if n == b"x-api-key"]
            if len(keys) != 1 or not same_secret(keys[0].decode("latin-1"), self.api_key):
                message = "missing X-API-KEY header" if not keys else "invalid API key"
                await send_json(send, 401, {"code": 401, "message": message})
                self.metrics.requests.labels("api", scope["method"], "401").inc()
                return
        status_seen = [500]

        async def tracking_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status_seen[0] = message["status"]
            await send(message)

        try:
            await self.api(scope, receive, tracking_send)
        finally:
            self.metrics.requests.labels("api", scope["method"], str(status_seen[0])).inc()

    @staticmethod
    def _team_problem(scope: dict[str, Any], control: bool) -> str | None:
        """Record the team the gateway named (TEAM_HEADER) in the scope; or why the request is
        refused: no team outside the team-less routes, more than one, or a malformed one."""
        teams = [v.decode("latin-1") for n, v in scope["headers"] if n == TEAM_HEADER]
        if not teams:
            if control and scope["path"] in TEAMLESS_PATHS:
                return None
            return "a request of the gateway must name its team"
        if len(teams) > 1 or not TEAM_NAME.match(teams[0]):
            return "the gateway's team header must appear once, with a team's name"
        scope[SCOPE_KEY] = teams[0]
        return None

    async def _refuse(self, scope: dict[str, Any], send: Any, status: int, message: str) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await send_json(send, status, {"code": status, "message": message})
        self.metrics.requests.labels("api", scope.get("method", "WEBSOCKET"), str(status)).inc()

    # --- error handlers ----------------------------------------------------------------------

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = exc.detail
        if exc.status_code == 404:
            message = f"route not found: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        return error(exc.status_code, message, headers=exc.headers)

    async def _api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error(exc.status, exc.message, headers=exc.headers)

    async def _unexpected(self, request: Request, exc: Exception) -> Response:
        log.error("unexpected error", exc_info=exc, extra={"path": request.url.path})
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

    # --- routes ------------------------------------------------------------------------------

    def _own_handlers(self) -> dict[str, Endpoint]:
        """The operations this class serves (agentenv.api.routes, by operationId)."""
        return {
            "health": self.health, "metrics": self.prometheus, "openapi": self.openapi,
            "createSandbox": self.create_v1, "listSandboxes": self.list_v1,
            "createSandboxV2": self.create_v2, "listSandboxesV2": self.list_v2,
            "getSandbox": self.detail, "killSandbox": self.kill,
            "setSandboxTimeout": self.set_timeout, "refreshSandbox": self.refresh,
            "pauseSandbox": self.pause, "resumeSandbox": self.resume,
            "connectSandbox": self.connect_v1, "connectSandboxV2": self.connect_v2,
            "createSnapshot": self.create_snapshot, "forkSandbox": self.fork,
            "listSandboxChildren": self.children, "rollbackSandbox": self.rollback,
            "updateSandboxNetwork": self.update_network, "listSnapshots": self.list_snapshots,
            "listSnapshotChildren": self.snapshot_children, "forkSnapshot": self.fork_snapshot,
            "getSnapshot": self.get_snapshot, "listNodes": self.nodes,
            "getNode": self.node_detail, "signatureOwner": self.signature_owner,
        }

    def _routes(self, handlers: Mapping[str, Endpoint]) -> list[Route]:
        """The route table's operations with their handlers, in its order; an operation no
        part serves is left out (a node built by hand, in tests: build_app serves them all)."""
        served, self.unserved = bind({**self._own_handlers(), **handlers}, node=True)
        return [Route(starlette_path(op.path), handler or self._unsupported(op),
                      methods=[op.method.upper()]) for op, handler in served]

    @staticmethod
    def _unsupported(op: Operation) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            return error(501, op.unsupported or "")

        return endpoint

    async def health(self, request: Request) -> Response:
        # The node is not healthy while its backend cannot serve (blockd down or restarting,
        # sandboxes whose disks did not come back): 503 with the reason.
        health = self.capabilities.health
        problem = health.health_problem() if health is not None else None
        if problem:
            return JSONResponse({"status": "unhealthy", "reason": problem,
                                 "version": __version__}, status_code=503)
        return JSONResponse({"status": "ok", "version": __version__})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _sandbox_id(self, request: Request) -> str:
        """The path's sandbox id, if that sandbox is of the request's team (else not found)."""
        sandbox_id: str = request.path_params["sandbox_id"]
        rec = self.orchestrator.sandbox(sandbox_id)
        if rec is None or rec.team != scope_team(request.scope):
            raise sandbox_not_found(sandbox_id)
        return sandbox_id

    def _sandbox(self, rec: SandboxRecord) -> dict[str, Any]:
        return views.sandbox_json(rec, self.client_id, self.config.domain)

    # create

    async def _create(self, request: Request, body: models.NewSandbox, v1: bool) -> Response:
        params = CreateParams(
            template=body.templateID,
            timeout=body.timeout,
            metadata=body.metadata or {},
            env_vars=body.envVars or {},
            auto_pause=bool(body.autoPause),
            auto_pause_memory=body.autoPauseMemory is not False,
            auto_resume=bool(body.autoResume and body.autoResume.enabled),
            secure=body.secure is not False if v1 else True,
            allow_internet_access=body.allow_internet_access,
            network=body.network,
            team=scope_team(request.scope),
            idle_pause_after=body.idlePauseAfter,
            volume_mounts=[(m.name, m.path, m.mode) for m in body.volumeMounts or []],
        )
        key = request.headers.get("idempotency-key")
        if body.count is not None:
            if key is not None:
                raise BadRequest("a batch create (count) takes no Idempotency-Key")
            return self._fork_results(await self.orchestrator.create_many(params, body.count))
        if key is None:
            rec = await self.orchestrator.create(params)
        else:
            rec = await self._create_once(key, params)
        return JSONResponse(self._sandbox(rec), status_code=201)

    async def _create_once(self, key: str, params: CreateParams) -> SandboxRecord:
        """A retried create with the same Idempotency-Key gets the first one's sandbox."""
        now = time.time()
        for old in [k for k, (t, _) in self._idempotent.items() if now - t > IDEMPOTENCY_SECONDS]:
            del self._idempotent[old]
        if not 1 <= len(key) <= 255:
            raise BadRequest("Idempotency-Key must be 1-255 characters")
        entry = self._idempotent.get((params.team, key))
        if entry is None or (entry[1].done() and entry[1].exception() is not None):
            task = asyncio.ensure_future(self.orchestrator.create(params))
            self._idempotent[(params.team, key)] = (now, task)
        else:
            task = entry[1]
        return await asyncio.shield(task)

    async def create_v1(self, request: Request) -> Response:
        return await self._create(request, await read_model(request, models.NewSandbox), v1=True)

    async def create_v2(self, request: Request) -> Response:
        return await self._create(request, await read_model(request, models.NewSandbox), v1=False)

    # list

    def _filtered(self, request: Request, default_states: set[str]) -> list[SandboxRecord]:
        states: set[str] = set()
        for raw in request.query_params.getlist("state"):
            states.update(s.strip() for s in raw.split(",") if s.strip())
        unknown = states - {"running", "paused"}
        if unknown:
            raise BadRequest(f"unknown state filter {sorted(unknown)}: use running and/or paused")
        states = states or default_states
        metadata = parse_metadata_filter(request.query_params.get("metadata"))
        template = request.query_params.get("template")
        after_raw = request.query_params.get("startedAfter")
        after = None
        if after_raw:
            try:
                after = datetime.fromisoformat(after_raw.replace(" ", "+")).timestamp()
            except ValueError as exc:
                raise BadRequest(f"startedAfter is not an RFC 3339 time: {after_raw!r}") from exc
        found = []
        team = scope_team(request.scope)
        for rec in self.orchestrator.list_visible():
            if rec.team != team or rec.state.public not in states:
                continue
            if any(rec.metadata.get(k) != v for k, v in metadata.items()):
                continue
            if template and template not in (rec.template_id, rec.alias):
                continue
            if after is not None and rec.started_at < after:
                continue
            found.append(rec)
        return found

    async def list_v1(self, request: Request) -> Response:
        found = self._filtered(request, {"running"})
        return JSONResponse(
            [views.listed_json(r, self.client_id) for r in found if r.state == State.RUNNING]
        )

    async def list_v2(self, request: Request) -> Response:
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest(f"order must be asc or desc, got {order!r}")
        found = self._filtered(request, {"running", "paused"})
        items, token = paging.page(found, lambda r: (r.started_at, r.sandbox_id),
                                   request.query_params.get("nextToken"),
                                   paging.page_limit(request.query_params), order == "desc")
        headers = {"X-Total-Running": str(sum(r.state == State.RUNNING for r in found))}
        if token:
            headers["X-Next-Token"] = token
        return JSONResponse([views.listed_json(r, self.client_id) for r in items], headers=headers)

    # one sandbox

    async def detail(self, request: Request) -> Response:
        rec = self.orchestrator.get(self._sandbox_id(request))
        if rec.state == State.KILLING:  # killed, as far as clients are concerned
            raise sandbox_not_found(rec.sandbox_id)
        return JSONResponse(
            views.detail_json(rec, self.client_id, self.config.domain)
        )

    async def kill(self, request: Request) -> Response:
        await self.orchestrator.kill(self._sandbox_id(request))
        return Response(status_code=204)

    async def set_timeout(self, request: Request) -> Response:
        body = await read_model(request, models.TimeoutRequest)
        await self.orchestrator.set_timeout(self._sandbox_id(request), body.timeout)
        return Response(status_code=204)

    async def refresh(self, request: Request) -> Response:
        body = await read_model(request, models.RefreshRequest, optional=True)
        seconds = 15 if body.duration is None else body.duration
        await self.orchestrator.set_timeout(
            self._sandbox_id(request), seconds, shorten=False
        )
        return Response(status_code=204)

    async def pause(self, request: Request) -> Response:
        body = await read_model(request, models.PauseRequest, optional=True)
        await self.orchestrator.pause(self._sandbox_id(request), body.memory is not False)
        return Response(status_code=204)

    async def resume(self, request: Request) -> Response:
        body = await read_model(request, models.ResumeRequest, optional=True)
        rec = await self.orchestrator.resume_legacy(
            self._sandbox_id(request), body.timeout, body.autoPause
        )
        return JSONResponse(self._sandbox(rec), status_code=201)

    async def _connect(self, sandbox_id: str, timeout: int | None,
                       memory: bool | None = None) -> Response:
        rec, resumed = await self.orchestrator.connect(sandbox_id, timeout, memory is not False)
        return JSONResponse(self._sandbox(rec), status_code=201 if resumed else 200)

    async def connect_v1(self, request: Request) -> Response:
        body = await read_model(request, models.ConnectV1Request)
        return await self._connect(self._sandbox_id(request), body.timeout, body.memory)

    async def connect_v2(self, request: Request) -> Response:
        body = await read_model(request, models.ConnectV2Request, optional=True)
        return await self._connect(self._sandbox_id(request), body.timeout, body.memory)

    async def create_snapshot(self, request: Request) -> Response:
        body = await read_model(request, models.SnapshotRequest, optional=True)
        tpl = await self.orchestrator.snapshot(self._sandbox_id(request), body.name)
        return JSONResponse(views.snapshot_json(tpl), status_code=201)

    def _fork_results(self, results: list[ForkResult]) -> Response:
        """201 with a SandboxForkResult per child: its sandbox or its own error."""
        out = []
        for result in results:
            if result.record is not None:
                out.append({"sandbox": self._sandbox(result.record)})
            else:
                out.append({"error": {"code": result.status, "message": result.error or ""}})
        return JSONResponse(out, status_code=201)

    async def fork(self, request: Request) -> Response:
        """A running sandbox forks from a checkpoint in place; a paused one from its pause
        snapshot (it stays paused)."""
        body = await read_model(request, models.ForkRequest, optional=True)
        return self._fork_results(await self.orchestrator.fork(
            self._sandbox_id(request), body.count, body.timeout))

    async def rollback(self, request: Request) -> Response:
        """An extension: the sandbox restored in place to one of its snapshots; the answer
        carries its new envd token."""
        body = await read_model(request, models.RollbackRequest, optional=True)
        rec = await self.orchestrator.rollback(self._sandbox_id(request), body.snapshotID,
                                               body.timeout)
        return JSONResponse(self._sandbox(rec))

    async def children(self, request: Request) -> Response:
        """The sandboxes forked from this one (an extension: lineage)."""
        found = self.orchestrator.children(self._sandbox_id(request))
        return JSONResponse([views.listed_json(r, self.client_id) for r in found])

    async def update_network(self, request: Request) -> Response:
        """Replaces the whole egress policy (node/network_policy.py); 400 names a bad entry."""
        body = await read_model(request, models.NetworkUpdate, optional=True)
        await self.orchestrator.update_network(
            self._sandbox_id(request), body.model_dump(exclude_none=True))
        return Response(status_code=204)

    # snapshots and templates

    async def list_snapshots(self, request: Request) -> Response:
        found = self.catalogue.of_kind("snapshot", scope_team(request.scope))
        source = request.query_params.get("sandboxID")
        name = request.query_params.get("name")
        if source:
            found = [t for t in found if t.source_sandbox_id == source]
        if name:
            bare = name.split("/")[-1].split(":")[0]
            found = [t for t in found if name in t.names or bare in t.names]
        items, token = paging.page(found, lambda t: (t.created_at, t.template_id),
                                   request.query_params.get("nextToken"),
                                   paging.page_limit(request.query_params), True)
        headers = {"X-Next-Token": token} if token else None
        return JSONResponse([views.snapshot_json(t) for t in items], headers=headers)

    def _snapshot(self, request: Request) -> TemplateRecord:
        """The path's snapshot, of the request's team (404 otherwise, templates too)."""
        raw = request.path_params["snapshot_id"]
        tpl = self.catalogue.resolve(raw, scope_team(request.scope))
        if tpl.kind != "snapshot":
            raise ApiError(f"snapshot '{raw}' not found", status=404)
        return tpl

    async def fork_snapshot(self, request: Request) -> Response:
        """An extension: `count` sandboxes made from the snapshot, a SandboxForkResult each."""
        body = await read_model(request, models.ForkRequest, optional=True)
        tpl = self._snapshot(request)
        params = CreateParams(template=tpl.template_id, team=scope_team(request.scope),
                              timeout=body.timeout if body.timeout is not None
                              else self.config.fork_default_timeout)
        return self._fork_results(await self.orchestrator.create_many(params, body.count))

    async def snapshot_children(self, request: Request) -> Response:
        """The sandboxes made from this snapshot (an extension: lineage)."""
        found = self.orchestrator.made_from_snapshot(self._snapshot(request).template_id)
        return JSONResponse([views.listed_json(r, self.client_id) for r in found])

    async def get_snapshot(self, request: Request) -> Response:
        return JSONResponse(views.snapshot_json(self._snapshot(request)))

    # nodes

    def _node(self, team: str) -> dict[str, Any]:
        """This node as `team` may see it: its own sandboxes' counts and allocations, never
        another team's. A standalone node's one team sees the host's use too; on a node of a
        cluster the host's use (CPU load, memory and disk used) is every team's load: left out."""
        mine = [r for r in self.orchestrator.all_sandboxes() if r.team == team]
        counts = {s.value: 0 for s in State}
        for rec in mine:
            counts[rec.state.value] += 1
        busy = ("running", "pausing", "snapshotting", "forking", "rolling-back", "killing")
        live = [r for r in mine if r.state.holds_vm]
        paused = [r for r in mine if not r.state.holds_vm]
        successes, fails = self.orchestrator.create_counts(team)
        mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        state_dir = str(self.orchestrator.state_dir)
        disk = os.statvfs(state_dir)
        metrics: dict[str, Any] = {
            "allocatedCPU": sum(r.cpu_count for r in live),
            "allocatedMemoryBytes": sum(r.memory_mb for r in live) << 20,
            "pausedAllocatedCPU": sum(r.cpu_count for r in paused),
            "pausedAllocatedMemoryBytes": sum(r.memory_mb for r in paused) << 20,
            "cpuCount": os.cpu_count() or 1,
            "memoryTotalBytes": mem_total,
            "disks": [{"mountPoint": state_dir, "device": "", "filesystemType": "",
                       "totalBytes": disk.f_blocks * disk.f_frsize}],
        }
        if self.node_key is None:
            mem_free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
            metrics["cpuPercent"] = round(100 * os.getloadavg()[0] / (os.cpu_count() or 1), 1)
            metrics["memoryUsedBytes"] = mem_total - mem_free
            metrics["disks"][0]["usedBytes"] = (disk.f_blocks - disk.f_bfree) * disk.f_frsize
        return {
            "id": self.node_id,
            "nodeID": self.node_id,
            "serviceInstanceID": f"{self.node_id}-{int(self._started)}",
            "clusterID": "00000000-0000-0000-0000-000000000000",
            "version": __version__,
            "commit": "unknown",
            "status": "ready",
            "backend": self.orchestrator.backend_name,
            "machineInfo": {
                "cpuFamily": "",
                "cpuModel": "",
                "cpuModelName": platform.processor() or platform.machine(),
                "cpuArchitecture": platform.machine(),
            },
            "sandboxCount": sum(counts[s] for s in busy),
            "sandboxStartingCount": counts["creating"] + counts["resuming"],
            "sandboxPausedCount": counts["paused"],
            "createSuccesses": successes,
            "createFails": fails,
            "metrics": metrics,
        }

    async def signature_owner(self, request: Request) -> Response:
        body = await read_model(request, SignedFileRequest)
        sandbox_id = self.proxy.signature_owner(body.method, body.query)
        rec = self.orchestrator.sandbox(sandbox_id) if sandbox_id is not None else None
        if rec is None:
            raise ApiError("no sandbox of this node made this signature", status=404)
        # team-less: the gateway learns the team here, and relays the request for it
        return JSONResponse({"sandboxID": rec.sandbox_id, "team": rec.team})

    async def nodes(self, request: Request) -> Response:
        return JSONResponse([self._node(scope_team(request.scope))])

    async def node_detail(self, request: Request) -> Response:
        if request.path_params["node_id"] != self.node_id:
            raise ApiError(f"node {request.path_params['node_id']!r} not found", status=404)
        body = self._node(scope_team(request.scope))
        body["cachedBuilds"] = []
        return JSONResponse(body)
