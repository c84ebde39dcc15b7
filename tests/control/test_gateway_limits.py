"""A shared cluster's limits and per-team uploads, through the real gateway, scheduler, Redis
and a process-backend node (control/gateway/limits.py, node/template_files.py):

- team quotas over the cluster: the N+1th sandbox (create or fork), template or snapshot of a
  team is a 429 naming its limit, another team is not affected, and room comes back once a
  sandbox is gone; a burst of concurrent creates gets exactly the quota;
- the signed-URL owner lookup (unauthenticated, asks every node) is rate limited per client
  address, a URL whose owner is cached is not; the address is the peer's unless the peer is a
  trusted proxy (AENV_TRUSTED_PROXIES), never one a client names in a header;
- sandbox traffic for ids the scheduler does not know (no key needed) costs the scheduler a
  lookup only within a client's budget (AENV_UNKNOWN_SANDBOX_RATE), a miss is cached, and a
  real sandbox stays reachable meanwhile;
- `/nodes` shows a team its own sandboxes' figures only;
- a file one team uploads under the hash of another team's COPY is not what the other team's
  build uses."""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.template.utils import calculate_files_hash

from agentenv.control.gateway.limits import UNKNOWN_SANDBOXES, LookupLimiter
from agentenv.relay.connections import client_key
from tests.control.cluster import ROOMY_NODES, GatewayProcess, LocalCluster, running
from tests.control.conftest import free_port
from tests.control.helpers import wait_for
from tests.node.conftest import environ_set
from tests.node.test_template_uploads import tar_of

pytestmark = pytest.mark.timeout(300)

QUOTAS = {"AENV_TEAM_MAX_SANDBOXES": "2", "AENV_TEAM_MAX_TEMPLATES": "2",
          "AENV_TEAM_MAX_SNAPSHOTS": "1",
          # one token per 1000 s: the bucket does not refill during the test
          "AENV_SIGNED_LOOKUP_RATE": "0.001", "AENV_SIGNED_LOOKUP_BURST": "3",
          "AENV_UNKNOWN_SANDBOX_RATE": "0.001", "AENV_UNKNOWN_SANDBOX_BURST": "5"}
#: the loopback address the unknown-id flood comes from: the other tests' clients (127.0.0.1)
#: keep their own buckets
FLOODER = "127.0.0.3"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    made = LocalCluster(tmp_path_factory.mktemp("limits"), nodes=1,
                        node_env=ROOMY_NODES)
    made.gateway.env = {**made.gateway.env, **QUOTAS}
    made.scheduler_metrics = free_port()  # type: ignore[attr-defined]
    made.scheduler.argv += ["--metrics-port", str(made.scheduler_metrics)]  # type: ignore[attr-defined]
    with running(made, "quota", "other", "planter", "victim", "signer", "burst", "viewer",
                 "stranger", "prober") as started:
        yield started


def api(cluster: LocalCluster, team: str) -> httpx.Client:
    return httpx.Client(base_url=cluster.url, headers={"X-API-KEY": cluster.keys[team]},
                        timeout=60, trust_env=False)


def _refused(answer: httpx.Response, setting: str) -> None:
    assert answer.status_code == 429, answer.text
    body = answer.json()
    assert body["code"] == 429 and setting in body["message"], body
    assert "team quota reached" in body["message"]


