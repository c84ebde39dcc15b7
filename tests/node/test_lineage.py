"""Lineage on the process backend (fast; the VM backend's fork trees and GC are in
test_rl_lifecycle.py): every sandbox records the sandbox and the snapshot it came from,
GET /sandboxes/{id} and the list show them as extra fields the official SDK ignores, and
GET /sandboxes/{id}/children and GET /snapshots/{id}/children list what was made."""

from __future__ import annotations

import contextlib
from typing import Any

from .conftest import NodeProcess


def _ids(items: list[dict[str, Any]]) -> set[str]:
    return {item["sandboxID"] for item in items}


def test_lineage_of_creates_forks_and_snapshot_sandboxes(node: NodeProcess) -> None:
    made: list[str] = []
    with node.client() as api:
        try:
            root = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
            assert root.status_code == 201, root.text
            rid = root.json()["sandboxID"]
            made.append(rid)
            detail = api.get(f"/sandboxes/{rid}").json()
            assert detail["parentSandboxID"] is None and detail["sourceSnapshotID"] is None

            forked = api.post(f"/sandboxes/{rid}/fork", json={"count": 2, "timeout": 120})
            assert forked.status_code == 201, forked.text
            kids = [r["sandbox"]["sandboxID"] for r in forked.json()]
            made.extend(kids)
            for kid in kids:
                info = api.get(f"/sandboxes/{kid}").json()
                assert info["parentSandboxID"] == rid and info["sourceSnapshotID"] is None
            assert _ids(api.get(f"/sandboxes/{rid}/children").json()) == set(kids)
            assert api.get(f"/sandboxes/{kids[0]}/children").json() == []

            snap = api.post(f"/sandboxes/{kids[0]}/snapshots", json={}).json()["snapshotID"]
            grand = api.post("/v2/sandboxes", json={"templateID": snap, "timeout": 120})
            assert grand.status_code == 201, grand.text
            gid = grand.json()["sandboxID"]
            made.append(gid)
            listed = {s["sandboxID"]: s for s in api.get("/v2/sandboxes").json()}
            assert listed[gid]["parentSandboxID"] == kids[0]
            assert listed[gid]["sourceSnapshotID"] == snap
            assert listed[kids[1]]["parentSandboxID"] == rid
            assert _ids(api.get(f"/sandboxes/{kids[0]}/children").json()) == {gid}
            assert _ids(api.get(f"/snapshots/{snap}/children").json()) == {gid}
            assert api.get("/snapshots/nope/children").status_code == 404
            assert api.get("/sandboxes/nope/children").status_code == 404

            # A child outlives its parent and still names it; the parent's list drops the dead.
            assert api.delete(f"/sandboxes/{kids[0]}").status_code == 204
            assert api.get(f"/sandboxes/{gid}").json()["parentSandboxID"] == kids[0]
            assert _ids(api.get(f"/sandboxes/{rid}/children").json()) == {kids[1]}
            assert api.delete(f"/templates/{snap}").status_code == 204
        finally:
            for sid in made:
                with contextlib.suppress(Exception):
                    api.delete(f"/sandboxes/{sid}")


def test_the_sdk_reads_sandboxes_with_lineage_fields(sdk_env: NodeProcess) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState

    parent = Sandbox.create(template="base", timeout=120)
    try:
        children = [c for c in parent.fork(count=1, timeout=120) if isinstance(c, Sandbox)]
        assert len(children) == 1
        info = children[0].get_info()
        assert info.state == SandboxState.RUNNING
        listed = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
        assert {parent.sandbox_id, children[0].sandbox_id} <= {s.sandbox_id for s in listed}
        children[0].kill()
    finally:
        parent.kill()
