"""A cluster's lifecycle events and webhooks through the gateway (control/gateway/events.py):
a real local cluster (Redis with the ACL of cluster-up, the scheduler, two process-backend
nodes, the gateway), loopback receivers checking the signatures, and a gateway killed -9."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentenv.api.auth import metrics_token
from tests.control.cluster import ROOMY_NODES, GatewayProcess, LocalCluster, running
from tests.control.helpers import wait_for
from tests.node.test_events import Receiver

pytestmark = pytest.mark.timeout(300)

SECRET = "hook-secret-for-tests"
# the poll is the longest there is: events reach the lists and the webhooks because they are
# pushed (the collector's long poll of each node, the wakes of the webhook workers), never by
# a poll's round coming up
GATEWAY_ENV = {"AENV_WEBHOOK_ALLOW_PRIVATE": "1", "AENV_GATEWAY_EVENTS_POLL": "60",
               "AENV_GATEWAY_EVENTS_LEASE": "3", "AENV_WEBHOOK_BACKOFF": "0.2",
               "AENV_WEBHOOK_ATTEMPTS": "2", "AENV_WEBHOOK_TIMEOUT": "3",
               "AENV_WEBHOOK_QUEUE": "10"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    made = LocalCluster(tmp_path_factory.mktemp("cluster"), nodes=2, strategy="round-robin",
                        node_env=ROOMY_NODES)
    made.gateway.env.update(GATEWAY_ENV)
    with running(made, "alpha", "beta") as started:
        yield started


def api(cluster: LocalCluster, team: str, url: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=url or cluster.url, headers={"X-API-KEY": cluster.keys[team]},
                        timeout=60)


def create(client: httpx.Client) -> str:
    answer = client.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["sandboxID"])


def events(client: httpx.Client, path: str = "/events/sandboxes", **params: Any
           ) -> list[dict[str, Any]]:
    """Every event the path lists, oldest first, paged by offset."""
    found: list[dict[str, Any]] = []
    while True:
        answer = client.get(path, params={"orderAsc": "true", "limit": 100,
                                          "offset": len(found), **params})
        assert answer.status_code == 200, answer.text
        found += answer.json()
        if len(answer.json()) < 100:
            return found


def node_events(cluster: LocalCluster, team: str) -> dict[str, dict[str, Any]]:
    """id -> event, of every event the nodes themselves hold for `team`."""
    found = {}
    for node in cluster.nodes:
        with httpx.Client(base_url=node.url, headers=cluster.node_headers(node, team)) as c:
            found.update({e["id"]: e for e in events(c)})
    return found


def collected(cluster: LocalCluster, team: str, url: str | None = None) -> list[dict[str, Any]]:
    """The team's events through the gateway once they are all of the nodes' (none missing,
    none repeated); waits for the collector."""
    def probe() -> list[dict[str, Any]] | None:
        with api(cluster, team, url) as client:
            listed = events(client)
        want = node_events(cluster, team)
        ids = [e["id"] for e in listed]
        assert len(ids) == len(set(ids)), "an event listed twice"
        assert set(ids) <= set(want), "an event the nodes do not have"
        return listed if set(ids) == set(want) else None

    return wait_for("the gateway to hold every node's events", probe, 60, 0.2)


def test_events_of_every_node_for_the_team_only(cluster: LocalCluster) -> None:
    with api(cluster, "alpha") as alpha, api(cluster, "beta") as beta:
        mine = [create(alpha) for _ in range(4)]
        theirs = create(beta)
        listed = collected(cluster, "alpha")
        created = [e for e in listed if e["type"] == "sandbox.lifecycle.created"]
        assert {e["sandboxId"] for e in created} >= set(mine)
        assert {e["nodeId"] for e in created} == {"node0", "node1"}  # both nodes' events
        assert all(e["sandboxTeamId"] == "alpha" for e in listed)
        assert theirs not in {e["sandboxId"] for e in listed}
        seqs = [e["seq"] for e in listed]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        # the node's JSON, one event as the node itself answers it (seq aside: the cluster's)
        node_view = node_events(cluster, "alpha")[created[0]["id"]]
        assert {**created[0], "seq": 0} == {**node_view, "seq": 0}

        # another team's events are invisible, its sandbox's list empty (as on a node)
        assert [e["sandboxId"] for e in collected(cluster, "beta")] == [theirs]
        assert alpha.get(f"/events/sandboxes/{theirs}").json() == []
        one = events(alpha, f"/events/sandboxes/{mine[0]}")
        assert [e["type"] for e in one] == ["sandbox.lifecycle.created"]

        # paging: offset, limit, order, after (the cluster's seq), types
        newest = alpha.get("/events/sandboxes", params={"limit": 2}).json()
        assert newest == list(reversed(listed))[:2]
        page = alpha.get("/events/sandboxes", params={"orderAsc": "true", "limit": 2,
                                                      "offset": 1}).json()
        assert page == listed[1:3]
        after = alpha.get("/events/sandboxes", params={"orderAsc": "true", "limit": 100,
                                                       "after": listed[1]["seq"]}).json()
        assert after == listed[2:]
        assert alpha.get("/events/sandboxes", params={
            "after": listed[-2]["seq"]}).json() == listed[-1:]
        killed = alpha.delete(f"/sandboxes/{mine[0]}")
        assert killed.status_code == 204, killed.text
        kills = wait_for("the kill's event", lambda: alpha.get("/events/sandboxes", params={
            "types": "sandbox.lifecycle.killed"}).json())
        assert [e["sandboxId"] for e in kills] == [mine[0]]
        bad = alpha.get("/events/sandboxes", params={"types": "nope"})
        assert bad.status_code == 400 and "unknown event types" in bad.json()["message"]
        assert alpha.get("/events/sandboxes", params={"limit": 0}).status_code == 400
        assert httpx.get(cluster.url + "/events/sandboxes").status_code == 401
        scraped = httpx.get(cluster.url + "/metrics", headers={
            "authorization": f"Bearer {metrics_token(cluster.secret)}"}).text
        moved = [line.split()[1] for line in scraped.splitlines()
                 if line.startswith("aenv_gateway_events_collected_total ")]
        assert float(moved[0]) >= len(listed)


def signed_by(headers: dict[str, str], body: bytes) -> bool:
    """Both signatures of a delivery (node/webhooks.py) are the secret's."""
    e2b = base64.urlsafe_b64encode(hashlib.sha256(SECRET.encode() + body).digest()
                                   ).decode().rstrip("=")
    mac = "v1=" + base64.b64encode(hmac.new(SECRET.encode(), body, hashlib.sha256).digest()
                                   ).decode()
    return headers["e2b-signature"] == e2b and headers["aenv-signature"] == mac


