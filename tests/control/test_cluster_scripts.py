"""`make cluster-up` / `make cluster-down` as a user runs them (scripts/cluster-up.sh and
scripts/cluster-down.sh, process-backend nodes for speed), inside a private network namespace
(scripts/isolated.sh) so the bridge, the node namespaces and the ports are the test's own: the
printed exports drive the official SDK through the gateway, creates land on both nodes, and
cluster-down leaves no process, namespace or bridge behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]

# The end of both checks: which of the 2 nodes hold the sandboxes `made` (asked of each node
# with its key, which cluster-up wrote next to its state), then kill them.
HOMES_AND_KILL = """
homes = set()
for s in made:
    for i in range(2):
        key = open(f"{os.environ['AENV_CLUSTER_DIR']}/node{i}/node-key").read().strip()
        r = httpx.get(f"http://{os.environ['NET']}.{10 + i}:8000/sandboxes/{s.sandbox_id}",
                      headers={"x-agentenv-node-key": key,
                               "x-agentenv-team": os.environ.get("AENV_CLUSTER_TEAM", "default")},
                      timeout=30)
        if r.status_code == 200:
            homes.add(i)
print("homes", sorted(homes))
for s in made:
    s.kill()
"""

SDK_CHECK = """
import httpx, os, sys
from e2b import Sandbox
made = [Sandbox.create(template="base", timeout=120) for _ in range(4)]
assert [s.commands.run("echo up").stdout for s in made] == ["up\\n"] * 4
"""


# A stranger on the host: Redis and the scheduler answer it nothing (no password, no token).
STRANGER_CHECK = """
import grpc, redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from agentenv.scheduling.proto import scheduler_pb2 as pb, scheduler_pb2_grpc as pb_grpc
try:
    redis.Redis(port=int(os.environ["REDIS_PORT"]), retry=Retry(NoBackoff(), 0)).set(
        "aenv:apikey:" + "0" * 64, "default")
    print("redis: open")
except redis.exceptions.AuthenticationError:
    print("redis: refused")
with grpc.insecure_channel(f"{os.environ['NET']}.1:9090",
                           options=[("grpc.enable_http_proxy", 0)]) as channel:
    try:
        pb_grpc.SchedulerStub(channel).ListNodes(pb.Empty(), timeout=30)
        print("scheduler: open")
    except grpc.RpcError as exc:
        print("scheduler:", exc.code().name)
"""


def test_cluster_up_sdk_and_down(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    state = tmp_path / "cluster"
    check = tmp_path / "check.py"
    check.write_text(SDK_CHECK + STRANGER_CHECK + HOMES_AND_KILL)
    net = "10.231.0"
    script = f"""
