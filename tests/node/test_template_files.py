"""`template-files` uploads: refused up front (507) when the disk cannot take them, nothing
half-written left; garbage-collected once no build needs them (node/gc.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from agentenv.api.template_models import UPLOAD_PREFIX
from agentenv.api.tenancy import LOCAL_TEAM
from agentenv.node.server import ServeOptions, build_app
from agentenv.node.template_api import TemplateBuildApi
from agentenv.node.template_files import team_dir


def _builds_api(app: object) -> TemplateBuildApi:
    for route in app.api.routes:  # type: ignore[attr-defined]
        owner = getattr(route.endpoint, "__self__", None)
        if isinstance(owner, TemplateBuildApi):
            return owner
    raise AssertionError("no template build API in the app")


def _upload_url(api: TemplateBuildApi, files_hash: str) -> str:
    expires = int(time.time()) + 600
    return (f"{UPLOAD_PREFIX}t1/{files_hash}?expires={expires}&team={LOCAL_TEAM}"
            f"&signature={api.uploads.signature(LOCAL_TEAM, 't1', files_hash, expires)}")


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[TestClient, TemplateBuildApi, Path]]:
    state = tmp_path / "state"
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    key = (state / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        yield client, _builds_api(app), state


def test_uploads_are_refused_when_the_disk_cannot_take_them(
        node: tuple[TestClient, TemplateBuildApi, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    client, api, state = node
    files = team_dir(state / "template-files", LOCAL_TEAM)
    assert client.put(_upload_url(api, "small"), content=b"ok").status_code == 200
    assert (files / "small.new").read_bytes() == b"ok"  # not verified yet: no build named it
    # A reserve bigger than the disk: whatever is uploaded cannot fit.
    monkeypatch.setenv("AENV_DISK_RESERVE", str(1 << 60))
    declared = client.put(_upload_url(api, "big"), content=b"x" * 4096)
    assert declared.status_code == 507, declared.text
    assert "not enough free disk space" in declared.json()["message"]
    assert "AENV_DISK_RESERVE" in declared.json()["message"]

    def endless() -> Iterator[bytes]:  # no Content-Length: checked while it streams
        for _ in range(40):
            yield b"y" * (1 << 20)

    streamed = client.put(_upload_url(api, "big"), content=endless())
    assert streamed.status_code == 507, streamed.text
    assert "stopped, nothing of it kept" in streamed.json()["message"]
    assert sorted(p.name for p in files.iterdir()) == ["small.new"]  # nothing half-written


def test_uploads_no_build_needs_are_collected(node: tuple[TestClient, TemplateBuildApi, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    client, api, state = node
    gc = api.orchestrator.gc
    gc.grace_seconds = 0
    gc.files_ttl = 600
    files = team_dir(state / "template-files", LOCAL_TEAM)
    for name in ("used", "unused", "recent", "asked"):
        assert client.put(_upload_url(api, name), content=name.encode()).status_code == 200
    for name in ("used", "asked"):  # as a build's start makes them once it checked them
        os.replace(files / f"{name}.new", files / name)
    (files / ".unused.tmp123").write_bytes(b"half")  # a dead upload's temp file
    flat = state / "template-files" / "used"  # the layout before teams: no build reads it
    flat.write_bytes(b"old")
    old = time.time() - 3600
    os.utime(flat, (old, old))
    for name in ("used", "unused.new", "asked", ".unused.tmp123"):
        os.utime(files / name, (old, old))
    # A running build whose steps name "used".
    record = {"template_id": "t1", "build_id": "b1", "name": "n", "cpu_count": 1,
              "memory_mb": 512, "status": "building", "created_at": old, "updated_at": old,
              "request": {"fromImage": "x", "steps": [
                  {"type": "COPY", "args": ["a", "/a"], "filesHash": "used"}]}}
    (state / "template-builds").mkdir(exist_ok=True)
    (state / "template-builds" / "b1.json").write_text(json.dumps(record))
    # The SDK asking whether "asked" is there makes it fresh again (it will start a build).
    link = client.get("/templates/base/files/asked")
    assert link.status_code == 201 and link.json() == {"present": True}, link.text
    report = client.portal.call(gc.collect, "test")
    assert sorted(p.name for p in files.iterdir()) == ["asked", "recent.new", "used"]
    assert {Path(p).name for p in report.deleted} == {"unused.new", ".unused.tmp123", "used"}
    assert not flat.exists()
    # The build is over: its upload goes too, once old enough.
    record["status"] = "ready"
    (state / "template-builds" / "b1.json").write_text(json.dumps(record))
    client.portal.call(gc.collect, "test")
    assert sorted(p.name for p in files.iterdir()) == ["asked", "recent.new"]


def _upload_url_of(api: TemplateBuildApi, team: str, files_hash: str) -> str:
    expires = int(time.time()) + 600
    return (f"{UPLOAD_PREFIX}t1/{files_hash}?expires={expires}&team={team}"
            f"&signature={api.uploads.signature(team, 't1', files_hash, expires)}")


def test_a_teams_uploads_stay_within_its_budget(
        node: tuple[TestClient, TemplateBuildApi, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    client, api, state = node
    monkeypatch.setenv("AENV_TEAM_TEMPLATE_FILES_MB", "1")
    files = team_dir(state / "template-files", LOCAL_TEAM)
    assert client.put(_upload_url(api, "first"), content=b"a" * (600 << 10)).status_code == 200
    # A second hash past the budget: refused up front by its length...
    declared = client.put(_upload_url(api, "second"), content=b"b" * (600 << 10))
    assert declared.status_code == 429, declared.text
    assert "AENV_TEAM_TEMPLATE_FILES_MB" in declared.json()["message"]

    def endless() -> Iterator[bytes]:  # ...and without one, while it streams
        for _ in range(8):
            yield b"c" * (256 << 10)

    streamed = client.put(_upload_url(api, "second"), content=endless())
    assert streamed.status_code == 429, streamed.text
    assert sorted(p.name for p in files.iterdir()) == ["first.new"]  # nothing half-written
    # A new upload of the same hash replaces the old one: it fits again.
    assert client.put(_upload_url(api, "first"), content=b"d" * (700 << 10)).status_code == 200
    # Another team's budget is its own.
    other = client.put(_upload_url_of(api, "team-other", "second"), content=b"e" * (600 << 10))
    assert other.status_code == 200, other.text


def test_uploads_leave_what_creates_need_free(
        node: tuple[TestClient, TemplateBuildApi, Path]) -> None:
    client, api, state = node
    admission = api.orchestrator.admission
    assert admission is not None
    free_mb = os.statvfs(state).f_bavail * os.statvfs(state).f_frsize >> 20
    # The node admits creates only with this much free: an upload may not take it lower,
    # even though AENV_DISK_RESERVE (256 MiB) would let it.
    admission.min_free_disk_mb = free_mb + 1
    refused = client.put(_upload_url(api, "fill"), content=b"x" * 4096)
    assert refused.status_code == 507, refused.text
    assert "AENV_MIN_FREE_DISK_MB" in refused.json()["message"]


def test_finished_build_records_are_bounded_per_team(
        node: tuple[TestClient, TemplateBuildApi, Path]) -> None:
    from agentenv.node.build_records import KEEP_FINISHED_BUILDS

    client, api, state = node
    # Every request supersedes the one before (it fails, never started): records that would
    # pile up without end, each read on every later build request.
    for _ in range(KEEP_FINISHED_BUILDS + 10):
        made = client.post("/v3/templates", json={"name": "churn"})
        assert made.status_code == 202, made.text
    latest = made.json()["buildID"]
    assert len(api.records.builds) == KEEP_FINISHED_BUILDS + 1
    assert len(list((state / "template-builds").glob("*.json"))) == KEEP_FINISHED_BUILDS + 1
    assert api.records.builds[latest].status == "waiting"  # the one under way is kept