def test_webhooks_signed_from_both_nodes_and_a_dead_receiver_delays_nothing(
        cluster: LocalCluster) -> None:
    good, stuck, other = Receiver(), Receiver(), Receiver()
    stuck.hold.clear()  # answers nothing until released: each attempt times out
    wanted = ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"]
    try:
        with api(cluster, "alpha") as alpha, api(cluster, "beta") as beta:
            made = alpha.post("/events/webhooks", json={
                "name": "good", "url": good.url, "events": wanted, "signatureSecret": SECRET})
            assert made.status_code == 201, made.text
            hook = made.json()
            assert hook["teamID"] == "alpha" and "signatureSecret" not in hook
            dead = alpha.post("/events/webhooks", json={
                "url": stuck.url, "events": wanted, "signatureSecret": SECRET}).json()
            beta_hook = beta.post("/events/webhooks", json={
                "url": other.url, "events": wanted, "signatureSecret": SECRET}).json()
            assert alpha.get(f"/events/webhooks/{beta_hook['id']}").status_code == 404
            assert alpha.delete(f"/events/webhooks/{beta_hook['id']}").status_code == 404
            assert [h["id"] for h in alpha.get("/events/webhooks").json()] == [
                hook["id"], dead["id"]]
            bad = alpha.post("/events/webhooks", json={"url": good.url, "events": ["x"],
                                                       "signatureSecret": SECRET})
            assert bad.status_code == 422, bad.text

            # creates answer while the dead receiver holds its first delivery
            sandboxes = [create(alpha) for _ in range(3)]
            wait_for("the dead receiver's first attempt", lambda: stuck.arrived >= 1)
            sandboxes += [create(alpha) for _ in range(13)]
            assert not stuck.hold.is_set() and stuck.requests == []

            def delivered() -> list[dict[str, Any]] | None:
                bodies = [json.loads(b) for _, b in good.requests]
                got = {b["sandboxId"] for b in bodies if b["type"] == wanted[0]}
                return bodies if got >= set(sandboxes) else None

            bodies = wait_for("signed deliveries of every create", delivered, 60, 0.1)
            assert {b["nodeId"] for b in bodies} == {"node0", "node1"}
            assert all(signed_by(h, b) for h, b in good.requests)
            assert all(h["e2b-webhook-id"] == hook["id"] for h, _ in good.requests)
            ids = [b["id"] for b in bodies]
            assert len(ids) == len(set(ids))
            assert all(b["sandboxTeamId"] == "alpha" for b in bodies)
            assert other.requests == []  # beta made nothing since its webhook
            log = alpha.get(f"/events/webhooks/{hook['id']}/deliveries").json()
            assert [a["attempt"] for a in log] == [1] * len(log)
            assert log and all(a["delivered"] and a["status"] == 200 for a in log)
            assert {a["eventId"] for a in log} == set(ids)

            # the dead receiver's attempts time out (and are logged); more than its queue
            # (AENV_WEBHOOK_QUEUE) behind, its oldest events go; once it answers it gets the
            # newest
            failed = wait_for("the dead receiver's failed attempts", lambda: [
                a for a in alpha.get(f"/events/webhooks/{dead['id']}/deliveries").json()
                if not a["delivered"]], 60, 0.2)
            assert failed[0]["error"]
            wait_for("the dead receiver's dropped events", lambda: alpha.get(
                f"/events/webhooks/{dead['id']}").json()["dropped"] > 0, 120, 0.2)
            stuck.hold.set()
            wait_for("the dead receiver's newest deliveries once it answers", lambda: {
                json.loads(b)["sandboxId"] for _, b in stuck.requests} >= set(sandboxes[-5:]),
                120, 0.2)
            assert alpha.get(f"/events/webhooks/{hook['id']}").json()["dropped"] == 0

            # a change and a delete take effect; the nodes hold no webhook of their own
            patched = alpha.patch(f"/events/webhooks/{hook['id']}", json={"enabled": False})
            assert patched.status_code == 200 and patched.json()["enabled"] is False
            for client, made_hook in ((alpha, hook), (alpha, dead), (beta, beta_hook)):
                assert client.delete(f"/events/webhooks/{made_hook['id']}").status_code == 200
                assert client.get(f"/events/webhooks/{made_hook['id']}").status_code == 404
            assert alpha.get("/events/webhooks").json() == []
            for node in cluster.nodes:
                held = httpx.get(node.url + "/events/webhooks",
                                 headers=cluster.node_headers(node, "alpha"))
                assert held.status_code == 200 and held.json() == []
    finally:
        for receiver in (good, stuck, other):
            receiver.close()


