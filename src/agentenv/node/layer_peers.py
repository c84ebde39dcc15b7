"""P2P between nodes through the scheduler: what this node's blockd serves goes up in the
heartbeats, and blockd learns from the node which peers hold a blob (docs/remote-layers.md §4).

- Each heartbeat asks blockd (`remote_held`) for its chunk server's address and the blobs its
  chunk cache holds whole and in part; they become NodeStatus.layer_address, blobs and
  partial_blobs, and the scheduler keeps digest -> holders.
- The node serves `GET /cluster/holders?digest=sha256:...` (behind the API key or the cluster
  secret, like any control route): it asks the scheduler's Holders for the up nodes holding the
  blob, this node left out, and answers {"holders": [{"address", "complete"}]}.
- Each heartbeat also tells blockd (`remote_peers {resolver, serve_key}`) to ask that route,
  with the headers that pass the node's check, and the key its chunk server checks peers'
  credentials with (derived from this node's key: agentenv.cluster_keys), so a blockd that was
  restarted learns both again. blockd caches the answers briefly, asks the holders before the
  registry (each with the credential the scheduler issued this node for it) and falls back to
  the registry.

blockd never imports the control plane: the node is the one that talks to the scheduler.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentenv.blockd.client import AsyncBlockdClient
from agentenv.blockd.errors import BlockdError
from agentenv.scheduling.client import Credentials, SchedulerClient, SchedulerError, pb
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.node.layer_peers")

HOLDERS_PATH = "/cluster/holders"
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def blockd_socket_of(backend: object) -> Path | None:
    """The blockd this node's remote layers go through: the VM backend's (private or shared),
    else the one named by AENV_BLOCKD_SOCKET (a process-backend node beside a blockd)."""
    link = getattr(backend, "blockd", None)
    sock = getattr(link, "socket", None) or get_settings().blockd_socket
    return Path(sock) if sock else None


def _host_port(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    return host, port


class LayerPeers:
    def __init__(self, scheduler: str, credentials: Credentials, node_id: str, api_url: str,
                 api_headers: dict[str, str], blockd_socket: Callable[[], Path | None],
                 advertise_host: str, api_ca: Path | None = None,
                 serve_key: str | None = None) -> None:
        """`api_url`: this node's API as blockd reaches it; `api_headers`: what passes its
        check; `api_ca`: what its certificate is checked with where it serves TLS;
        `advertise_host`: replaces a wildcard host of the chunk server; `serve_key`: what
        blockd's chunk server checks peers' credentials with (cluster_keys.peer_serve_key)."""
        self.serve_key = serve_key
        self.scheduler = scheduler
        self.credentials = credentials  # the node's own (Holders for its own id only)
        self.node_id = node_id
        self.resolver: dict[str, Any] = {"url": api_url.rstrip("/") + HOLDERS_PATH,
                                         "headers": api_headers}
        if api_ca is not None:
            self.resolver["ca"] = str(api_ca)
        self.blockd_socket = blockd_socket
        self.advertise_host = advertise_host
        self._client: SchedulerClient | None = None
        self._blockd: AsyncBlockdClient | None = None
        self._failed = False
        self.asked = 0

    def route(self) -> Route:
        return Route(HOLDERS_PATH, self.holders_endpoint, methods=["GET"])

    async def holders_endpoint(self, request: Request) -> JSONResponse:
        digest = request.query_params.get("digest", "")
        if not DIGEST_RE.fullmatch(digest):
            return JSONResponse({"code": 400, "message":
                                 f"digest {digest[:80]!r} is not sha256:<64 lowercase hex>"}, 400)
        if self._client is None:  # made here: a grpc.aio channel belongs to the running loop
            self._client = SchedulerClient(self.scheduler, self.credentials, timeout=2.0)
        self.asked += 1
        try:
            found = await self._client.holders([digest], node_id=self.node_id)
        except SchedulerError as exc:
            return JSONResponse({"code": 503, "message": str(exc)}, 503)
        return JSONResponse({"holders": [
            {"address": f"http://{h.layer_address}", "complete": h.complete,
             "node_id": h.node_id, "credential": h.credential}
            for h in found.get(digest, [])
        ]})

    async def fill(self, msg: pb.NodeStatus) -> None:
        """Add blockd's chunk server and held blobs to a heartbeat, and (re)tell blockd where
        to ask for holders. A blockd that cannot answer leaves the heartbeat without them."""
        sock = self.blockd_socket()
        if sock is None:
            return
        if self._blockd is None or self._blockd.socket_path != sock:
            self._blockd = AsyncBlockdClient(sock)
        try:
            held: dict[str, Any] = await self._blockd.call("remote_held")
            if self.serve_key is not None:
                await self._blockd.call("remote_peers", resolver=self.resolver,
                                        serve_key=self.serve_key)
            else:
                await self._blockd.call("remote_peers", resolver=self.resolver)
        except (BlockdError, OSError) as exc:
            if not self._failed:  # once per outage: blockd restarting is no news every 2 s
                log.warning("cannot report the blobs blockd holds: %s", exc)
            self._failed = True
            await self._blockd.close()
            return
        self._failed = False
        p2p = held.get("p2p")
        if p2p and not msg.layer_address:
            host, port = _host_port(p2p)
            msg.layer_address = f"{self.advertise_host if host in WILDCARDS else host}:{port}"
        msg.blobs.extend(held.get("blobs") or ())
        msg.partial_blobs.extend(held.get("partial") or ())

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
        if self._blockd is not None:
            await self._blockd.close()
