"""Teams' webhooks: lifecycle events (node/events.py) POSTed to a URL, signed as E2B does.

Signature (E2B's documented scheme, so receivers written for E2B verify ours): header
`e2b-signature` = unpadded URL-safe base64 of SHA-256(secret + raw body), with
`e2b-signature-version: v1`, `e2b-webhook-id` and `e2b-delivery-id` (one id per event and
webhook, the same on every retry). SHA-256(secret + body) is a keyed hash, not an HMAC, so
each delivery also carries `aenv-signature: v1=<base64 HMAC-SHA256(secret, body)>` for
receivers that can check the stronger one.

Delivery never blocks a lifecycle operation: `offer` only puts the event on the webhook's own
bounded queue (the oldest waiting event is dropped, and logged, when it is full), and one
worker per webhook posts them in order, each attempt bounded by a timeout and retried with
exponential back-off. A slow or dead receiver therefore costs its own queue and worker, and no
other webhook's. Every attempt is a row of the delivery log (`GET
/events/webhooks/{id}/deliveries`): status code or error, duration.

Destinations: http(s) only. A cluster's gateway (which delivers a cluster's webhooks with
`deliver`: control/gateway/events.py) serves many teams, so there a URL whose host
is (or resolves to) a loopback, private, link-local or otherwise non-global address is refused
at registration unless AENV_WEBHOOK_ALLOW_PRIVATE=1, and each delivery resolves the host again,
checks every address and connects to the one checked (`pinned`; TLS still checks the name). A
standalone node's API key holder owns the host and may aim at it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from agentenv.api.errors import BadRequest
from agentenv.api.models import iso
from agentenv.node.events import Event
from agentenv.node.store import Store
from agentenv.registry.client import address_problem
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.node.webhooks")

ALLOW_PRIVATE_ENV = "AENV_WEBHOOK_ALLOW_PRIVATE"
MAX_WEBHOOKS_PER_TEAM = 20


@dataclass(frozen=True)
class DeliveryPolicy:
    queue_size: int = 1000  # events waiting per webhook
    attempts: int = 4  # the first and three retries
    backoff: float = 2.0  # seconds before the first retry, doubled after each
    timeout: float = 10.0  # seconds per attempt

    @classmethod
    def from_env(cls) -> DeliveryPolicy:
        s = get_settings()
        return cls(queue_size=s.webhook_queue, attempts=s.webhook_attempts,
                   backoff=s.webhook_backoff, timeout=s.webhook_timeout)


def e2b_signature(secret: str, body: bytes) -> str:
    digest = hashlib.sha256(secret.encode() + body).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def hmac_signature(secret: str, body: bytes) -> str:
    return "v1=" + base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest()
                                    ).decode()


def check_destination(url: str, allow_private: bool) -> None:
    """400 unless `url` is an http(s) URL this node may post to (module doc)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest(f"webhook url must be an http or https URL, got {url!r}")
    if not allow_private:
        public_address(parts.hostname)


def public_address(host: str) -> str:
    """An address of `host`, if every address it resolves to is a public one (else 400)."""
    try:
        infos = socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise BadRequest(f"webhook host {host!r} does not resolve: {exc}") from exc
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for address in addresses:
        # the registry client's guard: is_global alone admits NAT64 and 6to4 forms of
        # private IPv4 addresses and site-local IPv6
        problem = address_problem(address)
        if problem is not None:
            raise BadRequest(f"webhook host {host!r} is a non-public address ({address}, "
                             f"{problem}): not allowed on a node of a cluster")
    return str(addresses[0])


def pinned(url: str) -> tuple[str, dict[str, str], dict[str, Any]]:
    """`url` aimed at a public address of its host, checked now (blocking: it resolves):
    (the URL with that address, the Host header, httpx extensions naming the host for TLS).
    The connection then goes where the check looked, whatever the name resolves to next (a
    name that answers a public address at registration and a private one later gets nowhere)."""
    parts = urlsplit(url)
    assert parts.hostname is not None  # check_destination at registration
    address = public_address(parts.hostname)
    literal = f"[{address}]" if ":" in address else address
    netloc = literal if parts.port is None else f"{literal}:{parts.port}"
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return parts._replace(netloc=netloc).geturl(), {"host": parts.netloc.rpartition("@")[2]}, \
        extensions


@dataclass
class Webhook:
    id: str
    team: str
    name: str
    url: str
    events: list[str]
    enabled: bool
    secret: str
    created_at: float
    queue: asyncio.Queue[Event] = field(init=False, repr=False)
    worker: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    dropped: int = field(default=0, init=False)

    def doc(self) -> dict[str, Any]:
        return {"id": self.id, "team": self.team, "name": self.name, "url": self.url,
                "events": self.events, "enabled": self.enabled, "secret": self.secret,
                "created_at": self.created_at}

    def public(self) -> dict[str, Any]:
        """E2B's webhook answer: never the secret."""
        return {"id": self.id, "teamID": self.team, "name": self.name,
                "createdAt": iso(self.created_at), "enabled": self.enabled, "url": self.url,
                "events": self.events, "queued": self.queue.qsize(), "dropped": self.dropped}