def test_each_event_reaches_the_list_and_the_webhook_without_waiting_for_a_poll(
        cluster: LocalCluster) -> None:
    """The gateway polls every 60 s (GATEWAY_ENV) and each event still arrives within a few
    seconds, one after the other: the node answers the collector's long poll when it stores
    the event, the collector wakes the team's webhook worker (here or at another gateway,
    through Redis), and a webhook made now is taken up now. Before, an event waited for the
    collector's next round and the idle worker's next look, each one poll apart."""
    receiver = Receiver()
    bound = 15.0  # generous; a poll is 60
    try:
        with api(cluster, "alpha") as alpha:
            made = alpha.post("/events/webhooks", json={
                "url": receiver.url, "events": ["sandbox.lifecycle.created"],
                "signatureSecret": SECRET})
            assert made.status_code == 201, made.text
            for _ in range(3):
                began = time.monotonic()
                sid = create(alpha)
                wait_for("the create's event in the list", lambda sid=sid: alpha.get(
                    f"/events/sandboxes/{sid}").json(), bound, 0.05)
                wait_for("the create's delivery", lambda sid=sid: sid in {
                    json.loads(b)["sandboxId"] for _, b in receiver.requests}, bound, 0.05)
                assert time.monotonic() - began < bound
                assert alpha.delete(f"/sandboxes/{sid}").status_code == 204
            assert alpha.delete(f"/events/webhooks/{made.json()['id']}").status_code == 200
    finally:
        receiver.close()


