"""`aenv envd --root DIR`: the same envd on the host, and a clean shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from tests.envd.conftest import free_port, make_busybox_root

pytestmark = pytest.mark.root
AENV = [sys.executable, "-m", "agentenv.cli.main"]


def test_aenv_envd_serves_a_root_and_shuts_down_cleanly(tmp_path: Path, needs_root: None) -> None:
    root = make_busybox_root(tmp_path / "root")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "AENV_ENVD_SHELL_FALLBACK"}
    process = subprocess.Popen(
        [*AENV, "envd", "--root", str(root), "--port", str(port), "--shell-fallback", "/bin/sh"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 204:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()
            time.sleep(0.05)
        sandbox = Sandbox.create(debug=True, sandbox_url=url)
        assert sandbox.commands.run("echo from-cli; whoami").stdout == "from-cli\nuser\n"
        sleeper = sandbox.commands.run("sleep 300", background=True, timeout=0)
        # /init from a host must not touch the host's clock or hostname.
        hostname = os.uname().nodename
        reply = httpx.post(f"{url}/init", json={"timestamp": "2001-01-01T00:00:00Z", "hostname": "guest-name"})
        assert reply.status_code == 204
        assert os.uname().nodename == hostname
        assert time.gmtime().tm_year > 2001
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=15)
    assert process.returncode == 0, stderr.decode()[-2000:]
    assert not Path(f"/proc/{sleeper.pid}").exists() or "Z" in Path(f"/proc/{sleeper.pid}/stat").read_text().split()[2]


def test_aenv_envd_bad_root(tmp_path: Path) -> None:
    result = subprocess.run([*AENV, "envd", "--root", str(tmp_path / "missing")], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip() == f"aenv: error: --root '{tmp_path / 'missing'}' is not a directory"
