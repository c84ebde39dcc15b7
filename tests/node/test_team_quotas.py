"""Team quotas on a standalone node (node/admission.py): the N+1th sandbox, template or
snapshot of the node's team is refused with a 429 that names the limit and its setting;
nothing is made for it, and room comes back once one is gone; a burst of concurrent snapshots
gets exactly the quota."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agentenv.node.server import ServeOptions, build_app

with warnings.catch_warnings():  # starlette 1.x nags about httpx here; TestClient still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("AENV_TEAM_MAX_SANDBOXES", "2")
    monkeypatch.setenv("AENV_TEAM_MAX_TEMPLATES", "1")
    monkeypatch.setenv("AENV_TEAM_MAX_SNAPSHOTS", "1")
    state = tmp_path / "state"
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    key = (state / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as made:
        yield made


def _refused(answer: object, setting: str) -> None:
    assert answer.status_code == 429, answer.text  # type: ignore[attr-defined]
    body = answer.json()  # type: ignore[attr-defined]
    assert body["code"] == 429 and setting in body["message"], body
    assert "team quota reached" in body["message"]


def test_the_n_plus_first_of_each_is_refused_naming_its_limit(client: TestClient) -> None:
    made = []
    for _ in range(2):
        answer = client.post("/sandboxes", json={"templateID": "base", "timeout": 60})
        assert answer.status_code == 201, answer.text
        made.append(answer.json()["sandboxID"])
    _refused(client.post("/sandboxes", json={"templateID": "base"}), "AENV_TEAM_MAX_SANDBOXES")
    assert len(client.get("/sandboxes").json()) == 2  # nothing made for the refused one

    snap = client.post(f"/sandboxes/{made[0]}/snapshots", json={})
    assert snap.status_code == 201, snap.text
    _refused(client.post(f"/sandboxes/{made[1]}/snapshots", json={}), "AENV_TEAM_MAX_SNAPSHOTS")

    assert client.delete(f"/sandboxes/{made[1]}").status_code == 204
    again = client.post("/sandboxes", json={"templateID": "base", "timeout": 60})
    assert again.status_code == 201, again.text  # room again once one ended

    assert client.post("/v3/templates", json={"name": "first"}).status_code == 202
    assert client.post("/v3/templates", json={"name": "first"}).status_code == 202  # a rebuild
    _refused(client.post("/v3/templates", json={"name": "second"}), "AENV_TEAM_MAX_TEMPLATES")


def test_concurrent_snapshots_get_exactly_the_quota(client: TestClient) -> None:
    """A snapshot takes long before the catalogue counts it: the place is held from the
    request on, so a burst of N against a quota of 1 makes exactly one."""
    sid = client.post("/sandboxes", json={"templateID": "base", "timeout": 60}).json()["sandboxID"]
    start = threading.Barrier(5)

    def snapshot(_: int) -> object:
        start.wait()
        return client.post(f"/sandboxes/{sid}/snapshots", json={})

    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(snapshot, range(5)))
    assert sorted(a.status_code for a in answers) == [201, 429, 429, 429, 429], [
        a.text for a in answers]
    for answer in answers:
        if answer.status_code == 429:
            _refused(answer, "AENV_TEAM_MAX_SNAPSHOTS")
    assert len(client.get("/snapshots").json()) == 1


def test_a_cluster_node_refusal_shows_no_other_teams_load(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of a cluster serves several teams: its refusals name the limit and its setting,
    not its figures (sandboxes running, memory in use: every team's load)."""
    monkeypatch.setenv("AENV_MAX_SANDBOXES", "1")
    secret = "5e" * 32  # a cluster node's key
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process",
                                 node_key=secret))
    with TestClient(app, headers={"x-agentenv-node-key": secret}) as node:
        made = node.post("/sandboxes", json={"templateID": "base", "timeout": 60},
                         headers={"x-agentenv-team": "alpha"})
        assert made.status_code == 201, made.text
        refused = node.post("/sandboxes", json={"templateID": "base", "timeout": 60},
                            headers={"x-agentenv-team": "beta"})
        assert refused.status_code == 429, refused.text
        message = refused.json()["message"]
        assert "sandbox limit reached" in message and "AENV_MAX_SANDBOXES" in message
        assert "1 of 1" not in message and "running" not in message, message
