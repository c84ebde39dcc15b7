"""The control-plane API over raw HTTP: status codes, error bodies, legacy routes, extensions."""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.node.conftest import NodeProcess


@pytest.fixture(scope="module")
def api(node: NodeProcess) -> Iterator[httpx.Client]:
    with node.client() as client:
        yield client


def assert_error(answer: httpx.Response, status: int, text: str = "") -> None:
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["code"] == status
    assert isinstance(body["message"], str) and text in body["message"]


def envd(node: NodeProcess, sid: str, token: str | None = None) -> httpx.Client:
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}
    if token:
        headers["X-Access-Token"] = token
    return httpx.Client(base_url=node.url, headers=headers, timeout=30, trust_env=False)


def run(node: NodeProcess, sid: str, token: str, cmd: str) -> str:
    """Run a command through the proxy with the Connect protocol; returns stdout."""
    payload = json.dumps(
        {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}, "stdin": False}
    ).encode()
    with envd(node, sid, token) as client:
        answer = client.post(
            "/process.Process/Start",
            content=b"\x00" + len(payload).to_bytes(4, "big") + payload,
            headers={"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"},
        )
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/connect+json"
    out, data, pos = b"", answer.content, 0
    while pos < len(data):
        flags, size = data[pos], int.from_bytes(data[pos + 1 : pos + 5], "big")
        message = json.loads(data[pos + 5 : pos + 5 + size])
        pos += 5 + size
        if flags == 0 and "data" in message.get("event", {}):
            out += base64.b64decode(message["event"]["data"].get("stdout", ""))
    return out.decode()


def test_health_needs_no_key_metrics_do(node: NodeProcess) -> None:
    """/metrics (sandbox counts, operations, pools) is for the operator: the API key, as a
    header or as a Prometheus bearer token, unless the node is told its metrics are public."""
    assert httpx.get(node.url + "/health").status_code == 200
    assert_error(httpx.get(node.url + "/metrics"), 401, "X-API-KEY")
    assert_error(httpx.get(node.url + "/metrics", headers={"Authorization": "Bearer e2b_00"}),
                 401)
    for given in ({"X-API-KEY": node.api_key}, {"Authorization": f"Bearer {node.api_key}"}):
        metrics = httpx.get(node.url + "/metrics", headers=given)
        assert metrics.status_code == 200
        assert "aenv_node_sandboxes" in metrics.text


def test_api_key_is_required_and_checked(node: NodeProcess) -> None:
    assert_error(httpx.get(node.url + "/v2/sandboxes"), 401, "X-API-KEY")
    assert_error(httpx.get(node.url + "/v2/sandboxes", headers={"X-API-KEY": "e2b_00"}), 401)
    twice = httpx.get(node.url + "/v2/sandboxes", headers=[("X-API-KEY", node.api_key)] * 2)
    assert_error(twice, 401)
    key = node.api_key
    assert key.startswith("e2b_") and all(c in "0123456789abcdef" for c in key[4:])
    assert (node.state_dir / "secrets" / "api-key").stat().st_mode & 0o777 == 0o600


def test_bad_requests_get_json_errors(api: httpx.Client) -> None:
    assert_error(api.get("/no/such/route"), 404, "route not found")
    assert_error(api.put("/v2/sandboxes"), 405)
    assert_error(api.post("/v2/sandboxes", content=b"{not json"), 400, "not valid JSON")
    assert_error(api.post("/v2/sandboxes", json={"timeout": "soon"}), 422, "timeout")
    assert_error(api.post("/v2/sandboxes", json={"metadata": {"a": 1}}), 422, "metadata")
    # bounded: stored with the sandbox and listed with it (docs/security.md)
    assert_error(api.post("/v2/sandboxes", json={"metadata": {f"k{i}": "v" for i in range(300)}}),
                 422, "metadata: 300 entries")
    assert_error(api.post("/v2/sandboxes", json={"metadata": {"k": "v" * (65 << 10)}}),
                 422, "metadata")
    assert_error(api.post("/v2/sandboxes", json={"metadata": {"k" * 300: "v"}}), 422, "metadata")
    assert_error(api.post("/v2/sandboxes", json={"envVars": {"A": "v" * (600 << 10)}}),
                 422, "envVars")
    assert_error(api.post("/v2/sandboxes", json=[1, 2]), 422)
    assert_error(api.post("/v2/sandboxes", content=b"x" * (2 << 20)), 413)

    def chunks() -> Iterator[bytes]:
        for _ in range(40):
            yield b" " * 65536

    assert_error(api.post("/v2/sandboxes", content=chunks()), 413)
    assert_error(api.post("/sandboxes/whatever/timeout", json={}), 422, "timeout")
    assert_error(api.get("/v2/sandboxes", params={"limit": "0"}), 400, "limit")
    assert_error(api.get("/v2/sandboxes", params={"state": "dead"}), 400, "state")
    assert_error(api.get("/v2/sandboxes", params={"nextToken": "!!"}), 400, "token")
    assert_error(api.get("/v2/sandboxes", params={"metadata": "novalue"}), 400, "metadata")
    assert_error(api.post("/v2/sandboxes", json={"templateID": "nope"}), 404, "nope")


