"""E2B's own code-interpreter SDK test suite (github.com/e2b-dev/code-interpreter, python/tests)
against a VM node's code-interpreter-v1 template (issue 29). The suite is not in this repository:
put a copy anywhere outside it (e.g. /tmp) and give its python/ directory. Its tests/ and
pytest.ini are copied to a directory of their own (beside them, the repository's
e2b_code_interpreter source would be imported instead of the installed SDK) and run unchanged,
in a venv of its own holding e2b-code-interpreter (from PyPI, as users get it), pytest,
pytest-asyncio and pytest-timeout, pointed at the node the way a user points the SDK
(E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY). The node is started as
tests/node/test_code_interpreter.py starts its own (needs root and QEMU).

    flock /tmp/aenv-vmtest.lock .venv/bin/python bench/e2b_code_interpreter_suite.py \\
        --suite /tmp/e2bci/python --python /tmp/e2bci/venv/bin/python [-- PYTEST ARGS]

Passes the suite's pytest output through (the suite's own pytest.ini; serial, not its
--numprocesses=2: two cores also run the VMs) and exits with pytest's status.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.node import conftest

PREFIX, FIRST_SLOT = "aes", 22801  # 22801-23200


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", type=Path, required=True, help="the copy's python/ directory")
    parser.add_argument("--python", required=True, help="a venv's python with the SDK and pytest")
    parser.add_argument("--node-log", type=Path, help="keep a copy of the node's log here")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (default tests)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="aenv-e2bsuite-"))
    with conftest.code_interpreter_node(base, PREFIX, FIRST_SLOT) as node:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
               "E2B_API_URL": node.url, "E2B_SANDBOX_URL": node.url,
               "E2B_API_KEY": node.api_key}
        suite = base / "suite"
        suite.mkdir()
        shutil.copytree(args.suite / "tests", suite / "tests")
        shutil.copy(args.suite / "pytest.ini", suite / "pytest.ini")
        done = subprocess.run(
            [args.python, "-m", "pytest", "-o", "addopts=--import-mode=importlib",
             "-p", "no:cacheprovider", "-rfE", *(args.pytest_args or ["tests"])],
            cwd=suite, env=env, check=False)
        if args.node_log:
            shutil.copy(node.log_path, args.node_log)
        return done.returncode


if __name__ == "__main__":
    sys.exit(main())
