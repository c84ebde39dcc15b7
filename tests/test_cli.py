"""The aenv command line itself."""

from __future__ import annotations

import subprocess
import sys


def run_aenv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentenv.cli.main", *args], capture_output=True, text=True
    )


def test_help_lists_usage() -> None:
    result = run_aenv("--help")
    assert result.returncode == 0
    assert "Usage:" in result.stdout


def test_unknown_subcommand_fails_with_one_line() -> None:
    result = run_aenv("no-such-command")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
