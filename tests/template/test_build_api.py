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


def _wait_built(client: TestClient, made: dict) -> dict:
    status_url = f"/templates/{made['templateID']}/builds/{made['buildID']}/status"
    status: dict = {}
    for _ in range(240):
        status = client.get(status_url).json()
        if status["status"] != "building":
            break
        time.sleep(0.5)
    return status


def test_cold_memory_setting_of_a_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`coldMemory` of the create request: checked (4xx naming the field), handed to the build
    VM's envd before the steps (an envd that is no VM answers 501: the build logs it and goes
    on), kept in the build's context, and kept by a rebuild that names none. A template built
    from it inherits it, as its user and env. The guest side is tests/runtime/test_cold_memory.py."""
    monkeypatch.setenv("AENV_RECLAIM_MIN_AGE_SECONDS", "45")
    state = tmp_path / "state"
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    key = (state / "secrets" / "api-key").read_text().strip()
    builds = state / "template-builds"
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        for bad in ({"minAgeSeconds": 0}, {"reclaim": "no"}, {"sampleMs": 100, "aggregationMs": 10},
                    {"watermarks": {"high": 1, "mid": 2, "low": 0}}, {"nope": 1}):
            refused = client.post("/v3/templates", json={"name": "cold", "coldMemory": bad})
            assert 400 <= refused.status_code < 500, (bad, refused.text)
            assert "coldMemory" in refused.text, refused.text

        def build(name: str, body: dict, parent: str = "base") -> dict:
            made = client.post("/v3/templates", json={"name": name, **body}).json()
            started = client.post(f"/v2/templates/{made['templateID']}/builds/{made['buildID']}",
                                  json={"fromTemplate": parent,
                                        "steps": [{"type": "RUN", "args": ["true"]}]})
            assert started.status_code == 202, started.text
            status = _wait_built(client, made)
            assert status["status"] == "ready", status
            record = json.loads((builds / f"{made['buildID']}.json").read_text())
            messages = [e["message"] for e in status["logEntries"]]
            assert any("cold memory stays in the guest" in m for m in messages), messages
            return record["context"]["coldMemory"]

        assert build("cold", {"coldMemory": {"reclaim": False}})["reclaim"] is False
        assert build("cold", {})["reclaim"] is False  # a rebuild keeps the template's setting
        assert build("cold-child", {}, parent="cold")["reclaim"] is False  # inherited
        # none named anywhere: the node's (AENV_RECLAIM_MIN_AGE_SECONDS)
        default = build("warm", {})
        assert default["reclaim"] is True and default["minAgeSeconds"] == 45


def test_the_nodes_cold_memory_default() -> None:
    from agentenv.node.base_template import default_cold_memory

    assert default_cold_memory({}).minAgeSeconds == 30
    assert default_cold_memory({"AENV_RECLAIM_MIN_AGE_SECONDS": "0"}).reclaim is False
    for bad in ("soon", "-5", "1"):  # 1 s: shorter than one of DAMON's aggregation intervals
        with pytest.raises(ValueError, match="AENV_RECLAIM_MIN_AGE_SECONDS"):
            default_cold_memory({"AENV_RECLAIM_MIN_AGE_SECONDS": bad})
