"""One team cannot take every place of the gateway (found by the red team): its requests in
progress are capped at its share (AENV_TEAM_MAX_CONCURRENT_REQUESTS) below the gateway's cap,
and a control request's body must arrive within AENV_CONTROL_BODY_SECONDS. So unfinished bodies
of one team get that team 429s and end, while another team is served. The caps are lowered
here so the test opens a few sockets, not thousands; the mechanism is the same."""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.control.cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)

CAP, SHARE = 6, 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    made = LocalCluster(tmp_path_factory.mktemp("shares"), nodes=1)
    made.gateway.env = {**made.gateway.env, "AENV_MAX_CONCURRENT_REQUESTS": str(CAP),
                        "AENV_TEAM_MAX_CONCURRENT_REQUESTS": str(SHARE),
                        "AENV_CONTROL_BODY_SECONDS": "10"}
    try:
        made.start()
        made.team("attacker")
        made.team("victim")
        yield made
    finally:
        made.stop()


def _held_create(cluster: LocalCluster, key: str) -> socket.socket:
    """A `POST /sandboxes` whose body never finishes."""
    sock = socket.create_connection(("127.0.0.1", cluster.gateway.port))
    sock.sendall(b"POST /sandboxes HTTP/1.1\r\nHost: gw\r\nX-API-KEY: " + key.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
    return sock


def _answer(sock: socket.socket, timeout: float) -> bytes:
    """The gateway's answer (a JSON body ends in '}'), or what came before the timeout."""
    sock.settimeout(timeout)
    got = b""
    try:
        while not got.endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
    except TimeoutError:
        pass
    return got


def _first_answers(socks: list[socket.socket], count: int) -> dict[socket.socket, bytes]:
    """The answers of the first `count` of `socks` to be answered (the others keep waiting)."""
    answered: dict[socket.socket, bytes] = {}
    while len(answered) < count:
        ready, _, _ = select.select([s for s in socks if s not in answered], [], [], 60)
        assert ready, f"only {len(answered)} of {count} requests were answered"
        for sock in ready:
            answered[sock] = _answer(sock, 10)
    return answered


def test_a_team_past_its_share_gets_429_and_others_are_served(cluster: LocalCluster) -> None:
    held = [_held_create(cluster, cluster.keys["attacker"]) for _ in range(CAP)]
    answered: dict[socket.socket, bytes] = {}
    try:
        # the attacker's places past its share are refused at once (whichever of its requests
        # the gateway read last: they arrive together)
        answered = _first_answers(held, CAP - SHARE)
        assert all(a.startswith(b"HTTP/1.1 429") for a in answered.values()), answered
        assert all(b"AENV_TEAM_MAX_CONCURRENT_REQUESTS" in a for a in answered.values())
        waiting = [sock for sock in held if sock not in answered]
        with httpx.Client(base_url=cluster.url, trust_env=False, timeout=10,
                          headers={"X-API-KEY": cluster.keys["victim"]}) as victim:
            statuses = [victim.get("/sandboxes").status_code for _ in range(5)]
        assert statuses == [200] * 5
        # and the held ones end with 408 when their body is not there in time
        timed_out = [_answer(sock, 60) for sock in waiting]
        assert all(a.startswith(b"HTTP/1.1 408") for a in timed_out), timed_out
    finally:
        for sock in held:
            sock.close()
    # the attacker's share is free again
    with httpx.Client(base_url=cluster.url, trust_env=False, timeout=10,
                      headers={"X-API-KEY": cluster.keys["attacker"]}) as attacker:
        assert attacker.get("/sandboxes").status_code == 200


#: the stranger's own address (the team's clients come from 127.0.0.1)
STRANGER = "127.0.0.2"


def _held_traffic(cluster: LocalCluster, sandbox_id: str) -> socket.socket:
    """An upload to a sandbox's envd, with no key (sandbox traffic needs none at the
    gateway), whose body never finishes."""
    sock = socket.create_connection(("127.0.0.1", cluster.gateway.port),
                                    source_address=(STRANGER, 0))
    sock.sendall(b"POST /files?path=/tmp/x HTTP/1.1\r\nHost: gw\r\nE2b-Sandbox-Id: "
                 + sandbox_id.encode() + b"\r\nE2b-Sandbox-Port: 49983\r\n"
                 b"Content-Type: application/octet-stream\r\nContent-Length: 100000\r\n\r\nx")
    return sock


def test_a_strangers_traffic_to_a_teams_sandbox_does_not_take_its_control_share(
        cluster: LocalCluster) -> None:
    """Found by the red team: traffic to a sandbox was charged to its team's share, so a
    stranger with a sandbox id and slow bodies made every control request of the team 429;
    then, with a traffic share per team, every request of the team's own clients to its
    sandboxes. The stranger fills only its own share."""
    key = {"X-API-KEY": cluster.keys["victim"]}
    with httpx.Client(base_url=cluster.url, trust_env=False, timeout=60, headers=key) as victim:
        made = victim.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
        assert made.status_code == 201, made.text
        sandbox_id = made.json()["sandboxID"]
        held = [_held_traffic(cluster, sandbox_id) for _ in range(SHARE + 1)]
        try:
            # one past the traffic share is refused: the others hold its places now
            (refused,) = _first_answers(held, 1).values()
            assert refused.startswith(b"HTTP/1.1 429"), refused
            assert victim.get("/sandboxes").status_code == 200
            assert victim.get(f"/sandboxes/{sandbox_id}").status_code == 200
            own = victim.get("/health", headers={"E2b-Sandbox-Id": sandbox_id,
                                                 "E2b-Sandbox-Port": "49983"})
            assert own.status_code in (200, 204), own.text
        finally:
            for sock in held:
                sock.close()
            victim.delete(f"/sandboxes/{sandbox_id}")
