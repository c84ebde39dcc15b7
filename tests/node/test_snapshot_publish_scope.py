"""Published snapshots are per team (node/snapshot_api.py, AENV_SNAPSHOT_PUBLISH): a template
build is published to `PREFIX/<team>/<name>`, so two teams' templates of one name publish to
two repositories; under PREFIX a team pushes to and pulls from its own part only. A node of a
cluster (the gateway names the team), in process, and a real registry on loopback: another
team's published repository is never asked for anything."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.node.server import ServeOptions, build_app
from agentenv.node.snapshot_api import published_ref
from tests.node.test_template_uploads import tar_of
from tests.template import helpers
from tests.template.conftest import Registry

with warnings.catch_warnings():  # starlette 1.x nags about httpx here; TestClient still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

SECRET = "5e" * 32  # the node key of a cluster node


def test_two_teams_templates_of_one_name_publish_to_two_repositories() -> None:
    for prefix, tag in (("127.0.0.1:5000/published", ":"), ("dir:///srv/snapshots", "-")):
        alpha = published_ref(prefix, "alpha", "same", "b1")
        beta = published_ref(prefix, "beta", "same", "b1")
        assert alpha == f"{prefix}/alpha/same{tag}b1" and beta == f"{prefix}/beta/same{tag}b1"


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: Registry
         ) -> Iterator[TestClient]:
    monkeypatch.setenv("AENV_SNAPSHOT_PUBLISH", f"{registry.host}/published")
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process",
                                 node_key=SECRET))
    with TestClient(app, headers={"x-agentenv-node-key": SECRET}) as client:
        yield client


def test_a_team_cannot_pull_or_overwrite_another_teams_published_snapshot(
        node: TestClient, registry: Registry) -> None:
    built = helpers.build_image([tar_of("note.txt", b"alpha\n")])
    registry.push("published/alpha/same", "b1", built)  # alpha's published build
    mark = registry.log_mark()
    beta = {"x-agentenv-team": "beta"}
    for ref in (f"{registry.host}/published/alpha/same:b1",
                f"oci://{registry.host}/Published/alpha/same:b1",
                f"{registry.host}/published/same:b1"):  # the old, team-less naming
        pulled = node.post("/aenv/snapshots/pull", json={"ref": ref}, headers=beta)
        assert pulled.status_code == 404, pulled.text
        assert "AENV_SNAPSHOT_PUBLISH" in pulled.json()["message"], pulled.text
        pushed = node.post("/aenv/snapshots/push", json={"snapshot": "base", "ref": ref},
                           headers=beta)
        assert pushed.status_code == 400, pushed.text
        assert "published/beta/" in pushed.json()["message"], pushed.text
    assert not [r for r in registry.requests_since(mark) if "/published/" in r]
    # the team's own part of PREFIX, and any other repository, are the team's to use (this
    # node's process backend moves no snapshots: the refusal that follows is that one)
    for ref in (f"{registry.host}/published/beta/same:b1", f"{registry.host}/elsewhere:x"):
        own = node.post("/aenv/snapshots/pull", json={"ref": ref}, headers=beta)
        assert own.status_code == 400 and "VM backend" in own.json()["message"], own.text
