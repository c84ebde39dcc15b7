"""Lifecycle events (node/events.py) and signed webhooks (node/webhooks.py) on one node, with
the process backend in-process and real HTTP receivers on loopback."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agentenv.api.auth import NODE_KEY_HEADER
from agentenv.api.errors import BadRequest
from agentenv.api.tenancy import TEAM_HEADER
from agentenv.node import webhooks
from agentenv.node.events import Event, EventLog
from agentenv.node.server import ServeOptions, build_app
from agentenv.node.webhooks import check_destination, pinned

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

SECRET = "s3cret-for-tests"


class Receiver:
    """A loopback HTTP server that records each POST; `status` answers, and while `hold` is
    clear every request waits for it (a slow receiver)."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.arrived = 0  # requests read, answered or not
        self.statuses = list(statuses or [])
        self.hold = threading.Event()
        self.hold.set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.arrived += 1
                receiver.hold.wait(60)
                receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()

    def types(self) -> list[str]:
        return [json.loads(body)["type"] for _, body in self.requests]


def wait_for(check: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("AENV_WEBHOOK_BACKOFF", "0.01")
    monkeypatch.setenv("AENV_WEBHOOK_QUEUE", "3")
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process"))
    key = (tmp_path / "state" / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        client.app_state = app  # type: ignore[attr-defined]
        yield client


def create(client: TestClient, **extra: Any) -> str:
    answer = client.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300, **extra})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["sandboxID"])


def events_of(client: TestClient, sid: str, **params: Any) -> list[dict[str, Any]]:
    answer = client.get(f"/events/sandboxes/{sid}", params={"orderAsc": "true", **params})
    assert answer.status_code == 200, answer.text
    return list(answer.json())


def test_every_transition_is_an_event_in_order(node: TestClient) -> None:
    sid = create(node, metadata={"run": "r1"})
    assert node.post(f"/sandboxes/{sid}/timeout", json={"timeout": 200}).status_code == 204
    assert node.post(f"/sandboxes/{sid}/pause").status_code == 204
    assert node.post(f"/sandboxes/{sid}/connect", json={"timeout": 60}).status_code == 201
    snap = node.post(f"/sandboxes/{sid}/snapshots", json={})
    assert snap.status_code == 201, snap.text
    forked = node.post(f"/sandboxes/{sid}/fork", json={"count": 1})
    assert forked.status_code == 201, forked.text
    child = forked.json()[0]["sandbox"]["sandboxID"]
    assert node.delete(f"/sandboxes/{sid}").status_code == 204

    events = events_of(node, sid)
    assert [e["type"].rsplit(".", 1)[1] for e in events] == [
        "created", "updated", "paused", "resumed", "checkpointed", "killed"]
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    first = events[0]
    assert first["sandboxTeamId"] == "local" and first["sandboxTemplateId"]
    assert first["nodeId"] and first["version"] == "v2" and first["timestamp"].endswith("Z")
    assert first["eventData"]["sandbox_metadata"] == {"run": "r1"}
    assert events[2]["eventData"]["reason"] == "request"
    assert events[2]["eventData"]["execution"]["memory_mb"] > 0
    assert events[4]["eventData"]["snapshot_id"] == snap.json()["snapshotID"]
    assert events[5]["eventData"]["kill_reason"] == "request"
    (fork_event,) = events_of(node, child)
    assert fork_event["type"] == "sandbox.lifecycle.forked"
    assert fork_event["eventData"]["source_sandbox_id"] == sid

    # E2B's paging and filters: newest first by default, offset/limit, repeated types
    newest = node.get("/events/sandboxes", params={"limit": 2}).json()
    assert [e["seq"] for e in newest] == sorted([e["seq"] for e in newest], reverse=True)
    assert len(newest) == 2 and newest[0]["seq"] == max([*seqs, fork_event["seq"]])
    page2 = events_of(node, sid, offset=2, limit=2)
    assert [e["seq"] for e in page2] == seqs[2:4]
    only = events_of(node, sid, types=["sandbox.lifecycle.paused", "sandbox.lifecycle.killed"])
    assert [e["type"] for e in only] == ["sandbox.lifecycle.paused", "sandbox.lifecycle.killed"]
    assert [e["seq"] for e in events_of(node, sid, after=seqs[3])] == seqs[4:]
    assert node.get("/events/sandboxes", params={"types": "nope"}).status_code == 400
    assert node.get("/events/sandboxes", params={"limit": 101}).status_code == 400
    assert node.get("/events/sandboxes", params={"orderAsc": "maybe"}).status_code == 400


