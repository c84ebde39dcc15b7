"""Registry credentials given to a template build (`fromImageRegistry`) are used for the pull,
in memory, and written nowhere: not in the build record, the node DB, the state directory or
the node's log. Against a real docker-registry with htpasswd auth on loopback."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.template import helpers
from tests.template.registry_server import Registry, running_registry

from .conftest import NodeProcess

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

PASSWORD = "pw-" + uuid.uuid4().hex  # unique, so finding it anywhere means it leaked


@pytest.fixture(scope="module")
def secret_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("secret-registry"),
                          ("builder", PASSWORD)) as reg:
        reg.push("private/busybox", "v1",
                 helpers.build_image([helpers.busybox_layer()], ["gzip"]))
        yield reg


def _build(node: NodeProcess, image: str, registry_auth: dict[str, str]) -> dict:  # type: ignore[type-arg]
    with node.client() as api:
        created = api.post("/v3/templates", json={"name": f"secret-{uuid.uuid4().hex[:8]}"})
        assert created.status_code in (200, 201, 202), created.text
        tid, bid = created.json()["templateID"], created.json()["buildID"]
        started = api.post(f"/v2/templates/{tid}/builds/{bid}", json={
            "fromImage": image, "fromImageRegistry": registry_auth,
            "steps": [{"type": "RUN", "args": ["echo built"]}]})
        assert started.status_code == 202, started.text
        deadline = time.monotonic() + 600
        while True:
            status = api.get(f"/templates/{tid}/builds/{bid}/status").json()
            if status["status"] not in ("waiting", "building") or time.monotonic() > deadline:
                return status
            time.sleep(0.5)


def _leaks(root: Path, needles: list[bytes]) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                data = path.read_bytes()
            except OSError:
                continue
            found += [f"{path}: {n!r}" for n in needles if n in data]
    return found


def test_registry_password_is_used_and_never_written(shared_vm_node: NodeProcess,
                                                    secret_registry: Registry) -> None:
    node = shared_vm_node  # conftest.shared_vm_node: no ready pool, a layer cache of its own
    image = f"{secret_registry.host}/private/busybox:v1"
    good = _build(node, image, {"type": "registry", "username": "builder",
                                "password": PASSWORD})
    messages = [e["message"] for e in good["logEntries"]]
    assert good["status"] == "ready", messages[-20:]
    assert any(m.startswith("pulled ") for m in messages) and "built" in messages, messages
    bad = _build(node, image, {"type": "registry", "username": "builder",
                               "password": PASSWORD[::-1]})
    assert bad["status"] == "error"
    assert "builder" in bad["reason"]["message"], bad["reason"]
    with node.client() as api:
        assert api.get("/templates").status_code == 200
    needles = [PASSWORD.encode(), PASSWORD[::-1].encode(),
               base64.b64encode(f"builder:{PASSWORD}".encode()),
               base64.b64encode(f"builder:{PASSWORD[::-1]}".encode())]
    # The node's whole base directory: state, log, layer cache.
    base = Path(node.extra_env["AENV_LAYER_CACHE"]).parent
    assert (node.state_dir / "node.db").is_file() and node.log_path.parent == base
    assert not _leaks(base, needles) and not _leaks(node.state_dir, needles)
    records = list(node.state_dir.rglob("template-builds/*.json"))
    assert records and all(b'"password": "[redacted]"' in r.read_bytes() for r in records)
