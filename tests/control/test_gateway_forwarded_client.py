"""What a node's connection bounds see of a request its gateway relays (relay/connections.py):
the gateway's requests carry the node's key, which the node's bounds take as the gateway's
(node/server.py `connection_limits`), and the client's address as the gateway saw it
(X-Forwarded-For), never what the client wrote in that header itself. The bounds themselves,
on a real server: tests/node/test_connection_limits.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from agentenv.cluster_keys import node_key
from agentenv.control.gateway.nodes import NodeLink
from agentenv.control.gateway.placement import Node
from agentenv.node.server import connection_limits

SECRET = "s" * 43
NODE = Node("node0", "127.0.0.1:8000")


def _link() -> NodeLink:
    relay: Any = SimpleNamespace(client=None)  # the headers need no scheduler, store or relay
    return NodeLink(None, None, SECRET, relay, None, 60)  # type: ignore[arg-type]


def _scope(client: str, *headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/files", "raw_path": b"/files",
            "query_string": b"", "scheme": "http", "client": (client, 5555),
            "headers": [(b"host", b"gw"), (b"content-length", b"3"), *headers]}


@pytest.mark.parametrize("forged", [
    [],
    [(b"x-forwarded-for", b"192.0.2.1")],
    [(b"x-forwarded-for", b"192.0.2.1"), (b"x-forwarded-for", b"192.0.2.2, 192.0.2.3")],
    [(b"x-agentenv-node-key", b"forged"), (b"x-real-ip", b"192.0.2.4")],
])
def test_the_node_bounds_a_relayed_body_as_the_client_the_gateway_saw(
        forged: list[tuple[bytes, bytes]]) -> None:
    limits = connection_limits(node_key(SECRET, NODE.node_id))
    link = _link()
    scope = _scope("198.51.100.7", *forged)
    for headers in (link.to_sandbox_headers(scope, NODE, "sbx", 49983, "team"),
                    link._headers(Request(scope), NODE, "team")):
        assert limits.vouch is not None and limits.vouch(headers)
        assert limits.forwarded_client(headers) == "198.51.100.7"


def test_another_nodes_key_or_none_is_not_the_gateway() -> None:
    limits = connection_limits(node_key(SECRET, "node1"))
    headers = _link().to_sandbox_headers(_scope("198.51.100.7"), NODE, "sbx", 49983, "team")
    assert limits.vouch is not None and not limits.vouch(headers)
    assert connection_limits(None).vouch is None  # a standalone node: the peer is the client