def test_timeouts_and_lost_sandboxes_say_why(node: TestClient) -> None:
    app = node.app_state  # type: ignore[attr-defined]
    orch = app.orchestrator
    timed, paused, lost = create(node), create(node, autoPause=True), create(node)
    for sid in (timed, paused):
        orch.sandboxes[sid].end_at = 0
    node.portal.call(lambda: _reap(orch))  # type: ignore[union-attr]
    node.portal.call(_lose, orch, lost)  # type: ignore[union-attr]
    wait_for(lambda: all(s not in orch._ops for s in (timed, paused, lost)), "the reaps")
    assert events_of(node, timed)[-1]["eventData"]["kill_reason"] == "timeout"
    last = events_of(node, paused)[-1]
    assert last["type"] == "sandbox.lifecycle.paused" and last["eventData"]["reason"] == "timeout"
    assert events_of(node, lost)[-1]["eventData"]["kill_reason"] == "lost: the VM died"


async def _reap(orch: Any) -> None:
    assert orch.reap_once() == 2


async def _lose(orch: Any, sid: str) -> None:
    orch.sandbox_lost(sid, "the VM died")


def test_events_past_the_retention_are_pruned(node: TestClient) -> None:
    log: EventLog = node.app_state.orchestrator.events  # type: ignore[attr-defined]
    log.record(Event(type="sandbox.lifecycle.created", team="local", sandbox_id="old",
                     timestamp=time.time() - log.retention - 60))
    log.record(Event(type="sandbox.lifecycle.created", team="local", sandbox_id="new"))
    assert len(events_of(node, "old")) == 1
    node.portal.call(log.store.prune_events, time.time() - log.retention)  # type: ignore[union-attr]
    assert events_of(node, "old") == [] and len(events_of(node, "new")) == 1


def _e2b_signature(body: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(SECRET.encode() + body).digest()
                                    ).decode().rstrip("=")


def register(client: TestClient, url: str, events: list[str] | None = None) -> str:
    answer = client.post("/events/webhooks", json={
        "name": "t", "url": url, "signatureSecret": SECRET,
        "events": events or ["sandbox.lifecycle.created", "sandbox.lifecycle.paused",
                             "sandbox.lifecycle.resumed", "sandbox.lifecycle.killed"]})
    assert answer.status_code == 201, answer.text
    assert "signatureSecret" not in answer.json() and answer.json()["teamID"] == "local"
    return str(answer.json()["id"])


def test_webhooks_are_signed_retried_and_logged(node: TestClient) -> None:
    receiver = Receiver(statuses=[500])  # the first attempt fails, the retry succeeds
    try:
        hook = register(node, receiver.url)
        assert [h["id"] for h in node.get("/events/webhooks").json()] == [hook]
        sid = create(node)
        assert node.delete(f"/sandboxes/{sid}").status_code == 204
        wait_for(lambda: len(receiver.requests) == 3, "three posts")
        assert receiver.types() == ["sandbox.lifecycle.created", "sandbox.lifecycle.created",
                                    "sandbox.lifecycle.killed"]
        for headers, body in receiver.requests:
            assert headers["e2b-signature"] == _e2b_signature(body)
            assert headers["aenv-signature"] == "v1=" + base64.b64encode(
                hmac.new(SECRET.encode(), body, hashlib.sha256).digest()).decode()
            assert headers["e2b-webhook-id"] == hook and headers["e2b-signature-version"] == "v1"
            assert json.loads(body)["sandboxId"] == sid
        # a retry is the same delivery
        assert receiver.requests[0][0]["e2b-delivery-id"] == receiver.requests[1][0][
            "e2b-delivery-id"]
        wait_for(lambda: len(node.get(f"/events/webhooks/{hook}/deliveries").json()) == 3,
                 "the delivery log")
        log = node.get(f"/events/webhooks/{hook}/deliveries").json()[::-1]
        assert [(a["attempt"], a["status"], a["delivered"]) for a in log] == [
            (1, 500, False), (2, 200, True), (1, 200, True)]
        # PATCH turns it off; DELETE removes it
        changed = node.patch(f"/events/webhooks/{hook}", json={"enabled": False})
        assert changed.status_code == 200 and changed.json()["enabled"] is False
        create(node)
        assert node.delete(f"/events/webhooks/{hook}").status_code == 200
        assert node.get(f"/events/webhooks/{hook}").status_code == 404
        assert len(receiver.requests) == 3
    finally:
        receiver.close()