def test_a_gateway_killed_loses_and_repeats_no_event(cluster: LocalCluster) -> None:
    """Two gateways; the one collecting is killed -9 while the nodes make events (straight at
    the nodes, as no gateway is needed for that); the other takes the nodes over once the
    leases lapse, then the first comes back and the second stops: every node's event is in
    the list exactly once."""
    second = GatewayProcess(cluster.scheduler.address, cluster.redis.url, cluster.secret_file,
                            cluster.root / "gateway2.log",
                            env={**cluster.redis.env("gateway"), **GATEWAY_ENV})
    second.start()
    try:
        with api(cluster, "alpha") as alpha:
            create(alpha)
        collected(cluster, "alpha")
        assert cluster.gateway.proc is not None
        cluster.gateway.proc.kill()
        cluster.gateway.proc.wait()
        cluster.gateway.proc = None
        for node in cluster.nodes:
            for _ in range(3):
                made = httpx.post(node.url + "/v2/sandboxes", timeout=60,
                                  headers=cluster.node_headers(node, "alpha"),
                                  json={"templateID": "base", "timeout": 300})
                assert made.status_code == 201, made.text
        collected(cluster, "alpha", second.url)
        cluster.gateway.start()
        with api(cluster, "alpha") as alpha:
            create(alpha)
        second.stop()
        with api(cluster, "alpha") as alpha:
            create(alpha)
        listed = collected(cluster, "alpha")
        assert len(listed) == len(node_events(cluster, "alpha"))
    finally:
        second.stop()


def test_a_teams_request_never_reads_every_teams_events_of_a_node(cluster: LocalCluster) -> None:
    """Red team (2026-12-06): a node answered `/cluster/events` (every team's events, the
    collector's route) to a request that named a team too, so one relay of the gateway that
    passed that path on with a team's header (node/tenancy.py: 'one gateway bug does not open
    every team') opened every team's events. Only the team-less collector reads it."""
    with api(cluster, "alpha") as alpha:
        mine = create(alpha)
    node = next(n for n in cluster.nodes
                if any(e["sandboxId"] == mine for e in events(httpx.Client(
                    base_url=n.url, headers=cluster.node_headers(n, "alpha")))))
    as_beta = httpx.get(node.url + "/cluster/events", params={"after": 0, "limit": 1000},
                        headers=cluster.node_headers(node, "beta"), timeout=30)
    assert as_beta.status_code == 404, as_beta.text[:300]
    assert mine not in as_beta.text
    # the collector (the node key, no team) still reads them
    teamless = {k: v for k, v in cluster.node_headers(node, "beta").items()
                if k != "x-agentenv-team"}
    collector = httpx.get(node.url + "/cluster/events", params={"after": 0, "limit": 1000},
                          headers=teamless, timeout=30)
    assert collector.status_code == 200
    assert mine in {e["sandboxId"] for e in collector.json()["events"]}


def test_a_team_never_gets_more_than_its_webhooks_by_racing(cluster: LocalCluster) -> None:
    """Red team (2026-12-06): the count was read, then the webhook added some awaits later,
    so creates sent at once all passed the check (each webhook costs every gateway a lease
    and a worker)."""
    import asyncio

    from agentenv.node.webhooks import MAX_WEBHOOKS_PER_TEAM

    team = "racer"
    cluster.team(team)
    body = {"name": "r", "url": "http://127.0.0.1:9/x", "signatureSecret": SECRET,
            "events": ["sandbox.lifecycle.created"]}

    async def race() -> list[int]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60, headers={
                "X-API-KEY": cluster.keys[team]}) as client:
            answers = await asyncio.gather(*(client.post("/events/webhooks", json=body)
                                             for _ in range(2 * MAX_WEBHOOKS_PER_TEAM)))
            return [a.status_code for a in answers]

    statuses = asyncio.run(race())
    with api(cluster, team) as client:
        hooks = client.get("/events/webhooks").json()
        try:
            assert len(hooks) <= MAX_WEBHOOKS_PER_TEAM, statuses
            assert statuses.count(201) == len(hooks)
        finally:
            for hook in hooks:
                client.delete(f"/events/webhooks/{hook['id']}")
