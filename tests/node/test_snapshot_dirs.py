"""A shared-directory snapshot repository (`dir://PATH`) is a path on the node, open to
whoever names it: a team of a cluster may neither pull another team's snapshots from one nor
write into the node's filesystem by pushing to one. The standalone node's own team may."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from agentenv.node.server import ServeOptions, build_app

CLUSTER_SECRET = "0c" * 32  # the node key of a cluster node


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process",
                                 node_key=CLUSTER_SECRET))
    with TestClient(app) as made:
        yield made


@pytest.mark.parametrize("ref", ["dir:///srv/shared/snapshots/one", "/srv/shared/one"])
def test_a_cluster_team_gets_no_shared_directory_repository(client: TestClient, ref: str) -> None:
    team = {"x-agentenv-node-key": CLUSTER_SECRET, "x-agentenv-team": "team-b"}
    for route, body in (("/aenv/snapshots/pull", {"ref": ref}),
                        ("/aenv/snapshots/push", {"snapshot": "base", "ref": ref})):
        answer = client.post(route, json=body, headers=team)
        assert answer.status_code == 400, answer.text
        assert "shared-directory repositories are not open" in answer.json()["message"]