def test_a_slow_receiver_blocks_nothing_but_its_own_bounded_queue(node: TestClient) -> None:
    slow, fast = Receiver(), Receiver()
    slow.hold.clear()
    try:
        slow_id, _ = register(node, slow.url), register(node, fast.url)
        sid = create(node)
        for _ in range(3):  # lifecycle calls return while the slow receiver holds every post
            assert node.post(f"/sandboxes/{sid}/pause").status_code == 204
            assert node.post(f"/sandboxes/{sid}/connect", json={"timeout": 60}).status_code == 201
        assert node.delete(f"/sandboxes/{sid}").status_code == 204
        wait_for(lambda: len(fast.requests) == 8, "the fast receiver's posts")
        assert slow.requests == []
        state = node.get(f"/events/webhooks/{slow_id}").json()
        # one event in the worker's hands, three queued (AENV_WEBHOOK_QUEUE), the rest dropped
        assert state["queued"] == 3 and state["dropped"] == 4
        slow.hold.set()
        wait_for(lambda: len(slow.requests) == 4, "the slow receiver's posts")
        assert slow.types()[-1] == "sandbox.lifecycle.killed"
    finally:
        slow.close()
        fast.close()


def test_a_standalone_node_serves_no_cluster_events(node: TestClient) -> None:
    create(node)
    assert node.get("/cluster/events").status_code == 404


def test_webhook_bodies_are_validated(node: TestClient) -> None:
    base = {"url": "http://127.0.0.1:9/x", "signatureSecret": SECRET,
            "events": ["sandbox.lifecycle.created"]}
    assert node.post("/events/webhooks", json={**base, "url": "ftp://x/"}).status_code == 400
    assert node.post("/events/webhooks", json={**base, "events": ["x"]}).status_code == 422
    assert node.post("/events/webhooks", json={**base, "signatureSecret": ""}).status_code == 422


@pytest.mark.parametrize("url", ["http://127.0.0.1/", "http://10.1.2.3/", "http://[::1]:80/",
                                 "http://169.254.169.254/latest", "http://0.0.0.0/"])
def test_a_node_of_a_cluster_refuses_non_public_destinations(url: str) -> None:
    with pytest.raises(BadRequest):
        check_destination(url, allow_private=False)
    check_destination(url, allow_private=True)


def test_teams_see_only_their_own_events_and_webhooks(tmp_path: Path) -> None:
    """A node of a cluster: each request names its team (the gateway's header)."""
    secret = "node-key-for-tests"
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process",
                                 node_key=secret))
    with TestClient(app) as client:
        def as_team(team: str) -> dict[str, str]:
            return {NODE_KEY_HEADER.decode(): secret, TEAM_HEADER.decode(): team}

        created = client.post("/v2/sandboxes", json={"templateID": "base"},
                              headers=as_team("team-a"))
        assert created.status_code == 201, created.text
        sid = created.json()["sandboxID"]
        mine = client.get(f"/events/sandboxes/{sid}", headers=as_team("team-a")).json()
        assert [e["sandboxTeamId"] for e in mine] == ["team-a"]
        assert client.get(f"/events/sandboxes/{sid}", headers=as_team("team-b")).json() == []
        assert client.get("/events/sandboxes", headers=as_team("team-b")).json() == []
        # the gateway delivers a cluster's webhooks (control/gateway/events.py): its node
        # registers none, and its events go to no sink of its own
        refused = client.post("/events/webhooks", headers=as_team("team-a"), json={
            "url": "http://1.1.1.1/", "signatureSecret": SECRET,
            "events": ["sandbox.lifecycle.created"]})
        assert refused.status_code == 409 and "gateway" in refused.json()["message"]
        assert app.orchestrator.events.sinks == []  # type: ignore[union-attr]
        # every team's events, for the gateway only (its node key)
        collected = client.get("/cluster/events", headers={NODE_KEY_HEADER.decode(): secret})
        assert collected.status_code == 200, collected.text
        assert [e["sandboxId"] for e in collected.json()["events"]] == [sid]
        assert collected.json()["last"] == collected.json()["events"][-1]["seq"]
        last = collected.json()["last"]
        assert client.get(f"/cluster/events?after={last}", headers={
            NODE_KEY_HEADER.decode(): secret}).json() == {"events": [], "last": last}
        assert client.get("/cluster/events").status_code == 403
        client.delete(f"/sandboxes/{sid}", headers=as_team("team-a"))


def test_pinned_aims_at_the_checked_address() -> None:
    assert pinned("http://1.1.1.1:8080/hook?x=1") == (
        "http://1.1.1.1:8080/hook?x=1", {"host": "1.1.1.1:8080"}, {})
    url, host, extensions = pinned("https://[2606:4700:4700::1111]/h")
    assert url == "https://[2606:4700:4700::1111]/h" and extensions == {
        "sni_hostname": "2606:4700:4700::1111"} and host == {"host": "[2606:4700:4700::1111]"}
    with pytest.raises(BadRequest):
        pinned("http://localhost:8080/")  # /etc/hosts: loopback


