"""The gateway's ASGI app: the E2B API of a whole cluster on one address.

Sandbox traffic is relayed to the node holding the sandbox (sandbox_relay.py), signed file URLs
to the node of the sandbox that signed them (signed.py); the control API serves the route table
of agentenv.api (dispatch.py) with the handlers of this package, one module per concern: each
route goes to the node the scheduler chose (create.py: creates, batches and forks, with their
idempotency leases; templates.py: builds) or the node holding what it names (sandboxes.py,
templates.py, volumes.py), and listings merge every node's (listing.py). A team sees only its
own sandboxes, templates, snapshots and volumes (404 for the rest); templates no team built (a
node's built-in `base`) are everybody's. How requests reach a node, and where a team's things
are: nodes.py. This module wires them.
"""

from __future__ import annotations

import ssl
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request

from agentenv import __version__
from agentenv.api.auth import bearer_is, metrics_token
from agentenv.api.openapi import openapi_document
from agentenv.control.gateway.create import Creates
from agentenv.control.gateway.dispatch import Dispatch, Handler
from agentenv.control.gateway.events import ClusterEvents
from agentenv.control.gateway.limits import (
    UNKNOWN_SANDBOXES,
    GatewayQuotas,
    LookupLimiter,
    TeamShares,
)
from agentenv.control.gateway.listing import Listings
from agentenv.control.gateway.metrics import GatewayMetrics
from agentenv.control.gateway.nodes import (
    GatewayError,
    NodeLink,
    Scope,
    control_body_seconds,
)
from agentenv.control.gateway.placement import SchedulerLink
from agentenv.control.gateway.sandbox_relay import SandboxRelay, answer_gone, answer_unreachable
from agentenv.control.gateway.sandboxes import Sandboxes
from agentenv.control.gateway.signed import SignedFiles
from agentenv.control.gateway.store import GatewayStore
from agentenv.control.gateway.templates import Templates
from agentenv.control.gateway.volumes import Volumes
from agentenv.errors import AgentEnvError
from agentenv.relay.answers import send_json
from agentenv.relay.stream import Relay, RelayLimits, Send


