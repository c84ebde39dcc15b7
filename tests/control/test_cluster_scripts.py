"""`make cluster-up` / `make cluster-down` as a user runs them (scripts/cluster-up.sh and
scripts/cluster-down.sh, process-backend nodes for speed), inside a private network namespace
(scripts/isolated.sh) so the bridge, the node namespaces and the ports are the test's own: the
printed exports drive the official SDK through the gateway, creates land on both nodes, and
cluster-down leaves no process, namespace or bridge behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]

SDK_CHECK = """
import httpx, os, sys
from e2b import Sandbox
made = [Sandbox.create(template="base", timeout=120) for _ in range(4)]
assert [s.commands.run("echo up").stdout for s in made] == ["up\\n"] * 4
secret = open(os.environ["AENV_CLUSTER_DIR"] + "/cluster-secret").read().strip()
homes = set()
for s in made:
    for i in range(2):
        r = httpx.get(f"http://{os.environ['NET']}.{10 + i}:8000/sandboxes/{s.sandbox_id}",
                      headers={"x-agentenv-cluster-secret": secret}, timeout=30)
        if r.status_code == 200:
            homes.add(i)
print("homes", sorted(homes))
for s in made:
    s.kill()
"""


def test_cluster_up_sdk_and_down(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    state = tmp_path / "cluster"
    check = tmp_path / "check.py"
    check.write_text(SDK_CHECK)
    net = "10.231.0"
    script = f"""
set -euo pipefail
eval "$(bash scripts/cluster-up.sh | sed -n 's/^ *export /export /p')"
bash scripts/cluster-up.sh | grep -q "already up\\|cluster is up"
NET={net} {sys.executable} {check}
bash scripts/cluster-down.sh
echo "netns: $(ip netns list | grep -c aenvc || true)"
echo "bridge: $(ip -o link show aenvc-br 2>/dev/null | wc -l)"
"""
    env = {**os.environ, "AENV_CLUSTER_DIR": str(state), "CLUSTER_BACKEND": "process",
           "NODES": "2", "AENV_CLUSTER_NET": net, "AENV_GATEWAY_PORT": "18480",
           "AENV_CLUSTER_REDIS_PORT": "16480", "AENV_DOWN_TIMEOUT": "60"}
    env.pop("E2B_API_URL", None)
    env.pop("E2B_SANDBOX_URL", None)
    try:
        done = subprocess.run(["bash", "scripts/isolated.sh", "bash", "-c", script], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=240)
    finally:
        leftovers = _processes_under(state)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    logs = "".join(f"\n== {p.name}\n{p.read_text()[-2000:]}"
                   for p in sorted((state / "logs").glob("*.log")))
    assert done.returncode == 0, done.stdout + done.stderr + logs
    assert "homes [0, 1]" in done.stdout, done.stdout
    assert "netns: 0" in done.stdout and "bridge: 0" in done.stdout, done.stdout
    assert leftovers == [], f"cluster-down left processes running: {leftovers}"


def _processes_under(state: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if str(state).encode() in cmdline:
            found.append(int(proc.name))
    return found
