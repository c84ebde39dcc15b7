"""Build uploads are checked against their hash and kept per team (node/template_files.py).

On a standalone node (process backend): the official SDK's Template.build with COPY steps
passes the check; a raw upload whose content is not what its hash names is refused with a 400
when the build is started and nothing of it is kept; a verified upload cannot be replaced. Per
team (the node's app records the team of a request in the ASGI scope, node/tenancy.py): one
team's upload is not `present` for another, nor used by its build."""

from __future__ import annotations

import io
import tarfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from e2b import Sandbox, Template
from e2b.template.utils import calculate_files_hash

from agentenv.api import tenancy
from agentenv.node.server import ServeOptions, build_app
from tests.node.conftest import NodeProcess, sdk_pointed_at

with warnings.catch_warnings():  # starlette 1.x nags about httpx here; TestClient still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

pytestmark = pytest.mark.timeout(300)


def _context(tmp: Path, text: str) -> tuple[Path, str]:
    """A build context with one file, and the SDK's hash of `COPY note.txt /tmp/note.txt`."""
    ctx = tmp / f"ctx-{uuid.uuid4().hex[:6]}"
    ctx.mkdir()
    (ctx / "note.txt").write_text(text)
    return ctx, calculate_files_hash("note.txt", "/tmp/note.txt", str(ctx), [], False, None)


def tar_of(name: str, content: bytes) -> bytes:
    """A gzipped tar of one file, as the SDK uploads a COPY step's files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(content), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def _copy_step(files_hash: str) -> dict[str, Any]:
    return {"type": "COPY", "args": ["note.txt", "/tmp/note.txt", "", ""], "filesHash": files_hash}


def _wait_build(client: Any, template_id: str, build_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        status = client.get(f"/templates/{template_id}/builds/{build_id}/status").json()
        if status["status"] in ("ready", "error"):
            return status
        time.sleep(0.2)
    raise AssertionError(f"build {build_id} did not finish")


def test_sdk_builds_pass_and_wrong_content_is_refused_with_nothing_kept(
        make_node: Any, tmp_path: Path) -> None:
    node: NodeProcess = make_node()
    ctx, files_hash = _context(tmp_path, "the real note\n")
    with sdk_pointed_at(node):
        built = Template.build(Template(file_context_path=str(ctx)).from_template("base")
                               .copy("note.txt", "/tmp/note.txt"), f"sdk-{uuid.uuid4().hex[:6]}",
                               cpu_count=1, memory_mb=512, skip_cache=True)
        sbx = Sandbox.create(template=built.template_id, timeout=60)
        try:
            assert sbx.files.read("/tmp/note.txt") == "the real note\n"
        finally:
            sbx.kill()

    with node.client() as api, node.client(key="") as plain:
        made = api.post("/v3/templates", json={"name": f"raw-{uuid.uuid4().hex[:6]}"}).json()
        tid, bid = made["templateID"], made["buildID"]
        other_ctx, other_hash = _context(tmp_path, "something else\n")
        link = api.get(f"/templates/{tid}/files/{other_hash}")
        assert link.status_code == 201 and link.json()["present"] is False
        # content that is a fine archive, but not the one the hash names
        url = urlsplit(link.json()["url"])
        target = f"{url.path}?{url.query}"
        assert plain.put(target, content=tar_of("note.txt", b"planted\n")).status_code == 200
        start = f"/v2/templates/{tid}/builds/{bid}"
        refused = api.post(start, json={"fromTemplate": "base", "steps": [_copy_step(other_hash)]})
        assert refused.status_code == 400, refused.text
        assert "do not match their hash" in refused.json()["message"]
        assert api.get(f"/templates/{tid}/files/{other_hash}").json()["present"] is False
        from agentenv.node.template_files import team_dir  # (main has no such module)

        local = team_dir(node.state_dir / "template-files", tenancy.LOCAL_TEAM)
        assert not [p.name for p in local.iterdir() if p.name.startswith(other_hash)]
        # not a tar at all: the same 400
        assert plain.put(target, content=b"not a tar").status_code == 200
        garbage = api.post(start, json={"fromTemplate": "base", "steps": [_copy_step(other_hash)]})
        assert garbage.status_code == 400 and "not a readable tar" in garbage.json()["message"]

        # the right content passes; once verified, a re-upload cannot replace it
        right = (other_ctx / "note.txt").read_bytes()
        assert plain.put(target, content=tar_of("note.txt", right)).status_code == 200
        accepted = api.post(start, json={"fromTemplate": "base",
                                         "steps": [_copy_step(other_hash)]})
        assert accepted.status_code == 202, accepted.text
        assert plain.put(target, content=tar_of("note.txt", b"planted\n")).status_code == 200
        assert (local / other_hash).read_bytes() != tar_of("note.txt", b"planted\n")
        assert _wait_build(api, tid, bid)["status"] == "ready"
        sbx_id = api.post("/sandboxes", json={"templateID": tid}).json()["sandboxID"]
        try:
            read = api.get(f"/sandboxes/{sbx_id}")
            assert read.status_code == 200
        finally:
            api.delete(f"/sandboxes/{sbx_id}")
    assert files_hash  # the SDK's own upload went through the same check


NODE_KEY = "0f" * 32  # a node of a cluster: its gateway names the team


class _Team:
    """One team's requests to the shared in-process node."""

    def __init__(self, client: TestClient, team: str) -> None:
        self.client = client
        # what the gateway sends a node of its cluster (node/tenancy.py)
        self.headers = {"x-agentenv-node-key": NODE_KEY, "x-agentenv-team": team}

    def __getattr__(self, method: str) -> Any:
        return lambda url, **kw: getattr(self.client, method)(url, headers=self.headers, **kw)


@pytest.fixture
def two_teams(tmp_path: Path) -> Iterator[tuple[_Team, _Team, Path]]:
    state = tmp_path / "state"
    app = build_app(ServeOptions(state_dir=state, backend="process", node_key=NODE_KEY))
    with TestClient(app) as client:
        yield _Team(client, "team-a"), _Team(client, "team-b"), state


def test_one_team_upload_is_neither_present_nor_used_for_another(
        two_teams: tuple[_Team, _Team, Path], tmp_path: Path) -> None:
    a, b, state = two_teams
    _, files_hash = _context(tmp_path, "b's note\n")
    a_tid = a.post("/v3/templates", json={"name": "a-tpl"}).json()["templateID"]
    link = a.get(f"/templates/{a_tid}/files/{files_hash}").json()
    url = urlsplit(link["url"])
    assert a.put(f"{url.path}?{url.query}", content=tar_of("note.txt", b"planted\n")
                 ).status_code == 200
    made = b.post("/v3/templates", json={"name": "b-tpl"}).json()
    answer = b.get(f"/templates/{made['templateID']}/files/{files_hash}")
    assert answer.status_code == 201 and answer.json()["present"] is False
    start = b.post(f"/v2/templates/{made['templateID']}/builds/{made['buildID']}",
                   json={"fromTemplate": "base", "steps": [_copy_step(files_hash)]})
    assert start.status_code == 400 and "not uploaded" in start.json()["message"]
    from agentenv.node.template_files import team_dir  # (main has no such module)

    # team a's URL, with team b named in it, is no permission for team b
    forged = f"{url.path}?{url.query}".replace("team=team-a", "team=team-b")
    assert b.put(forged, content=b"x").status_code == 403
    assert not team_dir(state / "template-files", "team-b").exists() or not list(
        team_dir(state / "template-files", "team-b").iterdir())
