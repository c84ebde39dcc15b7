"""Batch creates on the process backend (fast; the VM backend's are in test_rl_lifecycle.py):
`POST /snapshots/{id}/fork` and `count` on create answer a SandboxForkResult per sandbox, each
made or refused on its own; past an admission limit the rest get its 429 and nothing of them
exists; when none fits the call itself is that 429. A backend without snapshot branching (the
process one) refuses to fork a paused sandbox or roll one back, naming the VM backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from .conftest import NodeProcess

LIMIT = 4


@pytest.fixture(scope="module")
def small_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A process node that runs at most LIMIT sandboxes."""
    base = tmp_path_factory.mktemp("batch")
    node = NodeProcess(base / "state", base / "node.log",
                       extra_env={"AENV_MAX_SANDBOXES": str(LIMIT)})
    node.start()
    yield node
    node.cleanup()


def _sandbox_dirs(node: NodeProcess) -> set[str]:
    root = node.state_dir / "process-backend" / "sandboxes"
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def test_batch_from_a_snapshot_is_bounded_by_admission(small_node: NodeProcess) -> None:
    with small_node.client() as api:
        src = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()
        sid = src["sandboxID"]
        made: list[str] = [sid]
        try:
            snap = api.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"]
            assert api.post(f"/snapshots/{snap}/fork", json={"count": 101}).status_code == 400
            assert api.post("/snapshots/nope/fork", json={"count": 1}).status_code == 404

            answer = api.post(f"/snapshots/{snap}/fork", json={"count": 5, "timeout": 120})
            assert answer.status_code == 201, answer.text
            results = answer.json()
            assert len(results) == 5
            ok = [r["sandbox"]["sandboxID"] for r in results if "sandbox" in r]
            refused = [r["error"] for r in results if "error" in r]
            made.extend(ok)
            assert len(ok) == LIMIT - 1  # the source runs too
            assert all(e["code"] == 429 and "AENV_MAX_SANDBOXES" in e["message"]
                       for e in refused), refused
            # Nothing half-made: the node knows, and the backend holds, exactly these.
            listed = {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}
            assert listed == set(made)
            assert _sandbox_dirs(small_node) == set(made)
            for child in ok:
                detail = api.get(f"/sandboxes/{child}").json()
                assert detail["sourceSnapshotID"] == snap and detail["parentSandboxID"] == sid
            assert {s["sandboxID"] for s in api.get(f"/snapshots/{snap}/children").json()
                    } == set(ok)

            full = api.post(f"/snapshots/{snap}/fork", json={"count": 2})
            assert full.status_code == 429, full.text
            assert "AENV_MAX_SANDBOXES" in full.json()["message"]
            assert _sandbox_dirs(small_node) == set(made)
        finally:
            for one in made:
                with contextlib.suppress(Exception):
                    api.delete(f"/sandboxes/{one}")


def test_count_on_create_answers_a_result_per_sandbox(small_node: NodeProcess) -> None:
    with small_node.client() as api:
        answer = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60,
                                                 "count": 2})
        assert answer.status_code == 201, answer.text
        ids = [r["sandbox"]["sandboxID"] for r in answer.json()]
        try:
            assert len(set(ids)) == 2
            assert api.post("/v2/sandboxes", json={"templateID": "nope", "count": 2}
                            ).status_code == 404
            keyed = api.post("/v2/sandboxes", json={"templateID": "base", "count": 2},
                             headers={"Idempotency-Key": "k1"})
            assert keyed.status_code == 400
        finally:
            for one in ids:
                api.delete(f"/sandboxes/{one}")


def test_process_backend_refuses_paused_fork_and_rollback(small_node: NodeProcess) -> None:
    with small_node.client() as api:
        sid = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}
                       ).json()["sandboxID"]
        try:
            rollback = api.post(f"/sandboxes/{sid}/rollback", json={})
            assert rollback.status_code == 400 and "VM backend" in rollback.json()["message"]
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
            forked = api.post(f"/sandboxes/{sid}/fork", json={"count": 1})
            assert forked.status_code == 400 and "VM backend" in forked.json()["message"]
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
        finally:
            api.delete(f"/sandboxes/{sid}")