def test_deeply_nested_json_gets_400(api: httpx.Client) -> None:
    """`[[[[...]]]]` 100,000 deep made the stdlib parser raise RecursionError, which went past
    the body's `except JSONDecodeError` (500): it is a 400 naming the nesting, as is a next
    token that decodes to such JSON."""
    nested = b"[" * 100_000 + b"]" * 100_000
    assert_error(api.post("/v2/sandboxes", content=nested), 400, "deeper than 64 levels")
    deep = b"[" * 5000 + b"]" * 5000
    assert_error(api.post("/v2/sandboxes", content=deep), 400, "deeper than 64 levels")
    assert_error(api.post("/aenv/snapshots/push", content=deep), 400, "deeper than 64 levels")
    token = base64.urlsafe_b64encode(deep).decode()
    assert_error(api.get("/v2/sandboxes", params={"nextToken": token}), 400, "token")


def test_unknown_sandbox_everywhere(api: httpx.Client, node: NodeProcess) -> None:
    sid = "inosuchsandbox000000"
    assert_error(api.get(f"/sandboxes/{sid}"), 404, sid)
    assert_error(api.delete(f"/sandboxes/{sid}"), 404)
    assert_error(api.post(f"/sandboxes/{sid}/pause", json={}), 404)
    assert_error(api.post(f"/v2/sandboxes/{sid}/connect", json={}), 404)
    assert_error(api.post(f"/sandboxes/{sid}/fork", json={}), 404)
    with envd(node, sid) as client:
        answer = client.get("/health")
    assert answer.status_code == 502
    assert answer.json() == {"sandboxId": sid, "message": "The sandbox was not found", "code": 502}


def test_v1_create_chunked_body_and_legacy_connect_flow(
    api: httpx.Client, node: NodeProcess
) -> None:
    body = json.dumps({"templateID": "base", "timeout": 60, "secure": True}).encode()
    created = api.post("/sandboxes", content=iter([body[:10], body[10:]]))  # chunked, like TS
    assert created.status_code == 201, created.text
    sandbox = created.json()
    for field in ("templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken"):
        assert sandbox[field]
    sid = sandbox["sandboxID"]
    # 2.0-2.5 connect: timeout (204 when running) ...
    assert api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 300}).status_code == 204
    # ... and /resume on a running sandbox is a 409 the SDK reads as "already running"
    assert_error(api.post(f"/sandboxes/{sid}/resume", json={"timeout": 300}), 409)
    # 2.6-2.45 connect
    assert api.post(f"/sandboxes/{sid}/connect", json={"timeout": 300}).status_code == 200
    assert_error(api.post(f"/sandboxes/{sid}/connect", json={}), 422, "timeout")
    assert api.post(f"/sandboxes/{sid}/refreshes", json={"duration": 30}).status_code == 204
    legacy = api.get("/sandboxes").json()
    assert sid in {s["sandboxID"] for s in legacy}
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert_error(api.get(f"/sandboxes/{sid}"), 404)


