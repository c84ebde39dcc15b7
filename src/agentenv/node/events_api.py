"""Routes of the lifecycle events (E2B's `/events/sandboxes`) and the teams' webhooks
(`/events/webhooks`); node/events.py and node/webhooks.py do the work."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentenv.node import event_models as em
from agentenv.node.api import read_model
from agentenv.node.errors import BadRequest, NotFound
from agentenv.node.events import TYPES, EventLog
from agentenv.node.tenancy import scope_team
from agentenv.node.webhooks import Webhook, Webhooks

MAX_EVENTS_PAGE = 100
MAX_ATTEMPTS_PAGE = 1000


def query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise BadRequest(f"{name} must be an integer, got {raw!r}") from exc
    if not low <= value <= high:
        raise BadRequest(f"{name} must be between {low} and {high}, got {value}")
    return value


class EventsApi:
    def __init__(self, events: EventLog, webhooks: Webhooks) -> None:
        self.events = events
        self.webhooks = webhooks

    def routes(self) -> list[Route]:
        r = Route
        return [
            r("/events/sandboxes", self.list_events, methods=["GET"]),
            r("/events/sandboxes/{sandbox_id}", self.list_events, methods=["GET"]),
            r("/events/webhooks", self.list_webhooks, methods=["GET"]),
            r("/events/webhooks", self.create_webhook, methods=["POST"]),
            r("/events/webhooks/{webhook_id}", self.get_webhook, methods=["GET"]),
            r("/events/webhooks/{webhook_id}", self.update_webhook, methods=["PATCH"]),
            r("/events/webhooks/{webhook_id}", self.delete_webhook, methods=["DELETE"]),
            r("/events/webhooks/{webhook_id}/deliveries", self.deliveries, methods=["GET"]),
        ]

    async def list_events(self, request: Request) -> Response:
        """E2B's paging (offset, limit 1-100 default 10, orderAsc, repeated types), and `after`
        (a seq: only newer events) for a poller that must not miss or repeat any."""
        types = request.query_params.getlist("types")
        unknown = sorted(set(types) - set(TYPES))
        if unknown:
            raise BadRequest(f"unknown event types {unknown}: known are {list(TYPES)}")
        order = request.query_params.get("orderAsc", "false").lower()
        if order not in ("true", "false"):
            raise BadRequest(f"orderAsc must be true or false, got {order!r}")
        found = await self.events.query(
            scope_team(request.scope), sandbox_id=request.path_params.get("sandbox_id"),
            types=types, after=query_int(request, "after", 0, 0, 2**62),
            offset=query_int(request, "offset", 0, 0, 2**31),
            limit=query_int(request, "limit", 10, 1, MAX_EVENTS_PAGE), ascending=order == "true")
        return JSONResponse([em.SandboxEvent(**e.to_json()).body() for e in found])

    def _hook(self, request: Request) -> Webhook:
        webhook_id = request.path_params["webhook_id"]
        hook = self.webhooks.get(scope_team(request.scope), webhook_id)
        if hook is None:
            raise NotFound(f"webhook {webhook_id!r} not found")
        return hook

    @staticmethod
    def _json(hook: Webhook, status: int = 200) -> Response:
        return JSONResponse(em.Webhook(**hook.public()).body(), status_code=status)

    async def list_webhooks(self, request: Request) -> Response:
        return JSONResponse([em.Webhook(**h.public()).body()
                             for h in self.webhooks.of_team(scope_team(request.scope))])

    async def create_webhook(self, request: Request) -> Response:
        body = await read_model(request, em.NewWebhook)
        hook = await self.webhooks.register(
            scope_team(request.scope), body.name, body.url, list(dict.fromkeys(body.events)),
            body.enabled, body.signatureSecret)
        return self._json(hook, 201)

    async def get_webhook(self, request: Request) -> Response:
        return self._json(self._hook(request))

    async def update_webhook(self, request: Request) -> Response:
        hook = self._hook(request)
        body = await read_model(request, em.WebhookUpdate)
        await self.webhooks.update(hook, body.model_dump(exclude_none=True))
        return self._json(hook)

    async def delete_webhook(self, request: Request) -> Response:
        await self.webhooks.delete(self._hook(request))
        return Response(status_code=200)

    async def deliveries(self, request: Request) -> Response:
        """The webhook's delivery log, newest attempt first (this node's, not E2B's)."""
        hook = self._hook(request)
        limit = query_int(request, "limit", 100, 1, MAX_ATTEMPTS_PAGE)
        return JSONResponse([em.WebhookAttempt(**a).body()
                             for a in await self.webhooks.store.webhook_attempts(hook.id, limit)])
