"""A shared cluster's limits and per-team uploads, through the real gateway, scheduler, Redis
and a process-backend node (control/gateway/limits.py, node/template_files.py):

- team quotas over the cluster: the N+1th sandbox (create or fork), template or snapshot of a
  team is a 429 naming its limit, another team is not affected, and room comes back once a
  sandbox is gone; a burst of concurrent creates gets exactly the quota;
- the signed-URL owner lookup (unauthenticated, asks every node) is rate limited per client
  address, a URL whose owner is cached is not;
- a file one team uploads under the hash of another team's COPY is not what the other team's
  build uses."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.template.utils import calculate_files_hash

from tests.control.cluster import LocalCluster
from tests.control.helpers import wait_for
from tests.node.conftest import environ_set
from tests.node.test_template_uploads import tar_of

pytestmark = pytest.mark.timeout(300)

QUOTAS = {"AENV_TEAM_MAX_SANDBOXES": "2", "AENV_TEAM_MAX_TEMPLATES": "2",
          "AENV_TEAM_MAX_SNAPSHOTS": "1",
          # one token per 1000 s: the bucket does not refill during the test
          "AENV_SIGNED_LOOKUP_RATE": "0.001", "AENV_SIGNED_LOOKUP_BURST": "3"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    made = LocalCluster(tmp_path_factory.mktemp("limits"), nodes=1,
                        node_env={"AENV_NODE_VCPUS": "64", "AENV_MEMORY_BUDGET_MB": "100000"})
    made.gateway.env = {**made.gateway.env, **QUOTAS}
    try:
        made.start()
        for team in ("quota", "other", "planter", "victim", "signer", "burst"):
            made.team(team)
        yield made
    finally:
        made.stop()


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