def test_envd_token_is_required_through_the_proxy(api: httpx.Client, node: NodeProcess) -> None:
    sandbox = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}).json()
    sid, token = sandbox["sandboxID"], sandbox["envdAccessToken"]
    try:
        assert run(node, sid, token, "echo via-proxy") == "via-proxy\n"
        with envd(node, sid, "wrong") as client:
            denied = client.post(
                "/filesystem.Filesystem/Stat",
                json={"path": "/"},
                headers={"Connect-Protocol-Version": "1"},
            )
        assert denied.status_code == 401
        with envd(node, sid) as client:
            assert client.post("/init", json={"accessToken": "mine"}).status_code == 403
            assert client.get("/health").status_code == 204
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_host_routing_and_gzip_upload(api: httpx.Client, node: NodeProcess) -> None:
    sandbox = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}).json()
    sid, token = sandbox["sandboxID"], sandbox["envdAccessToken"]
    try:
        with httpx.Client(base_url=node.url, timeout=30, trust_env=False) as client:
            host = {"Host": f"49983-{sid}.sandbox.test", "X-Access-Token": token}
            answer = client.post(
                "/files",
                params={"path": "/home/user/z.txt"},
                content=gzip.compress(b"compressed body"),
                headers={
                    **host,
                    "Content-Type": "application/octet-stream",
                    "Content-Encoding": "gzip",
                },
            )
            assert answer.status_code == 200, answer.text
            read = client.get("/files", params={"path": "/home/user/z.txt"}, headers=host)
            assert read.content == b"compressed body"
            closed = client.get("/", headers={"Host": f"1-{sid}.sandbox.test"})
            assert closed.status_code == 502
            assert "port is not open" in closed.json()["message"]
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_traffic_token_guards_other_ports(api: httpx.Client, node: NodeProcess) -> None:
    private = api.post(
        "/v2/sandboxes", json={"timeout": 60, "network": {"allowPublicTraffic": False}}
    ).json()
    sid, traffic = private["sandboxID"], private["trafficAccessToken"]
    assert traffic
    try:
        with httpx.Client(base_url=node.url, timeout=30, trust_env=False) as client:
            route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "1"}
            assert_error(client.get("/", headers=route), 403, "traffic")
            allowed = client.get("/", headers={**route, "e2b-traffic-access-token": traffic})
            assert allowed.status_code == 502  # let through; nothing listens on port 1
            # envd's own port is guarded by the envd token, not the traffic token
            assert client.get("/health", headers={"E2b-Sandbox-Id": sid}).status_code == 204
        # The process backend cannot enforce egress rules: it refuses them (tests/node/
        # test_network_policy.py has the VM backend's); an update that sets none is fine.
        rules = {"allowOut": ["10.0.0.0/8"], "denyOut": ["0.0.0.0/0"]}
        assert_error(api.put(f"/sandboxes/{sid}/network", json=rules), 400, "not enforced")
        assert api.put(f"/sandboxes/{sid}/network", json={}).status_code == 204
        assert api.get(f"/sandboxes/{sid}").json()["network"] == {"allowPublicTraffic": False}
        assert_error(api.put(f"/sandboxes/{sid}/network", json={"allowOut": "x"}), 422)
        assert_error(api.put(f"/sandboxes/{sid}/network", json={"denyOut": ["10.0.0.0/33"]}),
                     400, "10.0.0.0/33")
        bad = api.post("/v2/sandboxes", json={"network": {"denyOut": ["http://x.test/"]}})
        assert_error(bad, 400, "http://x.test/")
        # Header rules that would cover HTTPS need decrypting: refused, naming the key, on
        # create and update (before any backend check), not accepted and the TLS reset.
        https_rule = {"allowOut": ["api.test"],
                      "rules": {"api.test": [{"transform": {"headers": {"X-Key": "k"}}}]}}
        for answer in (api.post("/v2/sandboxes", json={"network": https_rule}),
                       api.put(f"/sandboxes/{sid}/network", json=https_rule)):
            assert_error(answer, 400, "rules['api.test']: header transforms apply to plain HTTP")
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_templates_snapshots_and_nodes(api: httpx.Client, node: NodeProcess) -> None:
    templates = api.get("/templates").json()
    base = next(t for t in templates if "base" in t["aliases"])
    for field in (
        "templateID",
        "buildID",
        "cpuCount",
        "memoryMB",
        "diskSizeMB",
        "public",
        "aliases",
        "names",
        "createdAt",
        "updatedAt",
        "createdBy",
        "lastSpawnedAt",
        "spawnCount",
        "buildCount",
        "envdVersion",
        "buildStatus",
    ):
        assert field in base
    assert api.get("/templates/base").json()["builds"][0]["status"] == "ready"
    assert api.get("/templates/aliases/base").json()["templateID"] == base["templateID"]
    assert_error(api.get("/templates/aliases/nothing"), 404)
    assert api.get("/v2/templates", params={"limit": 1}).status_code == 200

    sandbox = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}).json()
    sid, token = sandbox["sandboxID"], sandbox["envdAccessToken"]
    try:
        run(node, sid, token, "echo snap-data > /home/user/s.txt")
        snap = api.post(f"/sandboxes/{sid}/snapshots", json={"name": "my-snap"})
        assert snap.status_code == 201, snap.text
        snap_id = snap.json()["snapshotID"]
        assert snap.json()["names"] == ["my-snap"]
        assert_error(api.post(f"/sandboxes/{sid}/snapshots", json={"name": "my-snap"}), 409)
        listed = api.get("/snapshots", params={"sandboxID": sid}).json()
        assert [s["snapshotID"] for s in listed] == [snap_id]
        assert api.get(f"/snapshots/{snap_id}").json()["names"] == ["my-snap"]
        # a snapshot id (or its name) works as a templateID
        assert api.get("/templates/aliases/my-snap").json()["templateID"] == snap_id
        child = api.post("/v2/sandboxes", json={"templateID": snap_id, "timeout": 60}).json()
        try:
            assert (
                run(node, child["sandboxID"], child["envdAccessToken"], "cat /home/user/s.txt")
                == "snap-data\n"
            )
        finally:
            api.delete(f"/sandboxes/{child['sandboxID']}")
        assert api.delete(f"/templates/{snap_id}").status_code == 204
        assert_error(api.delete(f"/templates/{snap_id}"), 404)
        assert_error(api.post("/v2/sandboxes", json={"templateID": snap_id}), 404)
    finally:
        api.delete(f"/sandboxes/{sid}")

    nodes = api.get("/nodes").json()
    assert len(nodes) == 1 and nodes[0]["status"] == "ready"
    assert api.get(f"/nodes/{nodes[0]['id']}").json()["cachedBuilds"] == []