set -euo pipefail
# whatever fails, the cluster goes (the scheduler's and redis's command lines name no state dir)
trap 'bash scripts/cluster-down.sh >/dev/null 2>&1 || true' EXIT
eval "$(bash scripts/cluster-up.sh | sed -n 's/^ *export /export /p')"
bash scripts/cluster-up.sh | grep -q "already up\\|cluster is up"
NET={net} REDIS_PORT=16480 {sys.executable} {check}
bash scripts/cluster-down.sh
echo "netns: $(ip netns list | grep -c aenvc || true)"
echo "bridge: $(ip -o link show aenvc-br 2>/dev/null | wc -l)"
"""
    env = {**os.environ, "AENV_CLUSTER_DIR": str(state), "CLUSTER_BACKEND": "process",
           "NODES": "2", "AENV_CLUSTER_STRATEGY": "round-robin", "AENV_CLUSTER_NET": net,
           "AENV_GATEWAY_PORT": "18480",
           "AENV_CLUSTER_REDIS_PORT": "16480", "AENV_DOWN_TIMEOUT": "60"}
    done, leftovers, logs = _run_cluster(script, env, state, net, 240)
    assert done.returncode == 0, done.stdout + done.stderr + logs
    assert "homes [0, 1]" in done.stdout, done.stdout
    assert "redis: refused" in done.stdout and "scheduler: UNAUTHENTICATED" in done.stdout, (
        done.stdout)
    assert "netns: 0" in done.stdout and "bridge: 0" in done.stdout, done.stdout
    assert leftovers == [], f"cluster-down left processes running: {leftovers}"


def _run_cluster(script: str, env: dict[str, str], state: Path, net: str,
                 timeout: float) -> tuple[subprocess.CompletedProcess[str], list[int], str]:
    """Run `script` (cluster-up ... cluster-down) in a private namespace without the SDK
    variables of the test run; then kill what is left of the cluster (redis and the
    scheduler are known by their addresses) and read the cluster's logs."""
    for name in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
        env.pop(name, None)
    try:
        done = subprocess.run(["bash", "scripts/isolated.sh", "bash", "-c", script], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        leftovers = _processes_under(
            state, f"127.0.0.1:{env['AENV_CLUSTER_REDIS_PORT']}", f"{net}.1:9090")
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    logs = "".join(f"\n== {p.name}\n{p.read_text()[-3000:]}"
                   for p in sorted((state / "logs").glob("*.log")))
    return done, leftovers, logs


def _processes_under(state: Path, *more: str) -> list[int]:
    """Processes whose command line names `state` or any of `more`."""
    needles = [str(state).encode(), *(m.encode() for m in more)]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if any(needle in cmdline for needle in needles):
            found.append(int(proc.name))
    return found


VM_CHECK = """
import httpx, os, time
from e2b import Sandbox, SandboxState
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.1; done"
def count(s):
    return int(s.commands.run("cat /tmp/c").stdout)
# round-robin placement (AENV_CLUSTER_STRATEGY): the first two creates land on the two nodes
made = [Sandbox.create(template="base", timeout=300) for _ in range(2)]
for s in made:
    s.commands.run(COUNTER, background=True, timeout=0)
    deadline = time.monotonic() + 60
    while True:
        try:
            if count(s) >= 2:
                break
        except Exception:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.3)
    s.pause()
    assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
    back = Sandbox.connect(s.sandbox_id, timeout=300)
    first = count(back)
    time.sleep(1.5)
    assert count(back) > first, "the counter stopped: the paused VM lost its memory"
"""


@pytest.mark.qemu
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cluster_up_vm_nodes(tmp_path: Path) -> None:
    """The default backend: two VM nodes, each in its namespace with its blockd, from the test
    guest assets (never /var/lib/aenv); a create, a command and a pause/connect that keeps the
    VM's memory on each node; cluster-down leaves no process, namespace, nft table or mount."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, QEMU as aenv-vm)")
    from agentenv.guest.build import BASE_PACKAGES, build_assets, debian_root_tarball
    from tests.node.conftest import DEBIAN_CACHE, GUEST_STATE, NO_READY_POOLS, template_cache

    # The cluster runs in a namespace without outside network: on a cold machine the guest
    # assets and the base template's Debian root are fetched here first (cached after that;
    # cluster-up.sh does the same). The nodes leave code-interpreter-v1 out: the test checks
    # the base template, and building another on a cold machine takes minutes.
    build_assets(GUEST_STATE)
    debian_root_tarball(BASE_PACKAGES, cache_dir=DEBIAN_CACHE)

    # QEMU (aenv-vm) opens its files by path: pytest's directories are 0700
    real = Path(tempfile.mkdtemp(prefix="aenv-vmcluster-", dir="/tmp"))
    real.chmod(0o711)
    state = real / "cluster"
    check = tmp_path / "check.py"
    check.write_text(VM_CHECK + HOMES_AND_KILL)
    net = "10.232.0"
    script = f"""
set -euo pipefail
# whatever fails, the cluster goes (the scheduler's and redis's command lines name no state dir)
trap 'bash scripts/cluster-down.sh >/dev/null 2>&1 || true' EXIT
bash scripts/cluster-up.sh >{tmp_path}/up.out
eval "$(sed -n 's/^ *export /export /p' {tmp_path}/up.out)"
NET={net} {sys.executable} {check}
bash scripts/cluster-down.sh
echo "netns: $(ip netns list | grep -c aenvc || true)"
echo "bridge: $(ip -o link show aenvc-br 2>/dev/null | wc -l)"
echo "nft: $(nft list tables | grep -c aenvc || true)"
echo "mounts: $(grep -c {real} /proc/self/mountinfo || true)"
"""
    env = {**os.environ, "AENV_CLUSTER_DIR": str(state), "CLUSTER_BACKEND": "vm",
           "NODES": "2", "AENV_CLUSTER_STRATEGY": "round-robin", "AENV_CLUSTER_NET": net,
           "AENV_GATEWAY_PORT": "18481",
           "AENV_CLUSTER_REDIS_PORT": "16481", "AENV_DOWN_TIMEOUT": "120",
           "AENV_VM_ASSETS_DIR": str(GUEST_STATE), "AENV_VM_DEBIAN_CACHE": str(DEBIAN_CACHE),
           "AENV_VM_TEMPLATE_CACHE": str(template_cache()), "AENV_UP_TIMEOUT": "600",
           "AENV_VM_CODE_INTERPRETER": "0",
           # no parked VMs: each node's two would boot beside the test's own on a 2-core host
           # (the ready pools have their tests, tests/node/test_ready_pool.py)
           **NO_READY_POOLS}
    try:
        done, leftovers, logs = _run_cluster(script, env, state, net, 800)
    finally:
        shutil.rmtree(real, ignore_errors=True)
    assert done.returncode == 0, done.stdout + done.stderr + logs
    assert "homes [0, 1]" in done.stdout, done.stdout
    for gone in ("netns: 0", "bridge: 0", "nft: 0", "mounts: 0"):
        assert gone in done.stdout, done.stdout
    assert leftovers == [], f"cluster-down left processes running: {leftovers}"
