"""Routes of the lifecycle events (E2B's `/events/sandboxes`) and the teams' webhooks
(`/events/webhooks`); node/events.py and node/webhooks.py do the work.

A node of a cluster serves its events to the gateway (CLUSTER_EVENTS_PATH, every team's, its
node key only), which stores them in the cluster's Redis and answers `/events/*` itself and
delivers the webhooks (control/gateway/events.py): such a node registers no webhook.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentenv.api import event_models as em
from agentenv.api.bodies import Endpoint, read_model
from agentenv.api.errors import BadRequest, Conflict, NotFound
from agentenv.api.event_models import TYPES
from agentenv.api.routes import CLUSTER_EVENTS_PATH
from agentenv.api.tenancy import LOCAL_TEAM, scope_team
from agentenv.node.events import EventLog
from agentenv.node.webhooks import Webhook, Webhooks

MAX_EVENTS_PAGE = 100
MAX_ATTEMPTS_PAGE = 1000
MAX_CLUSTER_PAGE = 1000
#: seconds a long poll of `/cluster/events` may wait for the node's next event
MAX_CLUSTER_WAIT = 30


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


@dataclass(frozen=True)
class EventQuery:
    """The filters and paging of `GET /events/sandboxes[/{id}]`: E2B's (offset, limit 1-100
    default 10, orderAsc, repeated types), and `after` / `before` (seqs: only newer / older
    events; 0: no bound): the cursors of a poller that must not miss or repeat any, and of a
    reader paging back from the newest (`before` = the last seq of the page read) without
    the cost of an ever larger offset. The node and the gateway parse them here."""

    types: list[str]
    after: int
    offset: int
    limit: int
    ascending: bool
    before: int = 0

    @classmethod
    def parse(cls, request: Request) -> EventQuery:
        types = request.query_params.getlist("types")
        unknown = sorted(set(types) - set(TYPES))
        if unknown:
            raise BadRequest(f"unknown event types {unknown}: known are {list(TYPES)}")
        order = request.query_params.get("orderAsc", "false").lower()
        if order not in ("true", "false"):
            raise BadRequest(f"orderAsc must be true or false, got {order!r}")
        return cls(types=types, after=query_int(request, "after", 0, 0, 2**62),
                   offset=query_int(request, "offset", 0, 0, 2**31),
                   limit=query_int(request, "limit", 10, 1, MAX_EVENTS_PAGE),
                   ascending=order == "true",
                   before=query_int(request, "before", 0, 0, 2**62))


class EventsApi:
    def __init__(self, events: EventLog, webhooks: Webhooks, cluster: bool = False) -> None:
        """`cluster`: a node of a cluster (its gateway delivers the webhooks)."""
        self.events = events
        self.webhooks = webhooks
        self.cluster = cluster

    def handlers(self) -> dict[str, Endpoint]:
        """The operations of the route table (agentenv.api.routes) this serves."""
        return {
            "listSandboxEvents": self.list_events, "listSandboxEventsOfSandbox": self.list_events,
            "listWebhooks": self.list_webhooks, "createWebhook": self.create_webhook,
            "getWebhook": self.get_webhook, "updateWebhook": self.update_webhook,
            "deleteWebhook": self.delete_webhook, "listWebhookDeliveries": self.deliveries,
            "clusterEvents": self.cluster_events,
        }

    async def list_events(self, request: Request) -> Response:
        q = EventQuery.parse(request)
        found = await self.events.query(
            scope_team(request.scope), sandbox_id=request.path_params.get("sandbox_id"),
            types=q.types, after=q.after, before=q.before or None, offset=q.offset,
            limit=q.limit, ascending=q.ascending)
        return JSONResponse([em.SandboxEvent(**e.to_json()).body() for e in found])

    async def cluster_events(self, request: Request) -> Response:
        """Every team's events after `after`, oldest first, and `last`, the last seq the
        node's store ever gave: for the gateway's collector (control/gateway/events.py);
        `wait=<s>` (0-30) makes it a long poll that answers as soon as an event is stored
        (EventLog.since). A team-less route that only the node key opens (node/api.py); a
        standalone node has no gateway, and no such route."""
        if not self.cluster or scope_team(request.scope) != LOCAL_TEAM:
            # a request that names a team is some team's: never every team's events (a relay
            # of the gateway that passed this path on with a team's header would open them)
            raise NotFound(f"route not found: GET {CLUSTER_EVENTS_PATH}")
        found, last = await self.events.since(
            query_int(request, "after", 0, 0, 2**62),
            query_int(request, "limit", 100, 1, MAX_CLUSTER_PAGE),
            query_int(request, "wait", 0, 0, MAX_CLUSTER_WAIT))
        return JSONResponse({"events": [{**e.to_json(), "ts": e.timestamp} for e in found],
                             "last": last})

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
        if self.cluster:
            raise Conflict("a node of a cluster delivers no webhooks: the gateway does "
                           "(register them through it)")
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
