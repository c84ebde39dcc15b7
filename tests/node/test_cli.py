"""`aenv sandbox ...` against a running node, and `aenv serve` argument errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from click.testing import CliRunner, Result

from agentenv.cli.main import cli
from tests.node.conftest import NodeProcess


def aenv(node: NodeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """The real `aenv` process (checks exit codes and one-line errors)."""
    env = {**os.environ, "E2B_API_URL": node.url, "E2B_API_KEY": node.api_key}
    return subprocess.run(
        [sys.executable, "-m", "agentenv.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def aenv_inline(node: NodeProcess, *args: str) -> Result:
    """The same commands in this process (no 2 s interpreter start per call)."""
    env = {"E2B_API_URL": node.url, "E2B_API_KEY": node.api_key}
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=True)


def test_sandbox_commands(node: NodeProcess) -> None:
    created = aenv_inline(
        node, "sandbox", "create", "--timeout", "60", "-m", "cli=yes", "-e", "A=1"
    )
    assert created.exit_code == 0, created.output
    sid = created.stdout.strip()
    listed = aenv_inline(node, "sandbox", "ls", "--json")
    assert listed.exit_code == 0, listed.output
    assert sid in {s["sandboxID"] for s in json.loads(listed.stdout)}
    assert aenv_inline(node, "sandbox", "ls").exit_code == 0
    assert aenv_inline(node, "sandbox", "pause", sid).exit_code == 0
    info = json.loads(aenv_inline(node, "sandbox", "info", sid).stdout)
    assert info["state"] == "paused" and info["metadata"] == {"cli": "yes"}
    assert "resumed" in aenv_inline(node, "sandbox", "resume", sid).stdout
    assert aenv_inline(node, "sandbox", "pause", "--filesystem", sid).exit_code == 0
    info = json.loads(aenv_inline(node, "sandbox", "info", sid).stdout)
    assert (info["state"], info["pauseMode"]) == ("paused", "filesystem")
    assert "resumed" in aenv_inline(node, "sandbox", "resume", sid).stdout
    assert aenv_inline(node, "sandbox", "timeout", sid, "30").exit_code == 0
    assert aenv_inline(node, "sandbox", "kill", sid).exit_code == 0
    missing = aenv(node, "sandbox", "info", sid)
    assert missing.returncode == 1
    assert "404" in missing.stderr and "Traceback" not in missing.stderr


def test_bad_key_is_one_line_error(node: NodeProcess) -> None:
    result = aenv(node, "sandbox", "--api-key", "e2b_bad", "ls")
    assert result.returncode == 1
    assert "401" in result.stderr and "Traceback" not in result.stderr


def test_exec_fork_snapshot_auth(node: NodeProcess) -> None:
    sid = aenv_inline(node, "sandbox", "create", "--timeout", "60", "-e", "A=1").stdout.strip()
    try:
        ran = aenv(node, "sandbox", "exec", sid, "echo", "out-$A;", "echo", "err", ">&2;",
                   "exit", "3")
        assert ran.returncode == 3, ran.stderr
        assert ran.stdout == "out-1\n" and ran.stderr == "err\n"
        assert aenv(node, "sandbox", "exec", sid, "true").returncode == 0
        snap = aenv_inline(node, "sandbox", "snapshot", sid, "--name", "cli-snap")
        assert snap.exit_code == 0, snap.output
        children = aenv_inline(node, "sandbox", "fork", sid, "--count", "2")
        assert children.exit_code == 0, children.output
        child_ids = children.stdout.split()
        assert len(child_ids) == 2 and sid not in child_ids
        for child in child_ids:
            assert aenv_inline(node, "sandbox", "kill", child).exit_code == 0
        # the process backend cannot roll back (test_rl_lifecycle.py: the VM backend does)
        rolled = aenv(node, "rollback", sid)
        assert rolled.returncode == 1 and "VM backend" in rolled.stderr, rolled.stderr
        unknown = aenv(node, "sandbox", "exec", "nosuchsandbox", "true")
        assert unknown.returncode == 1 and "404" in unknown.stderr
    finally:
        aenv_inline(node, "sandbox", "kill", sid)
    auth = aenv_inline(node, "auth", "--state-dir", "/nonexistent")
    assert auth.exit_code == 0, auth.output
    assert f"export E2B_API_KEY={node.api_key}" in auth.stdout


def test_top_level_shortcuts(node: NodeProcess) -> None:
    sid = aenv_inline(node, "sandbox", "create", "--timeout", "60").stdout.strip()
    listed = aenv_inline(node, "ls", "--json")
    assert listed.exit_code == 0, listed.output
    assert sid in {s["sandboxID"] for s in json.loads(listed.stdout)}
    assert aenv(node, "exec", sid, "exit 4").returncode == 4
    assert aenv_inline(node, "pause", sid).exit_code == 0
    assert "resumed" in aenv_inline(node, "resume", sid).stdout
    assert aenv_inline(node, "rm", sid).exit_code == 0
    assert aenv(node, "rm", sid).returncode == 1


def test_start_attaches_a_shell_on_a_terminal(node: NodeProcess) -> None:
    """`aenv start` on a real pseudo-terminal: typed input reaches the sandbox's shell, its
    output comes back, its exit code is passed through and the sandbox is killed after."""
    import pty
    import select
    import time

    env = {**os.environ, "E2B_API_URL": node.url, "E2B_API_KEY": node.api_key}
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "agentenv.cli.main", "start", "--timeout", "60"],
                            stdin=slave, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    output = b""
    sent = False
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    output += os.read(master, 65536)
                except OSError:
                    break
            if not sent and time.monotonic() > deadline - 55:
                os.write(master, b"echo hi-$((6*7)); exit 5\r")
                sent = True
        assert proc.wait(timeout=30) == 5, output
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert b"hi-42" in output
    assert proc.stderr is not None
    sandbox_id = proc.stderr.read().decode().split()[1]
    assert aenv(node, "sandbox", "info", sandbox_id).returncode == 1  # killed with the shell
