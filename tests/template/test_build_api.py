"""The template build routes in-process on the process backend (no VM; it builds from another
template only): what they refuse, and what a node restart does to a build that was running."""

from __future__ import annotations

import json
import time
import uuid
import warnings
from pathlib import Path

import pytest

from agentenv.node.server import ServeOptions, build_app

with warnings.catch_warnings():  # starlette 1.x nags about httpx here; TestClient still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient


def test_image_builds_need_the_vm_backend_and_restarts_fail_running_builds(tmp_path: Path) -> None:
    state = tmp_path / "state"
    build_id = str(uuid.uuid4())
    (state / "template-builds").mkdir(parents=True)
    now = time.time()
    # A build the previous run of the node was in the middle of.
    (state / "template-builds" / f"{build_id}.json").write_text(json.dumps({
        "template_id": "tinterrupted", "build_id": build_id, "name": "interrupted",
        "cpu_count": 1, "memory_mb": 512, "status": "building", "created_at": now,
        "updated_at": now, "logs": [{"timestamp": now, "level": "info", "message": "RUN x",
                                     "step": "1"}]}))
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    key = (state / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        made = client.post("/v3/templates", json={"name": "anything"})
        assert made.status_code == 202, made.text
        template_id, image_build = made.json()["templateID"], made.json()["buildID"]
        refused = client.post(f"/v2/templates/{template_id}/builds/{image_build}",
                              json={"fromImage": "debian:bookworm", "steps": []})
        assert refused.status_code == 400 and "VM backend" in refused.json()["message"]
        unnamed = client.post("/v3/templates", json={})
        assert unnamed.status_code == 400 and "name is required" in unnamed.json()["message"]
        assert client.post("/v3/templates", json={"name": 7}).status_code == 422
        # The deprecated `alias` spelling of the name is read too.
        assert client.get("/templates/aliases/a").status_code == 404
        assert client.post("/v3/templates", json={"alias": "a"}).status_code == 202
        assert client.get("/templates/aliases/a").status_code != 404

        status = client.get(f"/templates/tinterrupted/builds/{build_id}/status").json()
        assert status["status"] == "error"
        assert "node stopped" in status["reason"]["message"]
        assert [e["message"] for e in status["logEntries"]] == ["RUN x"]
        assert status["logEntries"][0]["step"] == "1" and status["logs"][0].endswith("RUN x")
        assert client.get(f"/templates/tinterrupted/builds/{build_id}/status",
                          params={"logsOffset": 1}).json()["logEntries"] == []
        assert client.get(f"/templates/other/builds/{build_id}/status").status_code == 404
        assert client.get(f"/templates/tinterrupted/builds/{build_id}/status",
                          params={"logsOffset": "x"}).status_code == 400

        listed = {t["templateID"]: t for t in client.get("/templates").json()}
        assert listed["tinterrupted"]["buildStatus"] == "error"
        assert listed["base"]["buildStatus"] == "ready"
        assert client.get("/templates/interrupted").json()["builds"][0]["status"] == "error"
        assert client.get("/templates/aliases/interrupted").status_code == 404
        assert client.delete("/templates/base").status_code == 400  # built in

        # The upload URL needs its signature, not the API key; a forged one is refused.
        plain = client.put("/template-files/tinterrupted/abc?expires=9999999999&signature=00",
                           content=b"x", headers={"X-API-KEY": ""})
        assert plain.status_code == 403 and plain.json()["code"] == 403

        assert client.delete("/templates/interrupted").status_code == 204
        assert client.get(f"/templates/tinterrupted/builds/{build_id}/status").status_code == 404
        assert not (state / "template-builds" / f"{build_id}.json").exists()


def test_a_build_past_its_deadline_fails_and_its_sandbox_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AENV_BUILD_TIMEOUT_SECONDS bounds a whole build: the guest is the team's, and a build
    holds its VM until it ends (a RUN step's own timeout is an hour)."""
    monkeypatch.setenv("AENV_BUILD_TIMEOUT_SECONDS", "3")
    state = tmp_path / "state"
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    key = (state / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        made = client.post("/v3/templates", json={"name": "endless"}).json()
        status_url = f"/templates/{made['templateID']}/builds/{made['buildID']}/status"
        started = client.post(f"/v2/templates/{made['templateID']}/builds/{made['buildID']}",
                              json={"fromTemplate": "base",
                                    "steps": [{"type": "RUN", "args": ["sleep 100000"]}]})
        assert started.status_code == 202, started.text
        status: dict = {}
        for _ in range(120):  # a bound for the old code, which never ends the build
            status = client.get(status_url).json()
            if status["status"] != "building":
                break
            time.sleep(0.5)
        assert status["status"] == "error", status
        assert "AENV_BUILD_TIMEOUT_SECONDS" in status["reason"]["message"]
        # The build's sandbox (its envd and the `sleep`) was killed and its files removed.
        assert list((state / "process-backend" / "sandboxes").glob("b*")) == []