class GatewayApp:
    """ASGI app of `aenv gateway`."""

    def __init__(self, scheduler: SchedulerLink, store: GatewayStore, cluster_secret: str,
                 domain: str | None = None, limits: RelayLimits | None = None,
                 public_metrics: bool = False, node_tls: ssl.SSLContext | None = None) -> None:
        """`node_tls`: what the nodes' certificates are checked with where they serve TLS
        (relay/tls.py; the scheduler link's node scheme is then https)."""
        self.scheduler = scheduler
        self.store = store
        # /metrics: for a scraper with the cluster's metrics token, or anyone when public
        self.metrics_token = None if public_metrics else metrics_token(cluster_secret)
        self.limits = limits or RelayLimits.from_env()
        self.metrics = GatewayMetrics()
        # control/gateway/limits.py
        quotas = GatewayQuotas(store, scheduler, self.metrics.limit_refusals)
        team_shares = TeamShares.from_env(self.metrics.limit_refusals)
        # Traffic to a team's sandboxes and its signed file URLs need no key: anyone who
        # knows a sandbox id sends it. Its own share, so a stranger's slow requests cannot
        # hold the places of the team's control requests (the red team's finding 3).
        traffic_shares = TeamShares.from_env(self.metrics.limit_refusals)
        self.relay = Relay(self.limits, answer_gone, answer_unreachable(scheduler),
                           limit_name="the gateway's", tls=node_tls)
        self.link = NodeLink(scheduler, store, cluster_secret, self.relay, domain,
                             control_body_seconds())
        self.creates = Creates(self.link, scheduler, store, quotas, self.metrics)
        self.listings = Listings(self.link, scheduler, store)
        self.sandboxes = Sandboxes(self.link, scheduler, store, quotas)
        self.templates = Templates(self.link, scheduler, store, quotas, team_shares,
                                   self.creates.batches.drop_copies)
        self.volumes = Volumes(self.link, scheduler, store, team_shares)
        # events and webhooks in Redis, collected from the nodes (control/gateway/events.py)
        self.events = ClusterEvents(store.redis, scheduler.nodes, self.link.http,
                                    lambda node: self.link.node_headers(node, None),
                                    self.link.body, self.metrics)
        self.signed_files = SignedFiles(self.link, self.metrics,
                                        LookupLimiter.from_env(self.metrics.limit_refusals),
                                        traffic_shares)
        # a stranger's traffic for made-up sandbox ids: each a scheduler lookup, so limited
        # per client (the red team's finding 5)
        misses = LookupLimiter.from_env(self.metrics.limit_refusals, kind=UNKNOWN_SANDBOXES)
        self.dispatch = Dispatch(self._handlers(), store,
                                 SandboxRelay(self.link, traffic_shares, misses),
                                 self.signed_files, team_shares, self.metrics)
        if self.dispatch.unserved:  # every operation of the table but the nodes' own
            raise AgentEnvError("the gateway serves no handler for "
                                + ", ".join(op.operation_id for op in self.dispatch.unserved))

    def _handlers(self) -> dict[str, Handler]:
        """The gateway's handlers of the route table's operations (agentenv.api.routes)."""
        c, li, s, t, v = (self.creates, self.listings, self.sandboxes, self.templates,
                          self.volumes)
        forward = s.sandbox_forward
        return {
            "health": self.health, "openapi": self.openapi, "metrics": self.prometheus,
            "createSandbox": c.create, "createSandboxV2": c.create,
            "listSandboxes": li.list_v1, "listSandboxesV2": li.list_v2,
            "getSandbox": forward, "killSandbox": s.kill, "setSandboxTimeout": forward,
            "refreshSandbox": forward, "pauseSandbox": forward, "resumeSandbox": forward,
            "connectSandbox": forward, "connectSandboxV2": forward,
            "getSandboxMetrics": forward, "createSnapshot": s.snapshot,
            "forkSandbox": c.fork, "rollbackSandbox": forward,
            "listSandboxChildren": forward, "updateSandboxNetwork": forward,
            "listSnapshots": li.list_snapshots, "forkSnapshot": c.snapshot_fork,
            "listSnapshotChildren": s.snapshot_forward, "getSnapshot": s.snapshot_forward,
            "createTemplateV3": t.build_template, "assignTemplateTags": t.tags_change,
            "deleteTemplateTags": t.tags_change, "listTemplates": li.list_templates,
            "listTemplatesV2": li.list_templates, "getTemplateByAlias": t.template_alias,
            "getTemplateFilesUploadLink": t.template_forward,
            "startTemplateBuildV2": t.build_start,
            "getTemplateBuildStatus": t.template_forward,
            "getTemplateTags": t.template_forward, "getTemplate": t.template_forward,
            "deleteTemplate": t.delete_template, "uploadTemplateFiles": t.template_files,
            "listNodes": li.list_nodes, "getNode": li.node_detail,
            "getSandboxesMetrics": li.batch_metrics, "getSandboxLogs": forward,
            "getSandboxLogsV2": forward,
            "listVolumes": v.list_volumes, "createVolume": v.create_volume,
            "getVolume": v.volume_forward, "deleteVolume": v.delete_volume,
            "commitVolume": v.volume_forward,
            **{op: v.content for op in ("statVolumePath", "updateVolumePath", "removeVolumePath",
                                        "listVolumeDir", "makeVolumeDir", "readVolumeFile",
                                        "writeVolumeFile")},
            **self.events.handlers(),
        }

    async def close(self) -> None:
        await self.events.stop()
        await self.relay.close()
        await self.scheduler.close()
        await self.store.close()

    async def __call__(self, scope: Scope, receive: Any, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:
            await self.dispatch(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.events.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- the gateway's own routes --------------------------------------------------------------

    async def health(self, request: Request, send: Send, team: str) -> None:
        await send_json(send, 200, {"status": "ok", "version": __version__})

    async def openapi(self, request: Request, send: Send, team: str) -> None:
        await send_json(send, 200, openapi_document())

    async def prometheus(self, request: Request, send: Send, team: str) -> None:
        if self.metrics_token and not bearer_is(request.scope["headers"], self.metrics_token):
            raise GatewayError(401, "/metrics needs Authorization: Bearer with the cluster's "
                               "metrics token (aenv metrics-token)")
        payload = generate_latest(self.metrics.registry)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", CONTENT_TYPE_LATEST.encode()),
            (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
