"""Found by the red team of 2026-12-07: "below 1024: only root binds it, so no local user
takes it while ganesha restarts" holds only while net.ipv4.ip_unprivileged_port_start is above
the port. It is a per-network-namespace sysctl that container runtimes set to 0 (Docker does by
default) and some hosts lower: there any local user binds the NFS port in the window between
ganesha's exit and the next start. `start` then refuses to start (every guest's shared volumes
down), or, when the squatter binds right after ganesha exited, the slots' redirect hands the
guests' NFS connections (their files' contents, their writes) to the squatter.

What should hold: the node does not take a port an unprivileged process may bind (it refuses,
naming the sysctl, or picks a port below it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SNIPPET = r"""
import os, socket, sys
from pathlib import Path
Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").write_text("0\n")
port = 900
pid = os.fork()
if pid == 0:  # a local user (nobody) binds the NFS port: allowed with the sysctl at 0
    os.setgid(65534); os.setuid(65534)
    s = socket.socket(); s.bind(("127.0.0.1", port)); os._exit(0)
_, status = os.waitpid(pid, 0)
print("nobody-bound", os.waitstatus_to_exitcode(status) == 0)
from agentenv.node.nfs import NfsError, NfsServer
try:
    NfsServer(Path(sys.argv[1]), bind_addr="127.0.0.1", port=port,
              binary="/nonexistent/ganesha.nfsd").start([])  # (never started here)
except NfsError as exc:
    print("refused", exc)
"""


def test_the_nfs_port_is_not_one_an_unprivileged_user_may_bind(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a network namespace of its own)")
    src = str(Path(__file__).resolve().parents[2] / "src")
    out = subprocess.run(["unshare", "--net", sys.executable, "-c", SNIPPET, str(tmp_path)],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": src}).stdout
    assert "nobody-bound True" in out, out  # the premise: the port is anyone's to take
    assert "refused" in out and "ip_unprivileged_port_start" in out, (
        f"the NFS server took a port any local user may bind: {out}")
