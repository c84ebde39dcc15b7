"""The gateway over a local cluster of 3 process-backend nodes, driven by the official e2b SDK
configured only by environment (E2B_API_URL = E2B_SANDBOX_URL = the gateway): create with
metadata, commands, files, pause and connect, fork, snapshot, list paging over all nodes, kill;
spreading; teams; the cluster secret; and, last (they change the cluster), the faults: kill -9
of the scheduler and of a node."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from e2b import Sandbox, SandboxNotFoundException, SandboxQuery, SandboxState

from agentenv.api.auth import metrics_token
from tests.control.cluster import ROOMY_NODES, GatewayProcess, LocalCluster, running
from tests.control.helpers import SECRET, wait_for
from tests.node.conftest import environ_set, free_host_port

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Placement pinned to round-robin: consecutive creates go to different nodes whatever the
    # heartbeats said last (least-loaded decides by the nodes' reported room, which lags the
    # creates by a heartbeat and, with the nodes on one host, moves with its MemAvailable).
    # Placement by load is tests/control/test_placement.py's and test_cluster_admission.py's.
    made = LocalCluster(tmp_path_factory.mktemp("cluster"), nodes=3, strategy="round-robin",
                        node_env=ROOMY_NODES)
    with running(made, "alpha", "beta") as started:
        yield started


@pytest.fixture(scope="module")
def sdk(cluster: LocalCluster) -> Iterator[LocalCluster]:
    with environ_set({"E2B_API_URL": cluster.url, "E2B_SANDBOX_URL": cluster.url,
                      "E2B_API_KEY": cluster.keys["alpha"]}):
        yield cluster


def holder(cluster: LocalCluster, sandbox_id: str, team: str = "alpha") -> str:
    """The node that has the sandbox of `team`, asked of every node directly (as the gateway
    would: the cluster secret and the team)."""
    found = []
    for i, node in enumerate(cluster.nodes):
        if node.proc is None:
            continue
        answer = httpx.get(f"{node.url}/sandboxes/{sandbox_id}", timeout=10,
                           headers=cluster.node_headers(node, team))
        if answer.status_code == 200:
            found.append(f"node{i}")
    assert len(found) == 1, (sandbox_id, found)
    return found[0]


def test_sdk_create_commands_files_pause_connect_kill(sdk: LocalCluster) -> None:
    sbx = Sandbox.create(template="base", timeout=120, metadata={"suite": "gateway"},
                         envs={"FOO": "bar"})
    try:
        info = sbx.get_info()
        assert info.metadata == {"suite": "gateway"}
        assert info.state == SandboxState.RUNNING
        assert sbx.commands.run("echo $FOO").stdout == "bar\n"
        streamed: list[str] = []
        sbx.commands.run("for i in 1 2 3; do echo l$i; sleep 0.05; done",
                         on_stdout=streamed.append)
        assert "".join(streamed) == "l1\nl2\nl3\n"
        payload = bytes(range(256)) * 4096  # 1 MiB through the gateway both ways
        sbx.files.write("/tmp/blob", payload)
        assert sbx.files.read("/tmp/blob", format="bytes") == payload
        sbx.files.write("/tmp/note.txt", "kept across pause")
        sbx.pause()
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        again = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert again.files.read("/tmp/note.txt") == "kept across pause"
    finally:
        sbx.kill()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sbx.sandbox_id)


def test_fork_of_four_stays_on_the_source_node(sdk: LocalCluster) -> None:
    source = Sandbox.create(template="base", timeout=120)
    try:
        source.files.write("/tmp/mark", "from the source")
        answer = httpx.post(f"{sdk.url}/sandboxes/{source.sandbox_id}/fork",
                            json={"count": 4, "timeout": 120},
                            headers={"X-API-KEY": sdk.keys["alpha"]}, timeout=120)
        assert answer.status_code == 201, answer.text
        children = [r["sandbox"]["sandboxID"] for r in answer.json()]
        assert len(children) == 4
        home = holder(sdk, source.sandbox_id)
        for child_id in children:
            assert holder(sdk, child_id) == home
            child = Sandbox.connect(child_id)
            assert child.files.read("/tmp/mark") == "from the source"
            child.kill()
    finally:
        source.kill()


def test_batch_from_a_snapshot_and_lineage_through_the_gateway(sdk: LocalCluster) -> None:
    """POST /snapshots/{id}/fork goes to the node holding the snapshot; every child is the
    team's (another team's snapshot is not found); lineage and rollback are forwarded."""
    key = {"X-API-KEY": sdk.keys["alpha"]}
    source = Sandbox.create(template="base", timeout=120)
    made: list[str] = []
    try:
        source.files.write("/tmp/seed", "seed")
        snap = httpx.post(f"{sdk.url}/sandboxes/{source.sandbox_id}/snapshots", json={},
                          headers=key, timeout=120).json()["snapshotID"]
        answer = httpx.post(f"{sdk.url}/snapshots/{snap}/fork", json={"count": 3, "timeout": 120},
                            headers=key, timeout=120)
        assert answer.status_code == 201, answer.text
        made = [r["sandbox"]["sandboxID"] for r in answer.json()]
        assert len(made) == 3
        home = holder(sdk, source.sandbox_id)
        for child_id in made:
            assert holder(sdk, child_id) == home
            info = httpx.get(f"{sdk.url}/sandboxes/{child_id}", headers=key, timeout=30).json()
            assert info["sourceSnapshotID"] == snap
            assert info["parentSandboxID"] == source.sandbox_id
            assert Sandbox.connect(child_id).files.read("/tmp/seed") == "seed"
        listed = httpx.get(f"{sdk.url}/snapshots/{snap}/children", headers=key, timeout=30)
        assert {s["sandboxID"] for s in listed.json()} == set(made)
        children = httpx.get(f"{sdk.url}/sandboxes/{source.sandbox_id}/children", headers=key,
                             timeout=30)
        assert {s["sandboxID"] for s in children.json()} == set(made)
        beta = {"X-API-KEY": sdk.keys["beta"]}
        assert httpx.post(f"{sdk.url}/snapshots/{snap}/fork", json={"count": 1}, headers=beta,
                          timeout=30).status_code == 404
        rollback = httpx.post(f"{sdk.url}/sandboxes/{source.sandbox_id}/rollback", json={},
                              headers=key, timeout=30)
        assert rollback.status_code == 400  # reached the node: a process node cannot
        batch = httpx.post(f"{sdk.url}/v2/sandboxes", headers=key, timeout=120,
                           json={"templateID": "base", "timeout": 60, "count": 2})
        assert batch.status_code == 201, batch.text
        made += [r["sandbox"]["sandboxID"] for r in batch.json()]
        assert len(made) == 5
    finally:
        for child_id in made:
            with contextlib.suppress(Exception):
                Sandbox.kill(child_id)
        source.kill()


def test_snapshot_then_create_from_it(sdk: LocalCluster) -> None:
    source = Sandbox.create(template="base", timeout=120)
    try:
        source.files.write("/tmp/state", "snapshotted")
        key = {"X-API-KEY": sdk.keys["alpha"]}
        snap = httpx.post(f"{sdk.url}/sandboxes/{source.sandbox_id}/snapshots", json={},
                          headers=key, timeout=120)
        assert snap.status_code == 201, snap.text
        snapshot_id = snap.json()["snapshotID"]
        listed = httpx.get(f"{sdk.url}/snapshots", headers=key, timeout=30).json()
        assert snapshot_id in [s["snapshotID"] for s in listed]
        restored = Sandbox.create(template=snapshot_id, timeout=120)
        try:
            assert restored.files.read("/tmp/state") == "snapshotted"
            assert holder(sdk, restored.sandbox_id) == holder(sdk, source.sandbox_id)
        finally:
            restored.kill()
        other = httpx.get(f"{sdk.url}/snapshots/{snapshot_id}", timeout=30,
                          headers={"X-API-KEY": sdk.keys["beta"]})
        assert other.status_code == 404
    finally:
        source.kill()


def test_creates_spread_and_list_pages_over_all_nodes(sdk: LocalCluster) -> None:
    made = [Sandbox.create(template="base", timeout=120, metadata={"batch": "paging"})
            for _ in range(6)]
    try:
        homes = [holder(sdk, s.sandbox_id) for s in made]
        # round-robin over 3 nodes: every node gets two of them
        assert set(homes) == {"node0", "node1", "node2"}, homes
        paginator = Sandbox.list(query=SandboxQuery(metadata={"batch": "paging"}), limit=2)
        seen: list[str] = []
        pages = 0
        while paginator.has_next:
            page = paginator.next_items()
            assert len(page) <= 2
            seen += [s.sandbox_id for s in page]
            pages += 1
        assert sorted(seen) == sorted(s.sandbox_id for s in made)
        assert pages >= 3
    finally:
        for sandbox in made:
            sandbox.kill()


def test_user_port_by_host_and_websocket(cluster: LocalCluster) -> None:
    """A sandbox port through the gateway, by `{port}-{id}.{domain}` Host and as a WebSocket
    (a process-backend sandbox's ports are this host's: the server runs here)."""
    from websockets.sync.client import connect
    from websockets.sync.server import serve

    def echo(ws: Any) -> None:
        for message in ws:
            ws.send(b"echo:" + (message if isinstance(message, bytes) else message.encode()))

    def http(connection: Any, request: Any) -> Any:
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return connection.respond(200, f"port says {request.path}\n")
        return None

    port = free_host_port()  # opened to process sandboxes (tests/node/conftest.py)
    key = {"X-API-KEY": cluster.keys["alpha"]}
    with serve(echo, "127.0.0.1", port, process_request=http) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        created = httpx.post(f"{cluster.url}/v2/sandboxes", headers=key, timeout=60,
                             json={"templateID": "base", "timeout": 120})
        assert created.status_code == 201, created.text
        sid = created.json()["sandboxID"]
        try:
            by_host = httpx.get(f"{cluster.url}/hello?x=1", timeout=30,
                                headers={"Host": f"{port}-{sid}.gw.test"})
            assert by_host.status_code == 200 and by_host.text == "port says /hello?x=1\n"
            ws_url = cluster.url.replace("http://", "ws://") + "/ws"
            with connect(ws_url, additional_headers={"E2b-Sandbox-Id": sid,
                                                     "E2b-Sandbox-Port": str(port)}) as ws:
                for i in range(3):
                    ws.send(f"m{i}")
                    assert ws.recv(timeout=30) == f"echo:m{i}".encode()
        finally:
            httpx.delete(f"{cluster.url}/sandboxes/{sid}", headers=key, timeout=60)
            server.shutdown()


def test_teams_see_and_control_only_their_own(cluster: LocalCluster) -> None:
    alpha = {"X-API-KEY": cluster.keys["alpha"]}
    beta = {"X-API-KEY": cluster.keys["beta"]}
    with httpx.Client(base_url=cluster.url, timeout=60) as api:
        created = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120},
                           headers=alpha)
        assert created.status_code == 201, created.text
        sid = created.json()["sandboxID"]
        try:
            assert sid not in [s["sandboxID"] for s in api.get("/v2/sandboxes",
                                                              headers=beta).json()]
            assert sid in [s["sandboxID"] for s in api.get("/v2/sandboxes",
                                                          headers=alpha).json()]
            for method, path in [("GET", ""), ("POST", "/pause"), ("POST", "/connect"),
                                 ("POST", "/timeout"), ("DELETE", ""), ("POST", "/fork")]:
                body = {"timeout": 60} if method == "POST" else None
                answer = api.request(method, f"/sandboxes/{sid}{path}", json=body, headers=beta)
                assert answer.status_code == 404, (method, path, answer.text)
            assert api.get(f"/sandboxes/{sid}", headers=alpha).json()["state"] == "running"
            assert api.get("/v2/sandboxes", headers={"X-API-KEY": "e2b_" + "0" * 40}
                           ).status_code == 401
        finally:
            assert api.delete(f"/sandboxes/{sid}", headers=alpha).status_code == 204


def test_nodes_serve_only_the_gateway(cluster: LocalCluster) -> None:
    node = cluster.nodes[0]
    assert httpx.get(node.url + "/health", timeout=10).status_code == 200
    for headers in ({"X-API-KEY": node.api_key}, {"x-agentenv-node-key": "x" * 40}):
        answer = httpx.get(node.url + "/v2/sandboxes", headers=headers, timeout=10)
        assert answer.status_code == 403, answer.text
        proxied = httpx.get(node.url + "/health", timeout=10,
                            headers={**headers, "E2b-Sandbox-Id": "whatever"})
        assert proxied.status_code == 403


def test_a_nodes_key_opens_that_node_only(cluster: LocalCluster) -> None:
    """Each node holds only its own key (not the cluster secret): what node0 holds, sent to
    node1 as the gateway would send it, is refused, and so is the cluster secret itself (the
    gateway derives each node's key; no node has a credential that passes at another)."""
    node0, node1 = cluster.nodes[0], cluster.nodes[1]
    own = cluster.node_headers(node1, "alpha")
    assert httpx.get(node1.url + "/v2/sandboxes", headers=own, timeout=10).status_code == 200
    for posing in ({**cluster.node_headers(node0, "alpha")},
                   {**own, "x-agentenv-node-key": cluster.secret}):
        answer = httpx.get(node1.url + "/v2/sandboxes", headers=posing, timeout=10)
        assert answer.status_code == 403, answer.text
        proxied = httpx.get(node1.url + "/health", timeout=10,
                            headers={**posing, "E2b-Sandbox-Id": "whatever"})
        assert proxied.status_code == 403
    # node0 knows its own key only: it is not in its arguments or environment, just a file
    assert "--cluster-secret-file" not in node0.extra_args
    assert cluster.secret not in " ".join(node0.extra_args)


def test_two_gateways_serve_one_cluster(cluster: LocalCluster) -> None:
    """Whatever one gateway did, the other serves: the sandbox it made, its listing, its kill,
    an Idempotency-Key it claimed and a signed URL made against it (gateways keep nothing of
    their own; a load balancer may send each request to either)."""
    second = GatewayProcess(cluster.scheduler.address, cluster.redis.url, cluster.secret_file,
                            cluster.root / "gateway2.log", env=cluster.redis.env("gateway"))
    second.start()
    try:
        key = cluster.keys["alpha"]
        sbx = Sandbox.create(template="base", timeout=120, api_key=key, api_url=cluster.url,
                             sandbox_url=cluster.url)
        try:
            other = Sandbox.connect(sbx.sandbox_id, api_key=key, api_url=second.url,
                                    sandbox_url=second.url)
            assert other.commands.run("echo via-second").stdout == "via-second\n"
            sbx.files.write("/tmp/two.txt", "either gateway")
            signed = sbx.download_url("/tmp/two.txt").replace(cluster.url, second.url)
            assert httpx.get(signed, timeout=30).text == "either gateway"
            body = {"templateID": "base", "timeout": 60}
            retried = [httpx.post(f"{url}/v2/sandboxes", json=body, timeout=60,
                                  headers={"X-API-KEY": key, "Idempotency-Key": "two-gw"})
                       for url in (cluster.url, second.url)]
            assert retried[0].status_code == retried[1].status_code == 201
            assert retried[0].json()["sandboxID"] == retried[1].json()["sandboxID"]
            assert httpx.delete(f"{second.url}/sandboxes/{retried[0].json()['sandboxID']}",
                                headers={"X-API-KEY": key}, timeout=60).status_code == 204
            listed = httpx.get(f"{second.url}/v2/sandboxes", headers={"X-API-KEY": key},
                               timeout=30).json()
            assert sbx.sandbox_id in [s["sandboxID"] for s in listed]
        finally:
            assert httpx.delete(f"{second.url}/sandboxes/{sbx.sandbox_id}", timeout=60,
                                headers={"X-API-KEY": key}).status_code == 204
    finally:
        second.stop()


def test_signed_file_urls_through_the_gateway(sdk: LocalCluster) -> None:
    """download_url/upload_url on the gateway's E2B_SANDBOX_URL name no sandbox: the gateway
    has the nodes find the one whose token made the signature; each URL reaches its own
    sandbox's file, and a bad or expired signature is a 401."""
    made = [Sandbox.create(template="base", timeout=120) for _ in range(2)]
    try:
        assert holder(sdk, made[0].sandbox_id) != holder(sdk, made[1].sandbox_id)
        for sbx in made:
            sbx.files.write("/tmp/signed.txt", f"content of {sbx.sandbox_id}")
        with httpx.Client(timeout=30, trust_env=False) as client:
            for sbx in made:
                for expiration in (None, 60):
                    url = sbx.download_url("/tmp/signed.txt",
                                           use_signature_expiration=expiration)
                    assert url.startswith(sdk.url + "/files?path=")
                    assert "signature=v1_" in url and sbx.sandbox_id not in url
                    got = client.get(url)
                    assert got.status_code == 200, got.text
                    assert got.text == f"content of {sbx.sandbox_id}"
                    upload = sbx.upload_url("/tmp/up.txt", use_signature_expiration=expiration)
                    sent = client.post(upload, files={"file": ("x", f"up {expiration}".encode())})
                    assert sent.status_code == 200, sent.text
                    assert sbx.files.read("/tmp/up.txt") == f"up {expiration}"
            sbx = made[0]
            expired = client.get(sbx.download_url("/tmp/signed.txt", use_signature_expiration=-10))
            assert expired.status_code == 401
            assert expired.json()["message"] == "signature is already expired"
            url = sbx.download_url("/tmp/signed.txt")
            forged = client.get(url.replace("signature=v1_", "signature=v1_A"))
            assert forged.status_code == 401 and forged.json()["message"] == "invalid signature"
            # a read signature opens no write, and a signature covers its path only
            assert client.post(url, files={"file": ("x", b"no")}).status_code == 401
            elsewhere = url.replace("path=%2Ftmp%2Fsigned.txt", "path=%2Fetc%2Fpasswd")
            assert elsewhere != url and client.get(elsewhere).status_code == 401
            assert sbx.files.read("/tmp/signed.txt") == f"content of {sbx.sandbox_id}"
    finally:
        for sbx in made:
            sbx.kill()


def test_idempotent_creates_make_one_sandbox(cluster: LocalCluster) -> None:
    """A create retried with the same Idempotency-Key gets the first one's sandbox though
    placement would put the retry on another node (round-robin: the next create goes to the
    next node, whatever the heartbeats said); concurrent duplicates make one sandbox; another
    team's same key is another create."""
    alpha = {"X-API-KEY": cluster.keys["alpha"]}
    body = {"templateID": "base", "timeout": 120, "metadata": {"batch": "idem"}}
    made: set[str] = set()
    with httpx.Client(base_url=cluster.url, timeout=120) as api:
        try:
            first = api.post("/v2/sandboxes", json=body, headers={**alpha,
                                                                   "Idempotency-Key": "k1"})
            assert first.status_code == 201, first.text
            sid = first.json()["sandboxID"]
            made.add(sid)
            again = api.post("/v2/sandboxes", json=body, headers={**alpha,
                                                                   "Idempotency-Key": "k1"})
            assert again.status_code == 201 and again.json() == first.json()
            other = api.post("/v2/sandboxes", json=body,
                             headers={**alpha, "Idempotency-Key": "k2"})
            assert other.status_code == 201
            made.add(other.json()["sandboxID"])
            assert other.json()["sandboxID"] != sid
            assert holder(cluster, other.json()["sandboxID"]) != holder(cluster, sid)

            answers: list[httpx.Response] = []

            def create() -> None:
                with httpx.Client(base_url=cluster.url, timeout=120) as own:
                    answers.append(own.post("/v2/sandboxes", json=body,
                                            headers={**alpha, "Idempotency-Key": "k3"}))

            threads = [threading.Thread(target=create) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert [a.status_code for a in answers] == [201] * 4, [a.text for a in answers]
            ids = {a.json()["sandboxID"] for a in answers}
            made |= ids
            assert len(ids) == 1
            listed = api.get("/v2/sandboxes", params={"metadata": "batch=idem"},
                             headers=alpha).json()
            assert sorted(s["sandboxID"] for s in listed) == sorted(made)

            beta = api.post("/v2/sandboxes", json=body, headers={
                "X-API-KEY": cluster.keys["beta"], "Idempotency-Key": "k1"})
            assert beta.status_code == 201 and beta.json()["sandboxID"] != sid
            assert api.delete(f"/sandboxes/{beta.json()['sandboxID']}", headers={
                "X-API-KEY": cluster.keys["beta"]}).status_code == 204
            bad = api.post("/v2/sandboxes", json=body,
                           headers={**alpha, "Idempotency-Key": "x" * 256})
            assert bad.status_code == 400 and "Idempotency-Key" in bad.json()["message"]
        finally:
            for sandbox_id in made:
                api.delete(f"/sandboxes/{sandbox_id}", headers=alpha)


def gateway_metrics(url: str) -> dict[str, float]:
    """The gateway's Prometheus counters, by name and labels as written (read as a scraper:
    the cluster's metrics token)."""
    text = httpx.get(url + "/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {metrics_token(SECRET)}"}).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


OWNER_QUERIES = "aenv_gateway_signature_owner_queries_total"
FROM_CACHE = 'aenv_gateway_signed_file_requests_total{owner="cache"}'


def test_signed_url_owner_cached_until_its_sandbox_goes(sdk: LocalCluster) -> None:
    """The second download of a signed URL asks no node who made it (the gateway remembers);
    once the sandbox is killed (through the gateway, or on its node behind the gateway's
    back) the URL is a 401 again, never served from the stale entry."""
    made = [Sandbox.create(template="base", timeout=120) for _ in range(2)]
    try:
        with httpx.Client(timeout=30, trust_env=False) as client:
            urls = []
            for sbx in made:
                sbx.files.write("/tmp/cached.txt", f"cached {sbx.sandbox_id}")
                urls.append(sbx.download_url("/tmp/cached.txt", use_signature_expiration=300))
            urls.append(made[0].download_url("/tmp/cached.txt"))  # no expiration: 60 s
            for url, sbx in zip(urls, [*made, made[0]], strict=True):
                before = gateway_metrics(sdk.url)
                assert client.get(url).text == f"cached {sbx.sandbox_id}"
                first = gateway_metrics(sdk.url)
                assert first[OWNER_QUERIES] - before[OWNER_QUERIES] == len(sdk.nodes)
                for _ in range(3):
                    assert client.get(url).text == f"cached {sbx.sandbox_id}"
                again = gateway_metrics(sdk.url)
                assert again[OWNER_QUERIES] == first[OWNER_QUERIES]
                assert again[FROM_CACHE] - first.get(FROM_CACHE, 0) == 3
            # killed through the gateway: its binding is gone, the entry with it
            made[0].kill()
            gone = client.get(urls[0])
            assert gone.status_code == 401 and gone.json()["message"] == "invalid signature"
            # killed on its node, the gateway not told: the node's 502 for the remembered
            # sandbox is not passed on, the nodes are asked again
            node = sdk.node_of(holder(sdk, made[1].sandbox_id))
            assert httpx.delete(f"{node.url}/sandboxes/{made[1].sandbox_id}", timeout=60,
                                headers=sdk.node_headers(node, "alpha")).status_code == 204
            before = gateway_metrics(sdk.url)
            gone = client.get(urls[1])
            assert gone.status_code == 401 and gone.json()["message"] == "invalid signature"
            after = gateway_metrics(sdk.url)
            assert after[OWNER_QUERIES] > before[OWNER_QUERIES]
            print("stale entry of a sandbox killed on its node:", "relayed, node's answer held"
                  if after[FROM_CACHE] > before[FROM_CACHE] else "binding gone already")
    finally:
        for sbx in made:
            with contextlib.suppress(SandboxNotFoundException):
                sbx.kill()


LEASE = 3.0


def signal_nodes(cluster: LocalCluster, sig: signal.Signals) -> None:
    for node in cluster.nodes:
        if node.proc is not None:
            os.kill(node.proc.pid, sig)


def test_create_lease_lapses_with_a_dead_gateway_not_a_live_one(cluster: LocalCluster) -> None:
    """An Idempotency-Key's claim is a lease its gateway renews: a create held up longer than
    the lease (its nodes stopped) keeps its key, and a retry through another gateway waits and
    gets the same sandbox; a gateway killed -9 mid-create holds the key only until the lease
    lapses, then a retry through the other gateway takes over, on the same node, whose memory
    of the key gives at most one sandbox."""
    env = {"AENV_GATEWAY_CREATE_LEASE": str(LEASE), **cluster.redis.env("gateway")}
    live, doomed = (GatewayProcess(cluster.scheduler.address, cluster.redis.url,
                                   cluster.secret_file, cluster.root / f"gateway-{n}.log",
                                   env=env) for n in ("live", "doomed"))
    alpha = {"X-API-KEY": cluster.keys["alpha"]}
    body = {"templateID": "base", "timeout": 120, "metadata": {"batch": "lease"}}
    db = redis.Redis.from_url(cluster.redis.url, decode_responses=True,
                              **cluster.redis.auth("gateway").connect_kwargs())
    answers: dict[str, httpx.Response | Exception] = {}

    def create(name: str, url: str, key: str) -> threading.Thread:
        def run() -> None:
            try:
                answers[name] = httpx.post(f"{url}/v2/sandboxes", json=body, timeout=120,
                                           headers={**alpha, "Idempotency-Key": key})
            except httpx.HTTPError as exc:
                answers[name] = exc
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def held(key: str, kind: str = "idem") -> str | None:
        digest = hashlib.sha256(key.encode()).hexdigest()
        found: str | None = db.get(f"aenv:{kind}:alpha:{digest}")
        return found

    made: set[str] = set()
    live.start()
    doomed.start()
    try:
        # a live gateway's create, held up for more than twice its lease, keeps its key
        signal_nodes(cluster, signal.SIGSTOP)
        started = time.monotonic()
        first = create("first", live.url, "slow")
        mark = wait_for("the slow create's claim", lambda: held("slow"), 10, interval=0.02)
        assert mark.startswith("pending:")
        retry = create("retry", doomed.url, "slow")
        time.sleep(2.5 * LEASE)
        assert held("slow") == mark and "retry" not in answers
        signal_nodes(cluster, signal.SIGCONT)
        first.join()
        retry.join()
        took = time.monotonic() - started
        got = [answers["first"], answers["retry"]]
        assert all(isinstance(a, httpx.Response) and a.status_code == 201 for a in got), got
        slow_id = got[0].json()["sandboxID"]  # type: ignore[union-attr]
        made.add(slow_id)
        assert got[1].json()["sandboxID"] == slow_id  # type: ignore[union-attr]
        assert took > 2.5 * LEASE
        cluster.wait_nodes_up(len(cluster.nodes))

        # a gateway stalled (SIGSTOP) past its lease: a retry takes over, and the stalled one,
        # woken, does not overwrite the key: both answers name one sandbox
        signal_nodes(cluster, signal.SIGSTOP)
        stalled = create("stalled", doomed.url, "stall")
        wait_for("the stalled create's node", lambda: held("stall", "idem-node"), 10,
                 interval=0.02)
        time.sleep(0.3)
        assert doomed.proc is not None
        doomed.proc.send_signal(signal.SIGSTOP)
        signal_nodes(cluster, signal.SIGCONT)
        cluster.wait_nodes_up(len(cluster.nodes))
        took_over = httpx.post(f"{live.url}/v2/sandboxes", json=body, timeout=120,
                               headers={**alpha, "Idempotency-Key": "stall"})
        doomed.proc.send_signal(signal.SIGCONT)
        stalled.join()
        assert took_over.status_code == 201, took_over.text
        made.add(took_over.json()["sandboxID"])
        woken = answers["stalled"]
        assert isinstance(woken, httpx.Response) and woken.status_code == 201, woken
        assert woken.json()["sandboxID"] == took_over.json()["sandboxID"]
        assert json.loads(held("stall") or "{}")["sandboxID"] == took_over.json()["sandboxID"]
        assert "lost its Idempotency-Key lease" in doomed.log.read_text()

        # a gateway killed -9 in the middle of a create: the retry waits for the lease only
        signal_nodes(cluster, signal.SIGSTOP)
        dead = create("dead", doomed.url, "orphan")
        node_id = wait_for("the orphan's node", lambda: held("orphan", "idem-node"), 10,
                           interval=0.02)  # sent to that node
        time.sleep(0.3)
        assert doomed.proc is not None
        doomed.proc.kill()
        doomed.proc.wait()
        killed = time.monotonic()
        signal_nodes(cluster, signal.SIGCONT)
        dead.join()
        assert isinstance(answers["dead"], Exception)
        cluster.wait_nodes_up(len(cluster.nodes))
        taken = httpx.post(f"{live.url}/v2/sandboxes", json=body, timeout=120,
                           headers={**alpha, "Idempotency-Key": "orphan"})
        after_kill = time.monotonic() - killed
        assert taken.status_code == 201, taken.text
        orphan_id = taken.json()["sandboxID"]
        made.add(orphan_id)
        print(f"retry after kill -9 answered {after_kill:.1f} s after the kill "
              f"(lease {LEASE:g} s)")
        assert after_kill < LEASE + 15
        assert holder(cluster, orphan_id) == node_id
        # one sandbox per key on the nodes, whichever creates reached them
        on_nodes = []
        for node in cluster.nodes:
            listed = httpx.get(f"{node.url}/v2/sandboxes", params={"metadata": "batch=lease"},
                               headers=cluster.node_headers(node, "alpha"), timeout=30)
            on_nodes += [s["sandboxID"] for s in listed.json()]
        assert sorted(on_nodes) == sorted(made)
        again = httpx.post(f"{live.url}/v2/sandboxes", json=body, timeout=60,
                           headers={**alpha, "Idempotency-Key": "orphan"})
        assert again.status_code == 201 and again.json()["sandboxID"] == orphan_id
    finally:
        signal_nodes(cluster, signal.SIGCONT)
        for sandbox_id in made:
            httpx.delete(f"{cluster.url}/sandboxes/{sandbox_id}", headers=alpha, timeout=60)
        live.stop()
        doomed.stop()
        db.close()


def test_template_build_on_one_node_seen_cluster_wide(sdk: LocalCluster) -> None:
    """The SDK's Template.build through the gateway: one node builds (process backend: from
    another template); listing, get, tags and delete are the building team's, cluster-wide;
    sandboxes of the template are placed on the node that has it."""
    from e2b import Template

    alpha = {"X-API-KEY": sdk.keys["alpha"]}
    beta = {"X-API-KEY": sdk.keys["beta"]}
    name = "gw-built"
    template = Template().from_template("base").run_cmd("echo built-here > /tmp/built.txt")
    info = Template.build(template, name, tags=["v1"], cpu_count=1, memory_mb=512,
                          skip_cache=True)
    tid = info.template_id
    homes = [f"node{i}" for i, node in enumerate(sdk.nodes)
             if httpx.get(f"{node.url}/templates/{tid}", timeout=10,
                          headers=sdk.node_headers(node, "alpha")).status_code == 200]
    assert len(homes) == 1, homes
    with httpx.Client(base_url=sdk.url, timeout=60) as api:
        for path in ("/templates", "/v2/templates"):
            assert tid in [t["templateID"] for t in api.get(path, headers=alpha).json()]
            assert tid not in [t["templateID"] for t in api.get(path, headers=beta).json()]
        assert api.get(f"/templates/{tid}", headers=alpha).status_code == 200
        assert api.get(f"/templates/{tid}", headers=beta).status_code == 404
        assert Template.exists(name) and not Template.exists(name, api_key=sdk.keys["beta"])
        Template.assign_tags(f"{name}:v1", ["prod"])
        assert {t.tag for t in Template.get_tags(name)} >= {"default", "v1", "prod"}
        assert api.get(f"/templates/{tid}/tags", headers=beta).status_code == 404
        for method, path, body in [("POST", "/templates/tags", {"target": f"{name}:v1",
                                                                "tags": ["stolen"]}),
                                   ("POST", "/v2/sandboxes", {"templateID": name})]:
            answer = api.request(method, path, json=body, headers=beta)
            # the name is alpha's: beta can neither use nor tag it
            assert answer.status_code == 404, (path, answer.text)
        # names are per team: beta's template of that name is another template
        own = api.post("/v3/templates", json={"name": name}, headers=beta)
        assert own.status_code == 202 and own.json()["templateID"] != tid, own.text
        assert api.delete(f"/templates/{own.json()['templateID']}", headers=beta
                          ).status_code == 204
        builtin = api.post("/v3/templates", json={"name": "base"}, headers=beta)
        assert builtin.status_code == 400 and "built-in" in builtin.json()["message"]
        made = [Sandbox.create(template=ref, timeout=60) for ref in (name, f"{name}:prod", name)]
        try:
            for sbx in made:
                assert holder(sdk, sbx.sandbox_id) == homes[0]
                assert sbx.files.read("/tmp/built.txt") == "built-here\n"
        finally:
            for sbx in made:
                sbx.kill()
        assert api.delete(f"/templates/{tid}", headers=beta).status_code == 404
        assert api.delete(f"/templates/{tid}", headers=alpha).status_code == 204
        assert tid not in [t["templateID"] for t in api.get("/templates", headers=alpha).json()]
        assert not Template.exists(name)


def test_scheduler_kill9_keeps_sandboxes_routable(sdk: LocalCluster) -> None:
    sbx = Sandbox.create(template="base", timeout=300)
    try:
        assert sbx.commands.run("echo before").stdout == "before\n"
        sdk.scheduler.kill9()
        time.sleep(1.5)  # past the gateway's lookup cache
        # the scheduler is down: traffic to known sandboxes still flows
        assert sbx.commands.run("echo during").stdout == "during\n"
        sdk.scheduler.start()
        sdk.wait_nodes_up(3, timeout=90)
        # bindings came back from Redis: a fresh connect (control route) finds the sandbox
        assert Sandbox.connect(sbx.sandbox_id).commands.run("echo alive").stdout == "alive\n"
        another = Sandbox.create(template="base", timeout=60)
        assert another.commands.run("true").exit_code == 0
        another.kill()
    finally:
        sbx.kill()


def test_node_kill9_answers_503_for_its_sandboxes_until_it_returns(sdk: LocalCluster) -> None:
    made = [Sandbox.create(template="base", timeout=300) for _ in range(3)]
    try:
        homes = {s.sandbox_id: holder(sdk, s.sandbox_id) for s in made}
        victim_id = homes[made[0].sandbox_id]
        victim = sdk.node_of(victim_id)
        victim.kill9()
        key = {"X-API-KEY": sdk.keys["alpha"]}
        deadline = time.monotonic() + 30
        status = 0
        while time.monotonic() < deadline:
            status = httpx.get(f"{sdk.url}/sandboxes/{made[0].sandbox_id}", headers=key,
                               timeout=10).status_code
            if status == 503:
                break
            time.sleep(0.2)
        assert status == 503
        traffic = httpx.get(f"{sdk.url}/health", timeout=10,
                            headers={"E2b-Sandbox-Id": made[0].sandbox_id})
        assert traffic.status_code == 503 and traffic.json()["message"] == "node unavailable"
        for sandbox in made:
            if homes[sandbox.sandbox_id] != victim_id:
                assert sandbox.commands.run("echo ok").stdout == "ok\n"
        victim.start()
        sdk.wait_nodes_up(3, timeout=90)
        back = Sandbox.connect(made[0].sandbox_id)
        assert back.commands.run("echo back").stdout == "back\n"
    finally:
        for sandbox in made:
            sandbox.kill()