def test_fork_copies_files_one_result_per_child(api: httpx.Client, node: NodeProcess) -> None:
    sandbox = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}).json()
    sid, token = sandbox["sandboxID"], sandbox["envdAccessToken"]
    children: list[dict[str, str]] = []
    try:
        run(node, sid, token, "echo parent > /home/user/p.txt")
        assert_error(api.post(f"/sandboxes/{sid}/fork", json={"count": 101}), 400, "count")
        assert_error(api.post(f"/sandboxes/{sid}/fork", json={"count": 0}), 400, "count")
        forked = api.post(f"/sandboxes/{sid}/fork", json={"count": 3, "timeout": 60})
        assert forked.status_code == 201, forked.text
        results = forked.json()
        assert len(results) == 3
        children += [r["sandbox"] for r in results]
        assert len({c["sandboxID"] for c in children} | {sid}) == 4
        for child in children:
            assert child["envdAccessToken"] != token
            assert (
                run(
                    node,
                    child["sandboxID"],
                    child["envdAccessToken"],
                    "cat /home/user/p.txt; echo child > /home/user/p.txt",
                )
                == "parent\n"
            )
        assert run(node, sid, token, "cat /home/user/p.txt") == "parent\n"
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    finally:
        for child in children:
            api.delete(f"/sandboxes/{child['sandboxID']}")
        api.delete(f"/sandboxes/{sid}")


def test_metrics_fields(api: httpx.Client) -> None:
    sandbox = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}).json()
    sid = sandbox["sandboxID"]
    try:
        samples = api.get(f"/sandboxes/{sid}/metrics").json()
        assert len(samples) == 1
        for field in (
            "timestamp",
            "timestampUnix",
            "cpuCount",
            "cpuUsedPct",
            "memUsed",
            "memTotal",
            "memCache",
            "diskUsed",
            "diskTotal",
        ):
            assert field in samples[0]
        assert samples[0]["memUsed"] > 0 and samples[0]["diskUsed"] > 0
        assert_error(api.get(f"/sandboxes/{sid}/metrics", params={"start": "x"}), 400)
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_idempotency_key_returns_the_first_sandbox(api: httpx.Client) -> None:
    headers = {"Idempotency-Key": "retry-abc-123"}
    first = api.post("/v2/sandboxes", json={"timeout": 60}, headers=headers)
    again = api.post("/v2/sandboxes", json={"timeout": 60}, headers=headers)
    try:
        assert first.status_code == again.status_code == 201
        assert first.json()["sandboxID"] == again.json()["sandboxID"]
    finally:
        api.delete(f"/sandboxes/{first.json()['sandboxID']}")


def test_websocket_is_bridged_to_the_sandbox_port(api: httpx.Client, node: NodeProcess) -> None:
    """The process backend maps sandbox ports to host ports, so a host echo server stands in
    for a WebSocket server inside the sandbox."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from tests.node.conftest import free_host_port, ws_echo_server

    port = free_host_port()  # opened to the node's process sandboxes (tests/node/conftest.py)
    stop = ws_echo_server(port)
    sid = api.post("/v2/sandboxes", json={"timeout": 60}).json()["sandboxID"]
    try:
        route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)}
        ws_url = node.url.replace("http", "ws", 1) + "/echo"
        with connect(ws_url, additional_headers=route) as ws:
            ws.send("hello")
            assert ws.recv() == "hello"
            ws.send(b"\x00\x01" * 50000)
            assert ws.recv() == b"\x00\x01" * 50000
        with (
            pytest.raises(InvalidStatus),
            connect(ws_url, additional_headers={"E2b-Sandbox-Id": "inosuchsandbox000000"}),
        ):
            pass
    finally:
        api.delete(f"/sandboxes/{sid}")
        stop()