def test_team_quotas_hold_over_the_cluster(cluster: LocalCluster) -> None:
    with api(cluster, "quota") as team, api(cluster, "other") as other:
        first = team.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert first.status_code == 201, first.text
        sid = first.json()["sandboxID"]
        forked = team.post(f"/sandboxes/{sid}/fork", json={"count": 1})
        assert forked.status_code == 201, forked.text
        child = forked.json()[0]["sandbox"]["sandboxID"]
        _refused(team.post("/sandboxes", json={"templateID": "base"}), "AENV_TEAM_MAX_SANDBOXES")
        _refused(team.post(f"/sandboxes/{sid}/fork", json={"count": 1}),
                 "AENV_TEAM_MAX_SANDBOXES")
        assert len(team.get("/sandboxes").json()) == 2  # nothing made for the refused ones
        theirs = other.post("/sandboxes", json={"templateID": "base", "timeout": 60})
        assert theirs.status_code == 201, theirs.text  # another team has its own quota

        snap = team.post(f"/sandboxes/{sid}/snapshots", json={})
        assert snap.status_code == 201, snap.text
        _refused(team.post(f"/sandboxes/{sid}/snapshots", json={}), "AENV_TEAM_MAX_SNAPSHOTS")

        assert team.delete(f"/sandboxes/{child}").status_code == 204
        # the scheduler lets go of the binding with the node's next heartbeat
        def room() -> bool:
            answer = team.post("/sandboxes", json={"templateID": "base", "timeout": 60})
            assert answer.status_code in (201, 429), answer.text
            return answer.status_code == 201

        wait_for("room for a sandbox once one is gone", room, timeout=60, interval=0.5)

        for name in ("q-one", "q-two"):
            assert team.post("/v3/templates", json={"name": name}).status_code == 202
        _refused(team.post("/v3/templates", json={"name": "q-three"}), "AENV_TEAM_MAX_TEMPLATES")


def test_signed_url_lookups_are_rate_limited_per_client_but_not_cached_owners(
        cluster: LocalCluster) -> None:
    with environ_set({"E2B_API_URL": cluster.url, "E2B_SANDBOX_URL": cluster.url,
                      "E2B_API_KEY": cluster.keys["signer"]}):
        sbx = Sandbox.create(template="base", timeout=120)
    try:
        sbx.files.write("/tmp/signed.txt", "signed")
        url = sbx.download_url("/tmp/signed.txt")
        with httpx.Client(timeout=30, trust_env=False) as client:
            assert client.get(url).status_code == 200  # a lookup (1 of 3), then cached
            forged = url.replace("signature=v1_", "signature=v1_A")
            assert [client.get(forged).status_code for _ in range(2)] == [401, 401]
            limited = client.get(forged)
            assert limited.status_code == 429, limited.text
            assert "AENV_SIGNED_LOOKUP_RATE" in limited.json()["message"]
            assert limited.headers["retry-after"] == "1"
            cached = client.get(url)  # its owner is known: no lookup, not limited
            assert cached.status_code == 200 and cached.text == "signed"
    finally:
        sbx.kill()


def test_a_strangers_refused_lookups_are_counted_not_each_logged(cluster: LocalCluster) -> None:
    """Found by the red team: each refused lookup wrote a line to the gateway's log, so a
    stranger with no key wrote the gateway's disk at will."""
    logged = lambda: cluster.gateway.log.read_bytes().count(b"signed URL lookup rate limited")  # noqa: E731
    before = logged()
    with httpx.Client(base_url=cluster.url, trust_env=False, timeout=10) as stranger:
        statuses = [stranger.get("/files", params={"path": "/x", "signature": f"v1_{i}"})
                    .status_code for i in range(300)]
    assert statuses.count(429) >= 290
    assert logged() - before <= 2


def _scheduler_lookups(cluster: LocalCluster) -> float:
    text = httpx.get(f"http://127.0.0.1:{cluster.scheduler_metrics}/metrics",  # type: ignore[attr-defined]
                     timeout=10, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("aenv_scheduler_calls_total{")
               and 'method="Lookup"' in line)


