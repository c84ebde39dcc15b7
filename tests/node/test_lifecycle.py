"""Pause/resume, timeouts, concurrency and node restarts, with the process backend.

The process backend pauses by stopping the sandbox's processes and keeping its files, so these
tests check files across pause/resume and restarts, never processes; keeping processes across a
pause is the VM backend's job and is tested with it.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox, SandboxNotRunningException, SandboxQuery, SandboxState

from tests.node.conftest import NodeProcess
from tests.node.test_api import assert_error, envd, run


def wait_for(predicate: Any, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def test_pause_resume_keeps_files_sdk(sdk_env: NodeProcess) -> None:
    sbx = Sandbox.create(template="base", timeout=120)
    try:
        sbx.files.write("/home/user/keep.txt", "kept across pause")
        assert sbx.pause() is True
        assert sbx.pause() is False  # 409: already paused
        assert sbx.get_info().state == SandboxState.PAUSED
        assert not sbx.is_running()
        with pytest.raises(SandboxNotRunningException):
            sbx.commands.run("true")
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sbx.sandbox_id in {s.sandbox_id for s in paused}
        again = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert again.files.read("/home/user/keep.txt") == "kept across pause"
        assert again.commands.run("echo back").stdout == "back\n"
        # the envd token did not change, so the old object works too
        assert sbx.commands.run("echo old-handle").stdout == "old-handle\n"
    finally:
        sbx.kill()


def test_connect_status_codes_and_kill_paused(node: NodeProcess) -> None:
    with node.client() as api:
        sid = api.post("/v2/sandboxes", json={"timeout": 60}).json()["sandboxID"]
        before = api.get(f"/sandboxes/{sid}").json()["endAt"]
        assert api.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 5}).status_code == 200
        assert api.get(f"/sandboxes/{sid}").json()["endAt"] == before  # never shortened
        assert api.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
        assert_error(api.post(f"/sandboxes/{sid}/pause", json={}), 409, "paused")
        assert_error(api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 30}), 404)
        detail = api.get(f"/sandboxes/{sid}").json()
        assert detail["state"] == "paused" and detail["pauseMode"] == "filesystem"
        resumed = api.post(f"/sandboxes/{sid}/resume", json={"timeout": 30})  # legacy route
        assert resumed.status_code == 201
        assert api.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
        assert api.post(f"/v2/sandboxes/{sid}/connect", json={}).status_code == 201
        assert api.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
        assert_error(api.get(f"/sandboxes/{sid}"), 404)
        assert not (node.state_dir / "process-backend" / "sandboxes" / sid).exists()


def test_auto_pause_on_timeout_and_auto_resume_by_traffic(node: NodeProcess) -> None:
    with node.client() as api:
        created = api.post(
            "/v2/sandboxes",
            json={"timeout": 1, "autoPause": True, "autoResume": {"enabled": True}},
        ).json()
        sid, token = created["sandboxID"], created["envdAccessToken"]
        wait_for(lambda: api.get(f"/sandboxes/{sid}").json()["state"] == "paused")
        detail = api.get(f"/sandboxes/{sid}").json()
        assert detail["lifecycle"] == {"autoResume": True, "onTimeout": "pause"}
        time.sleep(1.5)  # paused sandboxes never expire
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
        assert run(node, sid, token, "echo woke") == "woke\n"  # traffic resumes it
        detail = api.get(f"/sandboxes/{sid}").json()
        assert detail["state"] == "running"
        end = time.mktime(time.strptime(detail["endAt"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
        assert end - time.time() > 250  # auto-resume gives at least 300 s
        api.delete(f"/sandboxes/{sid}")


def test_paused_without_auto_resume_is_502(node: NodeProcess) -> None:
    with node.client() as api:
        sid = api.post("/v2/sandboxes", json={"timeout": 60}).json()["sandboxID"]
        api.post(f"/sandboxes/{sid}/pause", json={})
        with envd(node, sid) as client:
            answer = client.get("/health")
        assert answer.status_code == 502 and "was not found" in answer.json()["message"]
        api.delete(f"/sandboxes/{sid}")


def test_concurrent_calls_on_one_sandbox(node: NodeProcess) -> None:
    with node.client() as api:
        sid = api.post("/v2/sandboxes", json={"timeout": 60}).json()["sandboxID"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:

        def pause() -> int:
            with node.client() as c:
                return c.post(f"/sandboxes/{sid}/pause", json={}).status_code

        statuses = sorted(pool.map(lambda _: pause(), range(4)))
    assert statuses == [204, 409, 409, 409]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:

        def kill() -> int:
            with node.client() as c:
                return c.delete(f"/sandboxes/{sid}").status_code

        kills = list(pool.map(lambda _: kill(), range(3)))
    assert sorted(kills) == [204, 404, 404]


def test_client_disconnect_does_not_abort_create(node: NodeProcess) -> None:
    marker = f"m{os.getpid()}{int(time.time())}"
    with node.client() as api, pytest.raises(httpx.ReadTimeout):
        api.post(
            "/v2/sandboxes",
            json={"timeout": 60, "metadata": {"marker": marker}},
            timeout=httpx.Timeout(10, read=0.05),  # hang up once the request is sent
        )
    with node.client() as api:

        def listed() -> list[dict[str, Any]]:
            return api.get("/v2/sandboxes", params={"metadata": f"marker={marker}"}).json()

        wait_for(lambda: len(listed()) == 1 and listed()[0]["state"] == "running")
        sid = listed()[0]["sandboxID"]
        with envd(node, sid) as client:
            assert client.get("/health").status_code == 204
        api.delete(f"/sandboxes/{sid}")


def _envd_pids(state_dir: Path) -> set[int]:
    needle = str(state_dir).encode()
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"agentenv.guest.envd" in cmd and needle in cmd:
                pids.add(int(entry))
    return pids


def test_graceful_restart_pauses_and_keeps_records(make_node: Any) -> None:
    node = make_node()
    with node.client() as api:
        running = api.post("/v2/sandboxes", json={"timeout": 600, "metadata": {"k": "v"}}).json()
        sid, token = running["sandboxID"], running["envdAccessToken"]
        run(node, sid, token, "echo persisted > /home/user/r.txt")
    assert node.stop() in (0, -15)  # uvicorn re-raises SIGTERM after a clean shutdown
    assert _envd_pids(node.state_dir) == set()  # every sandbox was paused
    node.start()
    with node.client() as api:
        detail = api.get(f"/sandboxes/{sid}").json()
        assert detail["state"] == "paused" and detail["metadata"] == {"k": "v"}
        assert api.post(f"/v2/sandboxes/{sid}/connect", json={}).status_code == 201
        assert run(node, sid, token, "cat /home/user/r.txt") == "persisted\n"
        api.delete(f"/sandboxes/{sid}")


def test_kill9_restart_adopts_running_sandboxes(make_node: Any) -> None:
    node = make_node()
    with node.client() as api:
        a = api.post("/v2/sandboxes", json={"timeout": 600}).json()
        b = api.post("/v2/sandboxes", json={"timeout": 600}).json()
        api.post(f"/sandboxes/{b['sandboxID']}/pause", json={})
        run(node, a["sandboxID"], a["envdAccessToken"], "sleep 300 >/dev/null 2>&1 &")
    pids_before = _envd_pids(node.state_dir)
    node.kill9()
    assert _envd_pids(node.state_dir) == pids_before  # the sandboxes outlived the node
    node.start()
    with node.client() as api:
        states = {s["sandboxID"]: s["state"] for s in api.get("/v2/sandboxes").json()}
        assert states == {a["sandboxID"]: "running", b["sandboxID"]: "paused"}
        # same envd process, same token: even the background process is still there
        out = run(
            node, a["sandboxID"], a["envdAccessToken"], "echo alive; ls /proc 2>/dev/null | head -0"
        )
        assert out == "alive\n"
        for sid in states:
            assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert _envd_pids(node.state_dir) == set()


def test_node_dying_right_after_pausing_loses_nothing(make_node: Any) -> None:
    """Fault injection: AENV_TEST_CRASH_AT=pause-snapshot-written makes the node os._exit right
    after the backend paused, before the node recorded it (the window a kill -9 would hit)."""
    node = make_node()
    node.stop()
    node.extra_env["AENV_TEST_CRASH_AT"] = "pause-snapshot-written"
    node.start()
    with node.client() as api:
        sbx = api.post("/v2/sandboxes", json={"timeout": 600}).json()
        sid, token = sbx["sandboxID"], sbx["envdAccessToken"]
        run(node, sid, token, "echo before-crash > /home/user/c.txt")
        with pytest.raises(httpx.HTTPError):
            api.post(f"/sandboxes/{sid}/pause", json={})
    assert node.proc is not None and node.proc.wait(timeout=30) == 86
    node.proc = None
    del node.extra_env["AENV_TEST_CRASH_AT"]
    node.start()
    with node.client() as api:
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
        assert api.post(f"/v2/sandboxes/{sid}/connect", json={}).status_code == 201
        assert run(node, sid, token, "cat /home/user/c.txt") == "before-crash\n"
        assert api.delete(f"/sandboxes/{sid}").status_code == 204


def test_second_node_on_the_same_state_dir_is_refused(make_node: Any) -> None:
    import subprocess
    import sys

    from tests.node.conftest import free_port

    node = make_node()
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentenv.cli.main",
            "serve",
            "--backend",
            "process",
            "--state-dir",
            str(node.state_dir),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert "another node is already running" in second.stderr
    assert "Traceback" not in second.stderr
    with node.client() as api:  # the first node is unharmed
        assert api.get("/v2/sandboxes").status_code == 200


def test_serve_defaults_to_the_vm_backend() -> None:
    """The product is the VM backend: `aenv serve` runs it unless told `--backend process`."""
    from click.testing import CliRunner

    from agentenv.cli.node import serve_command
    from agentenv.node.server import ServeOptions

    assert ServeOptions().backend == "vm"
    default = next(p for p in serve_command.params if p.name == "backend").default
    assert default == "vm"
    shown = CliRunner().invoke(serve_command, ["--help"]).output
    assert "[default: vm]" in shown
