"""The official E2B TypeScript SDK (npm `e2b`, version pinned in ts/package-lock.json) against the
node: create, commands.run, files write/read, pause then connect (the process backend keeps files
only), kill. The SDK talks to envd through E2B_SANDBOX_URL with E2b-Sandbox-Id headers and sends
its control-plane POST bodies chunked, so this also covers both of those paths.

The SDK is installed with `npm ci` into /var/cache/aenv-test/node-ts/<lock hash>/ (npm_pinned.py:
reused across runs, built on first use; a fresh machine installs it here).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.node import npm_pinned
from tests.node.conftest import NodeProcess

TS_DIR = Path(__file__).parent / "ts"
SDK_VERSION = json.loads((TS_DIR / "package.json").read_text())["dependencies"]["e2b"]


@pytest.fixture(scope="module")
def ts_sdk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return npm_pinned.install(TS_DIR, "e2b", tmp_path_factory.mktemp("node-ts"))


def test_typescript_sdk_round_trip(node: NodeProcess, ts_sdk: Path) -> None:
    env = npm_pinned.sdk_env(node.url, node.api_key, ts_sdk)
    done = subprocess.run(
        [npm_pinned.tool("node"), str(TS_DIR / "sdk_roundtrip.mjs")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, f"TypeScript SDK run failed:\n{done.stdout}\n{done.stderr}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])

    assert seen["sdkVersion"] == SDK_VERSION
    sid = seen["sandboxId"]
    assert sid and "-" not in sid and "." not in sid
    assert seen["run"] == {"stdout": "hi\nfrom-ts\n", "stderr": "err\n", "exitCode": 0}
    assert seen["exit3"] == {"name": "CommandExitError", "exitCode": 3}
    assert seen["writeText"]["path"] == "/home/user/ts.txt"
    assert seen["readText"] == "hello from typescript\n"
    assert seen["binaryRoundTrip"] is True
    assert seen["infoBefore"] == {
        "state": "running",
        "metadata": {"suite": "ts-sdk"},
        "templateId": "base",
    }
    # Pause: True, then False for an already paused sandbox (TS reads body.code == 409).
    assert (seen["pause"], seen["pauseAgain"]) == (True, False)
    assert seen["stateWhilePaused"] == "paused"
    assert seen["runningWhilePaused"] is False
    # Connect resumes it; the process backend keeps files across a pause.
    assert seen["stateAfterConnect"] == "running"
    assert seen["readAfterResume"] == "hello from typescript\n"
    assert seen["runAfterResume"] == "22\n"
    # Kill: True, then False (404 by body.code); gone for isRunning and connect.
    assert (seen["kill"], seen["killAgain"]) == (True, False)
    assert seen["runningAfterKill"] is False
    assert seen["connectAfterKill"]["notFound"] is True

    with node.client() as api:
        assert api.get(f"/sandboxes/{sid}").status_code == 404


def test_chunked_control_plane_body(node: NodeProcess) -> None:
    """TS sends control-plane POST bodies with Transfer-Encoding: chunked; so does this."""

    def chunks() -> Iterator[bytes]:
        yield b'{"templateID": "ba'
        yield b'se", "timeout": 60, "metadata": {"via": "chunked"}}'

    with node.client() as api:
        created = api.post(
            "/v2/sandboxes", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert created.status_code == 201, created.text
        sid = created.json()["sandboxID"]
        try:
            assert api.get(f"/sandboxes/{sid}").json()["metadata"] == {"via": "chunked"}
            paused = api.post(f"/sandboxes/{sid}/pause", content=iter([b"{", b"}"]))
            assert paused.status_code == 204, paused.text
        finally:
            assert api.delete(f"/sandboxes/{sid}").status_code == 204