def test_a_cluster_node_checks_the_address_again_at_each_delivery(node: TestClient) -> None:
    """A destination allowed at registration that is not public at delivery (a name that now
    resolves elsewhere) gets nothing: every attempt is refused and logged."""
    receiver = Receiver()
    try:
        hook = register(node, receiver.url, ["sandbox.lifecycle.created"])
        node.app_state.orchestrator.events.sinks[0].allow_private = False  # type: ignore
        create(node)
        wait_for(lambda: len(node.get(f"/events/webhooks/{hook}/deliveries").json()) == 4,
                 "four refused attempts")
        attempts = node.get(f"/events/webhooks/{hook}/deliveries").json()
        assert all(not a["delivered"] and "non-public" in a["error"] for a in attempts)
        assert receiver.requests == []
    finally:
        receiver.close()


def test_a_pinned_delivery_reaches_the_checked_address_with_the_name_as_host(
        node: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hooks.example` stands for a public name (resolved here without DNS): the delivery
    connects to the address the check returned, and says the name in Host."""
    receiver = Receiver()
    port = receiver.server.server_address[1]
    monkeypatch.setattr(webhooks, "public_address", lambda host: "127.0.0.1")
    try:
        node.app_state.orchestrator.events.sinks[0].allow_private = False  # type: ignore
        register(node, f"http://hooks.example:{port}/hook", ["sandbox.lifecycle.created"])
        create(node)
        wait_for(lambda: len(receiver.requests) == 1, "the delivery")
        assert receiver.requests[0][0]["host"] == f"hooks.example:{port}"
    finally:
        receiver.close()


@pytest.mark.parametrize("url", [
    "http://[64:ff9b::a9fe:a9fe]/latest",  # NAT64 of 169.254.169.254
    "http://[64:ff9b::7f00:1]:6379/",  # NAT64 of 127.0.0.1 (a Redis)
    "http://[2002:a00:1::1]/",  # 6to4 of 10.0.0.1
    "http://[64:ff9b:1::a00:1]/",  # a network's own NAT64 (RFC 8215)
    "http://[fec0::1]/",  # site-local
])
def test_ipv6_forms_of_private_addresses_are_refused_too(url: str) -> None:
    """Red team (2026-12-06): the check was `is_global`, which holds for these; behind an
    IPv6-only network's NAT64 the first is the cloud's metadata service. The registry client's
    guard (registry/client.py address_problem) now judges both."""
    with pytest.raises(BadRequest, match="non-public"):
        check_destination(url, allow_private=False)


def test_the_collectors_long_poll_answers_as_soon_as_an_event_is_stored(tmp_path: Path) -> None:
    """`/cluster/events?wait=` (the gateway's collector, control/gateway/events.py): with no
    event after `after` it waits, and answers with the next event once the node stores it,
    long before the wait is over; with none it answers empty when the wait is over."""
    secret = "node-key-for-tests"
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process",
                                 node_key=secret))
    collector = {NODE_KEY_HEADER.decode(): secret}
    with TestClient(app) as client:
        last = client.get("/cluster/events", headers=collector).json()["last"]
        began = time.monotonic()
        empty = client.get("/cluster/events", params={"after": last, "wait": 1},
                           headers=collector)
        assert empty.status_code == 200 and empty.json()["events"] == []
        assert time.monotonic() - began >= 0.9  # it waited
        answer: dict[str, Any] = {}

        def poll() -> None:
            began = time.monotonic()
            got = client.get("/cluster/events", params={"after": last, "wait": 30},
                             headers=collector)
            answer.update(got.json(), took=time.monotonic() - began)

        waiting = threading.Thread(target=poll)
        waiting.start()
        time.sleep(0.5)  # the poll is waiting (if it answered already, it answered nothing)
        created = client.post("/v2/sandboxes", json={"templateID": "base"}, headers={
            **collector, TEAM_HEADER.decode(): "team-a"})
        assert created.status_code == 201, created.text
        waiting.join(40)
        assert [e["sandboxId"] for e in answer["events"]] == [created.json()["sandboxID"]]
        assert answer["took"] < 20  # the event answered it, not the end of the wait
        assert client.get("/cluster/events", params={"wait": 31},
                          headers=collector).status_code == 400
        client.delete(f"/sandboxes/{created.json()['sandboxID']}", headers={
            **collector, TEAM_HEADER.decode(): "team-a"})
