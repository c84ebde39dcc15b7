"""The gateway's relay caps a WebSocket message from the sandbox side too: a message larger
than the gateway's AENV_PROXY_MAX_WS_MESSAGE_BYTES (but within the node's) closes the client's
WebSocket with 1009 instead of being gathered and passed on (one process-backend node: its
sandbox's ports are this host's, the server runs here)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.control.cluster import LocalCluster, running
from tests.node.conftest import free_host_port

pytestmark = pytest.mark.timeout(300)
GATEWAY_LIMIT = 1 << 20
MESSAGE = 4 << 20  # under the node's 16 MiB default, over the gateway's limit


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    made = LocalCluster(Path(tmp_path_factory.mktemp("wscluster")), nodes=1)
    made.gateway.env = {**made.gateway.env,
                        "AENV_PROXY_MAX_WS_MESSAGE_BYTES": str(GATEWAY_LIMIT)}
    with running(made, "alpha") as started:
        yield started


def test_a_message_over_the_gateways_limit_closes_with_1009(cluster: LocalCluster) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect
    from websockets.sync.server import serve

    def big(ws: Any) -> None:
        ws.recv()
        ws.send(b"z" * MESSAGE)
        ws.recv()  # held open: only the gateway ends this exchange

    port = free_host_port()  # opened to process sandboxes (tests/node/conftest.py)
    key = {"X-API-KEY": cluster.keys["alpha"]}
    with serve(big, "127.0.0.1", port, max_size=None) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        created = httpx.post(f"{cluster.url}/v2/sandboxes", headers=key, timeout=60,
                             json={"templateID": "base", "timeout": 120})
        assert created.status_code == 201, created.text
        sid = created.json()["sandboxID"]
        try:
            ws_url = cluster.url.replace("http://", "ws://") + "/ws"
            with connect(ws_url, max_size=None, additional_headers={
                    "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)}) as ws:
                ws.send("go")
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=60)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
            assert f"over {GATEWAY_LIMIT} bytes" in closed.value.rcvd.reason
        finally:
            httpx.delete(f"{cluster.url}/sandboxes/{sid}", headers=key, timeout=60)
            server.shutdown()
