"""A QEMU that starts but never speaks QMP: the error says so and where QEMU is held, not an
empty message (a bare TimeoutError reached users as "starting the VM of X failed: ")."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agentenv.node.vm_backend.errors import BackendError, vm_errors
from agentenv.runtime.qemu import _stuck_where
from agentenv.runtime.qmp import QMPClient, QMPError


def test_a_socket_that_never_greets_is_a_named_qmp_error(tmp_path: Path) -> None:
    path = tmp_path / "qmp.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)  # accepts (the backlog) and never writes
    try:
        with pytest.raises(QMPError, match=r"no QMP greeting .* within 0\.2 s"):
            asyncio.run(QMPClient.connect(path, timeout=0.2))
    finally:
        server.close()


def test_where_a_stuck_process_is_held() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        where = ""
        for _ in range(200):  # until it sleeps (the interpreter's start runs first)
            where = _stuck_where(sleeper.pid)
            if " S " in where:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert where.startswith(f"QEMU pid {sleeper.pid} threads: python"), where
        assert " S " in where, where
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _stuck_where(sleeper.pid) == f"QEMU pid {sleeper.pid} is gone"
    assert "threads:" in _stuck_where(os.getpid())


def test_an_error_without_text_is_named_by_its_type() -> None:
    with pytest.raises(BackendError, match=r"starting failed: TimeoutError$"), \
            vm_errors("starting failed"):
        raise TimeoutError
