"""Who may call what: the credentials of the E2B contract that the node and the gateway
both check or send (the route table's auth kinds, agentenv.api.routes).

A node of a cluster serves only its gateway, which sends every request with that node's key
(NODE_KEY_HEADER; agentenv.cluster_keys.node_key) and the team it is for (api/tenancy.py);
Prometheus scrapers present the cluster's metrics token as a bearer token.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence


def same_secret(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


#: the header a gateway sends every request to a node of a cluster with: that node's key
#: (agentenv.cluster_keys.node_key), which no other node's key passes
NODE_KEY_HEADER = b"x-agentenv-node-key"


def carries_node_key(scope_headers: Sequence[tuple[bytes, bytes]], node_key: str) -> bool:
    """Whether a request carries exactly one NODE_KEY_HEADER, and it is `node_key` (constant
    time): a request of the node's gateway."""
    given = [v for n, v in scope_headers if n == NODE_KEY_HEADER]
    return len(given) == 1 and same_secret(given[0].decode("latin-1"), node_key)


#: a node route only its gateway calls: which sandbox of the node made a file signature
SIGNATURE_OWNER_PATH = "/cluster/file-signature-owner"


#: what a Prometheus scraper of a cluster presents (`Authorization: Bearer TOKEN`): derived from
#: the cluster secret, good for the nodes' and gateways' /metrics and nothing else
METRICS_TOKEN_CONTEXT = b"agentenv metrics v1"


def metrics_token(cluster_secret: str) -> str:
    return hmac.new(cluster_secret.encode(), METRICS_TOKEN_CONTEXT, hashlib.sha256).hexdigest()


def bearer_is(scope_headers: list[tuple[bytes, bytes]], token: str) -> bool:
    """Whether the request carries exactly one `Authorization: Bearer token` (constant time)."""
    given = [v for n, v in scope_headers if n == b"authorization"]
    if len(given) != 1 or not given[0].startswith(b"Bearer "):
        return False
    return hmac.compare_digest(given[0][7:].strip(), token.encode())