class Webhooks:
    def __init__(self, store: Store, policy: DeliveryPolicy, allow_private: bool) -> None:
        self.store = store
        self.policy = policy
        self.allow_private = allow_private
        self.hooks: dict[str, Webhook] = {}
        self._running = False

    async def start(self) -> None:
        self._running = True
        for doc in await self.store.load_webhooks():
            self._activate(Webhook(id=doc["id"], team=doc["team"], name=doc["name"],
                                   url=doc["url"], events=list(doc["events"]),
                                   enabled=doc["enabled"], secret=doc["secret"],
                                   created_at=doc["created_at"]))

    async def stop(self) -> None:
        self._running = False
        for hook in list(self.hooks.values()):
            await self._deactivate(hook)

    def _activate(self, hook: Webhook) -> None:
        hook.queue = asyncio.Queue(self.policy.queue_size)
        self.hooks[hook.id] = hook
        if self._running:
            hook.worker = asyncio.create_task(self._deliver_forever(hook), name=f"webhook:{hook.id}")

    async def _deactivate(self, hook: Webhook) -> None:
        if hook.worker is not None:
            hook.worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hook.worker
            hook.worker = None

    # --- registration --------------------------------------------------------------------

    def of_team(self, team: str) -> list[Webhook]:
        return sorted((h for h in self.hooks.values() if h.team == team),
                      key=lambda h: (h.created_at, h.id))

    def get(self, team: str, webhook_id: str) -> Webhook | None:
        hook = self.hooks.get(webhook_id)
        return hook if hook is not None and hook.team == team else None

    async def register(self, team: str, name: str, url: str, events: list[str], enabled: bool,
                       secret: str) -> Webhook:
        if len(self.of_team(team)) >= MAX_WEBHOOKS_PER_TEAM:
            raise BadRequest(f"a team has at most {MAX_WEBHOOKS_PER_TEAM} webhooks")
        await asyncio.to_thread(check_destination, url, self.allow_private)
        hook = Webhook(id=str(uuid.uuid4()), team=team, name=name, url=url, events=events,
                       enabled=enabled, secret=secret, created_at=time.time())
        await self.store.put_webhook(hook.id, team, hook.doc())
        self._activate(hook)
        return hook

    async def update(self, hook: Webhook, changes: dict[str, Any]) -> None:
        if "url" in changes:
            await asyncio.to_thread(check_destination, changes["url"], self.allow_private)
        for key in ("name", "url", "events", "enabled"):
            if key in changes:
                setattr(hook, key, changes[key])
        if "signatureSecret" in changes:
            hook.secret = changes["signatureSecret"]
        await self.store.put_webhook(hook.id, hook.team, hook.doc())

    async def delete(self, hook: Webhook) -> None:
        self.hooks.pop(hook.id, None)
        await self._deactivate(hook)
        await self.store.delete_webhook(hook.id)

    # --- delivery --------------------------------------------------------------------------

    def offer(self, event: Event) -> None:
        """An EventLog listener: queue `event` for each of its team's webhooks that want it."""
        for hook in self.hooks.values():
            if hook.team != event.team or not hook.enabled or event.type not in hook.events:
                continue
            if hook.queue.full():  # the receiver is behind: its oldest event goes
                lost = hook.queue.get_nowait()
                hook.dropped += 1
                log.warning("webhook queue full: event dropped",
                            extra={"webhook_id": hook.id, "event_id": lost.id})
            hook.queue.put_nowait(event)

    async def _deliver_forever(self, hook: Webhook) -> None:
        async with httpx.AsyncClient(timeout=self.policy.timeout, trust_env=False,
                                     follow_redirects=False) as client:
            while True:
                event = await hook.queue.get()
                try:
                    await self._deliver(client, hook, event)
                except Exception:
                    log.exception("webhook delivery crashed", extra={"webhook_id": hook.id})

    async def _deliver(self, client: httpx.AsyncClient, hook: Webhook, event: Event) -> None:
        async def record(began: float, attempt: dict[str, Any]) -> None:
            await self.store.add_webhook_attempt(hook.id, began, attempt)

        await deliver(client, self.policy, self.allow_private, hook.id, hook.url, hook.secret,
                      event, record)


#: where an attempt of a delivery is logged: (when it began, the attempt's row)
AttemptLog = Callable[[float, dict[str, Any]], Awaitable[None]]


async def deliver(client: httpx.AsyncClient, policy: DeliveryPolicy, allow_private: bool,
                  webhook_id: str, url: str, secret: str, event: Event,
                  record: AttemptLog) -> bool:
    """POST `event` to a webhook, signed (module doc), retried with back-off per `policy`,
    each attempt logged with `record`; True once delivered. Used by the node's webhooks and by
    a cluster's gateway (control/gateway/events.py)."""
    body = json.dumps(event.to_json(), separators=(",", ":")).encode()
    delivery_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{webhook_id}/{event.id}"))
    headers = {"content-type": "application/json", "e2b-webhook-id": webhook_id,
               "e2b-delivery-id": delivery_id, "e2b-signature-version": "v1",
               "e2b-signature": e2b_signature(secret, body),
               "aenv-signature": hmac_signature(secret, body)}
    for attempt in range(1, policy.attempts + 1):
        began = time.time()
        status: int | None = None
        error: str | None = None
        try:
            target, host, extensions = url, {}, {}
            if not allow_private:
                target, host, extensions = await asyncio.to_thread(pinned, url)
            answer = await client.post(target, content=body, headers={**headers, **host},
                                       extensions=extensions)
            status = answer.status_code
            if not 200 <= status < 300:
                error = f"HTTP {status}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except BadRequest as exc:  # the host resolves to a non-public address now
            error = exc.message
        with contextlib.suppress(Exception):
            await record(began, {
                "deliveryId": delivery_id, "eventId": event.id, "eventType": event.type,
                "attempt": attempt, "timestamp": iso(began), "status": status,
                "error": error, "seconds": round(time.time() - began, 3),
                "delivered": error is None})
        if error is None:
            return True
        if attempt < policy.attempts:
            await asyncio.sleep(policy.backoff * 2 ** (attempt - 1))
    log.warning("webhook delivery failed", extra={"webhook_id": webhook_id,
                                                  "event_id": event.id})
    return False