def test_unknown_sandbox_ids_cost_the_scheduler_a_bounded_number_of_lookups(
        cluster: LocalCluster) -> None:
    """Found by the red team (finding 5): a miss was not cached, so a stranger with no key
    sending traffic for made-up sandbox ids made one scheduler lookup per request."""
    with environ_set({"E2B_API_URL": cluster.url, "E2B_SANDBOX_URL": cluster.url,
                      "E2B_API_KEY": cluster.keys["prober"]}):
        sbx = Sandbox.create(template="base", timeout=120)
    try:
        before = _scheduler_lookups(cluster)
        flooder = httpx.Client(base_url=cluster.url, timeout=30, trust_env=False,
                               transport=httpx.HTTPTransport(local_address=FLOODER))
        with flooder:
            statuses = []
            for i in range(200):
                # made-up ids, and the same id again (a cached miss)
                sid = f"nosuch{i}" if i % 2 else "nosuchatall"
                statuses.append(flooder.get("/health", headers={"E2b-Sandbox-Id": sid,
                                                                "E2b-Sandbox-Port": "49983"})
                                .status_code)
                if i == 100:  # another client's real sandbox is served during the flood
                    sbx.files.write("/tmp/during.txt", "during")
                    assert sbx.files.read("/tmp/during.txt") == "during"
            limited = flooder.get("/health", headers={"E2b-Sandbox-Id": "nosuchother"})
            # a cached sandbox is never limited, even for the flooder
            assert sbx.files.read("/tmp/during.txt") == "during"  # (cached again)
            known = flooder.get("/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id})
        lookups = _scheduler_lookups(cluster) - before
        # the flood's misses within the burst (5) and the few cached misses' renewals, plus the
        # real sandbox's lookups (its cache lapses each second); before, one per request
        assert lookups <= 30, lookups
        assert limited.status_code == 429, limited.text
        assert "AENV_UNKNOWN_SANDBOX_RATE" in limited.json()["message"]
        assert limited.headers["retry-after"] == "1"
        assert set(statuses) == {502, 429} and statuses.count(429) >= 90, statuses
        assert known.status_code != 429, known.text
    finally:
        sbx.kill()


def test_one_ipv6_prefix_shares_one_lookup_bucket() -> None:
    """Found by the red team: a bucket per exact address let a client with a /64 (every IPv6
    host) take a fresh burst per request."""
    limiter = LookupLimiter(rate=0.001, burst=3)  # 3 lookups, no refill during the test
    assert sum(limiter.allow(f"2001:db8:1:2::{i:x}") for i in range(1000)) == 3
    assert limiter.allow("2001:db8:1:3::1")  # another /64 is another client
    assert client_key("::ffff:192.0.2.7") == client_key("192.0.2.7") == "192.0.2.7"


def test_an_unknown_id_takes_a_token_and_a_found_sandbox_gives_it_back() -> None:
    """The unknown-sandbox bucket: a lookup takes a token before it runs (concurrent ones
    stop at the burst), and one that found a sandbox gives it back: only misses cost."""
    limiter = LookupLimiter(rate=0.001, burst=2, kind=UNKNOWN_SANDBOXES)
    assert limiter.allow("192.0.2.1") and limiter.allow("192.0.2.1")
    assert not limiter.allow("192.0.2.1")
    assert limiter.allow("192.0.2.2")  # another client's bucket
    assert "AENV_UNKNOWN_SANDBOX_RATE 0.001/s" in limiter.refusal("192.0.2.1")
    limiter.refund("192.0.2.1")  # that lookup found a sandbox
    assert limiter.allow("192.0.2.1")
    for _ in range(5):  # refunds never fill the bucket past its burst
        limiter.refund("192.0.2.3")
    assert sum(limiter.allow("192.0.2.3") for _ in range(10)) == 2


def test_a_file_planted_under_another_team_hash_is_not_used(cluster: LocalCluster,
                                                            tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "note.txt").write_text("the victim's note\n")
    files_hash = calculate_files_hash("note.txt", "/tmp/note.txt", str(ctx), [], False, None)
    with api(cluster, "planter") as planter:
        made = planter.post("/v3/templates", json={"name": f"plant-{uuid.uuid4().hex[:6]}"})
        assert made.status_code == 202, made.text
        link = planter.get(f"/templates/{made.json()['templateID']}/files/{files_hash}")
        assert link.status_code == 201 and link.json()["present"] is False, link.text
        with httpx.Client(timeout=30, trust_env=False) as plain:
            planted = plain.put(link.json()["url"], content=tar_of("note.txt", b"planted\n"))
            assert planted.status_code == 200, planted.text
    with environ_set({"E2B_API_URL": cluster.url, "E2B_SANDBOX_URL": cluster.url,
                      "E2B_API_KEY": cluster.keys["victim"]}):
        built = Template.build(Template(file_context_path=str(ctx)).from_template("base")
                               .copy("note.txt", "/tmp/note.txt"),
                               f"victim-{uuid.uuid4().hex[:6]}", cpu_count=1, memory_mb=512,
                               skip_cache=True)
        sbx = Sandbox.create(template=built.template_id, timeout=60)
        try:
            assert sbx.files.read("/tmp/note.txt") == "the victim's note\n"
        finally:
            sbx.kill()


def test_an_upload_sent_slowly_through_the_gateway_is_cut(cluster: LocalCluster,
                                                          tmp_path: Path) -> None:
    """`/template-files/{templateID}/{hash}` needs no key (the node checks the signature, but
    the relay sends the body before it reads the 403): a stranger who knows a template id and
    sends a body a byte at a time held a place of the owning team's share at the gateway for
    the relay's idle timeout (600 s). The gateway cuts it with 408 once no byte came for
    AENV_BODY_TIMEOUT."""
    with api(cluster, "viewer") as owner:
        made = owner.post("/v3/templates", json={"name": f"slow-{uuid.uuid4().hex[:6]}"})
        assert made.status_code == 202, made.text
    template_id = made.json()["templateID"]
    with another_gateway(cluster, tmp_path, AENV_BODY_TIMEOUT="2") as url:
        port = httpx.URL(url).port
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(f"PUT /template-files/{template_id}/{'a' * 64}?expires=1&signature=x "
                         "HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\nx".encode())
            answer = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(65536):
                    answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"AENV_BODY_TIMEOUT" in answer


def _at_once(cluster: LocalCluster, team: str, count: int,
             request: Callable[[httpx.Client, int], httpx.Response]) -> list[httpx.Response]:
    """`count` requests of `team` sent at once, each on its own connection."""
    start = threading.Barrier(count)

    def one(i: int) -> httpx.Response:
        with api(cluster, team) as client:
            start.wait()
            return request(client, i)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def _exactly(answers: list[httpx.Response], made: int, status: int, setting: str) -> None:
    assert sorted(a.status_code for a in answers) == sorted(
        [status] * made + [429] * (len(answers) - made)), [a.text for a in answers]
    for answer in answers:
        if answer.status_code == 429:
            _refused(answer, setting)


def test_a_burst_of_creates_gets_exactly_the_quota(cluster: LocalCluster) -> None:
    """Sandboxes, snapshots and templates are reserved in Redis before a node is asked: N
    concurrent creates against a quota of K make exactly K, the rest are 429 naming it."""
    _exactly(_at_once(cluster, "burst", 6, lambda c, _: c.post(
        "/sandboxes", json={"templateID": "base", "timeout": 120})), 2, 201,
        "AENV_TEAM_MAX_SANDBOXES")
    # what was made keeps its place until it is gone, however long it runs (only the places
    # of creates under way lapse)
    held = cluster.redis.raw("gateway").zrange("aenv:quota:sandboxes:burst", 0, -1,
                                               withscores=True)
    assert len(held) == 2 and all(score == float("inf") for _, score in held), held
    with api(cluster, "burst") as team:
        sid = team.get("/sandboxes").json()[0]["sandboxID"]
        _exactly(_at_once(cluster, "burst", 5, lambda c, _: c.post(
            f"/sandboxes/{sid}/snapshots", json={})), 1, 201, "AENV_TEAM_MAX_SNAPSHOTS")
        assert len(team.get("/snapshots").json()) == 1
        _exactly(_at_once(cluster, "burst", 6, lambda c, i: c.post(
            "/v3/templates", json={"name": f"burst-{i}"})), 2, 202, "AENV_TEAM_MAX_TEMPLATES")
        templates = [t for t in team.get("/templates").json()
                     if any(a.startswith("burst-") for a in t.get("aliases", []))]
        assert len(templates) == 2, templates
        # a deleted template gives its place back
        assert team.delete(f"/templates/{templates[0]['templateID']}").status_code == 204
        again = team.post("/v3/templates", json={"name": "burst-again"})
        assert again.status_code == 202, again.text


def test_nodes_show_a_team_only_its_own_load(cluster: LocalCluster) -> None:
    """`/nodes` (E2B's admin route; a team key may call it, as the E2B-compatible API lets it)
    shows each node with the figures of the caller's own sandboxes: another team's sandboxes,
    creates and allocations, and the host's use they make up, are not shown."""
    with api(cluster, "viewer") as viewer, api(cluster, "stranger") as stranger:
        made = [viewer.post("/sandboxes", json={"templateID": "base", "timeout": 120})
                for _ in range(2)]
        assert [m.status_code for m in made] == [201, 201], [m.text for m in made]
        listed = viewer.get("/sandboxes").json()
        cpus, mib = sum(s["cpuCount"] for s in listed), sum(s["memoryMB"] for s in listed)
        for client, count in ((viewer, 2), (stranger, 0)):
            nodes = client.get("/nodes")
            assert nodes.status_code == 200, nodes.text
            assert [n["nodeID"] for n in nodes.json()] == ["node0"]
            for node in (nodes.json()[0], client.get("/nodes/node0").json()):
                assert node["sandboxCount"] == count and node["createSuccesses"] == count, node
                metrics = node["metrics"]
                assert metrics["allocatedCPU"] == (cpus if count else 0), metrics
                assert metrics["allocatedMemoryBytes"] == (mib << 20 if count else 0), metrics
                # the host's use is every team's load
                assert "cpuPercent" not in metrics and "memoryUsedBytes" not in metrics
                assert all("usedBytes" not in d for d in metrics["disks"])
    # the node answers no team-less `/nodes`: its figures are always some team's view
    node = cluster.nodes[0]
    teamless = httpx.get(node.url + "/nodes", timeout=30, trust_env=False,
                         headers={"x-agentenv-cluster-secret": cluster.secret})
    assert teamless.status_code == 403, teamless.text


@contextlib.contextmanager
def another_gateway(cluster: LocalCluster, tmp_path: Path, **env: str) -> Iterator[str]:
    """One more gateway of the cluster (its own lookup buckets) with `env`; yields its URL."""
    gateway = GatewayProcess(cluster.scheduler.address, cluster.redis.url, cluster.secret_file,
                             tmp_path / "gateway.log",
                             env={**cluster.redis.env("gateway"), **QUOTAS, **env})
    gateway.start()
    try:
        yield gateway.url
    finally:
        gateway.stop()


#: a signed file URL no sandbox's token made: every request of it is a lookup (then 401)
FORGED = "/files?path=%2Ftmp%2Fx&username=user&signature=v1_forged"


def _lookups(url: str, forwarded_for: str) -> list[int]:
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        return [client.get(FORGED, headers={"X-Forwarded-For": forwarded_for}).status_code
                for _ in range(4)]


def test_a_client_cannot_pick_its_lookup_bucket_with_a_header(cluster: LocalCluster,
                                                              tmp_path: Path) -> None:
    """With no trusted proxy, X-Forwarded-For is the client's claim: every value it sends is
    one bucket, the peer's (uvicorn alone trusts loopback's header)."""
    with another_gateway(cluster, tmp_path) as url, httpx.Client(
            base_url=url, timeout=30, trust_env=False) as client:
        answers = [client.get(FORGED, headers={"X-Forwarded-For": f"198.51.100.{i}"})
                   for i in range(4)]
        assert [a.status_code for a in answers] == [401, 401, 401, 429], [
            a.text for a in answers]


def test_behind_a_trusted_proxy_each_client_has_its_own_bucket(cluster: LocalCluster,
                                                               tmp_path: Path) -> None:
    """Behind a load balancer every client comes from its address: with that address trusted
    (AENV_TRUSTED_PROXIES) the client is the one it forwarded for, so one stranger does not
    starve everyone; and what a client put in the header before the proxy does not count."""
    with another_gateway(cluster, tmp_path, AENV_TRUSTED_PROXIES="127.0.0.0/8") as url:
        assert _lookups(url, "203.0.113.5") == [401, 401, 401, 429]
        # the proxy appends the peer it saw to what the client sent: that one is the client
        assert _lookups(url, "198.51.100.77, 203.0.113.5") == [429] * 4
        assert _lookups(url, "203.0.113.6") == [401, 401, 401, 429]


def test_a_malformed_trusted_proxy_is_refused_naming_the_setting(cluster: LocalCluster,
                                                                 tmp_path: Path) -> None:
    gateway = GatewayProcess(cluster.scheduler.address, cluster.redis.url, cluster.secret_file,
                             tmp_path / "gateway.log", env={
                                 **cluster.redis.env("gateway"),
                                 "AENV_TRUSTED_PROXIES": "10.0.0.0/8,lb.example"})
    try:
        with pytest.raises(RuntimeError, match=r"AENV_TRUSTED_PROXIES: 'lb\.example' is not"):
            gateway.start()
    finally:
        gateway.stop()
