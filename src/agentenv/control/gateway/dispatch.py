"""What the gateway does with a request: sandbox traffic to the sandbox's node
(sandbox_relay.py), a signed file URL to the sandbox that signed it (signed.py), everything
else to the control API, which serves the route table of agentenv.api with the gateway's
handlers. The caller's X-API-KEY names its team, except on the routes whose table entry says
they check a credential of their own (a signed upload URL, a volume's token) or none.

Paths are checked before routing (relay/server.py path_problem: no dot, empty or
encoded-separator segments). Every error answer is JSON `{"code", "message"}`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request

from agentenv import console
from agentenv.api.errors import ApiError
from agentenv.api.routes import Auth, Operation
from agentenv.api.serve import bind, path_pattern
from agentenv.control.gateway.limits import TeamBusy, TeamShares
from agentenv.control.gateway.metrics import GatewayMetrics
from agentenv.control.gateway.nodes import GatewayError, Scope
from agentenv.control.gateway.placement import (
    BadPlacementRequest,
    NoPlacement,
    NoRoom,
    SchedulerUnavailable,
)
from agentenv.control.gateway.sandbox_relay import SandboxRelay, sandbox_route
from agentenv.control.gateway.signed import SignedFiles, is_signed_file_request
from agentenv.control.gateway.store import GatewayStore, StoreUnavailable
from agentenv.node.admission import REFUSAL_HEADERS, REFUSED_HEADER
from agentenv.relay.answers import send_json
from agentenv.relay.server import path_problem, request_target, target_problem
from agentenv.relay.stream import Send

log = logging.getLogger("agentenv.control.gateway")

#: serves an operation of the route table: (request, send, team, path parameters...)
Handler = Callable[..., Awaitable[None]]
Route = tuple[Operation, re.Pattern[str], Handler | None]


def route_table(handlers: Mapping[str, Handler]) -> tuple[list[Route], list[Operation]]:
    """The route table's operations the gateway serves, with their handlers and path patterns,
    in the table's order; and those it has no handler for."""
    served, missing = bind(handlers, node=False)
    return [(op, path_pattern(op.path), handler) for op, handler in served], missing


class Dispatch:
    def __init__(self, handlers: Mapping[str, Handler], store: GatewayStore,
                 sandboxes: SandboxRelay, signed_files: SignedFiles, team_shares: TeamShares,
                 metrics: GatewayMetrics) -> None:
        self.routes, self.unserved = route_table(handlers)
        self.store = store
        self.sandboxes = sandboxes
        self.signed_files = signed_files
        self.team_shares = team_shares
        self.metrics = metrics
        self.console = console.Console()

    async def __call__(self, scope: Scope, receive: Any, send: Send) -> None:
        problem = target_problem(request_target(scope))
        if problem is not None:  # never a forward proxy: only origin-form targets
            await self._refuse(scope, send, problem)
            return
        route = sandbox_route(scope)
        # sandbox traffic may end in '/' (an app's directory); the control API never does
        problem = path_problem(request_target(scope), trailing_slash=isinstance(route, tuple))
        if problem is not None:
            await self._refuse(scope, send, problem)
            return
        if scope["type"] == "websocket":
            if route is None or isinstance(route, str):
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.sandboxes.websocket(scope, receive, send, *route)
            return
        if isinstance(route, str):
            await send_json(send, 400, {"code": 400, "message": route})
            return
        if route is not None:
            await self.sandboxes.http(scope, receive, send, *route)
            return
        if is_signed_file_request(scope):
            await self.signed_files(scope, receive, send)
            return
        try:
            await self._control(Request(scope, receive), send)
        except ApiError as exc:
            await send_json(send, exc.status, {"code": exc.status, "message": exc.message})
        except TeamBusy as exc:
            await send_json(send, 429, {"code": 429, "message": str(exc)})
        except SchedulerUnavailable as exc:
            log.warning("control plane dependency unavailable: %s", exc.detail)
            await send_json(send, 503, {"code": 503, "message": str(exc)})
        except StoreUnavailable as exc:
            # its text names Redis's address: the log's, not the team's
            log.warning("control plane dependency unavailable: %s", exc)
            await send_json(send, 503, {"code": 503,
                                        "message": "the cluster's store is unavailable"})
        except NoRoom as exc:
            log.info("no room: %s", exc.detail, extra={"path": scope["path"]})
            self.metrics.capacity_refusals.labels(exc.resource).inc()
            await send_json(send, 429, {"code": 429, "message": str(exc)},
                            {**REFUSAL_HEADERS, REFUSED_HEADER: exc.resource})
        except NoPlacement as exc:
            log.info("no placement: %s", exc.detail, extra={"path": scope["path"]})
            await send_json(send, 503, {"code": 503, "message": f"no node available: {exc}"})
        except BadPlacementRequest as exc:
            await send_json(send, 400, {"code": 400, "message": str(exc)})
        except Exception as exc:
            log.error("unexpected error", exc_info=exc, extra={"path": scope["path"]})
            await send_json(send, 500, {"code": 500,
                                        "message": f"internal error: {type(exc).__name__}"})

    @staticmethod
    async def _refuse(scope: Scope, send: Send, problem: str) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await send_json(send, 400, {"code": 400, "message": problem})

    async def _control(self, request: Request, send: Send) -> None:
        path = request.url.path
        if console.claims(path):  # files only: what they show needs a team's key
            await self.console(request.scope, request.receive, send)
            return
        # the route's own kind of credential (a signed upload URL, a volume's token, none),
        # else a team's key: also where no route matches (401 before 404)
        auth = next((op.auth for op, p, _ in self.routes if p.fullmatch(path)), Auth.API_KEY)
        team = None
        if auth == Auth.API_KEY:
            keys = request.headers.getlist("x-api-key")
            if len(keys) == 1:
                team = await self.store.team_of_key(keys[0])
            if team is None:
                message = "missing X-API-KEY header" if not keys else "invalid API key"
                raise GatewayError(401, message)
        for op, pattern, handler in self.routes:
            match = pattern.fullmatch(path)
            if match:
                if request.method != op.method.upper():
                    continue
                if handler is None:  # the SDK has it, nothing here serves it
                    raise GatewayError(501, op.unsupported or "")
                # a route without a team's key: its handler holds the owner's share itself
                with self.team_shares.hold(team or ""):
                    await handler(request, send, team or "", *match.groups())
                return
        if any(p.fullmatch(path) for _, p, _ in self.routes):
            raise GatewayError(405, f"method {request.method} not allowed on {path}")
        raise GatewayError(404, f"route not found: {request.method} {path}")
