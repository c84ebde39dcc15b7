"""Where the VM matters: a cluster of one VM-backend node and one process-backend node; through
the gateway, a sandbox on the VM node pauses with its memory and comes back with its processes
still running (the process backend keeps files only)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, SandboxState

from tests.control.cluster import LocalCluster
from tests.node.conftest import COUNTER, counter_value, environ_set, wait_counting

pytestmark = [pytest.mark.timeout(900), pytest.mark.qemu, pytest.mark.slow]


@pytest.fixture(scope="module")
def vm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # round-robin: of two creates one reaches the VM node, whatever the nodes' reported room
    # (by load, the two nodes on one host tie but for the MemAvailable each sampled)
    made = LocalCluster(tmp_path_factory.mktemp("vm-cluster"), nodes=2, vm_nodes=1,
                        strategy="round-robin")
    try:
        made.start()
        made.team("vm")
        with environ_set({"E2B_API_URL": made.url, "E2B_SANDBOX_URL": made.url,
                          "E2B_API_KEY": made.keys["vm"]}):
            yield made
    finally:
        made.stop()


def on_node(cluster: LocalCluster, sandbox_id: str, node: int) -> bool:
    answer = httpx.get(f"{cluster.nodes[node].url}/sandboxes/{sandbox_id}", timeout=30,
                       headers=cluster.node_headers(cluster.nodes[node], "vm"))
    return answer.status_code == 200


def test_vm_sandbox_pauses_with_memory_through_the_gateway(vm_cluster: LocalCluster) -> None:
    made = []
    try:
        # round-robin placement alternates between the two nodes: one of two reaches the VM
        sbx = None
        for _ in range(2):
            candidate = Sandbox.create(template="base", timeout=300)
            made.append(candidate)
            if on_node(vm_cluster, candidate.sandbox_id, 0):
                sbx = candidate
                break
        assert sbx is not None, "no create was placed on the VM node"
        sbx.commands.run(COUNTER, background=True, timeout=0)
        before = wait_counting(sbx)
        sbx.pause()
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        back = Sandbox.connect(sbx.sandbox_id, timeout=300)
        after = counter_value(back)
        assert after >= before
        time.sleep(1.5)
        # still counting: the process survived the pause (memory kept), not just its file
        assert counter_value(back) > after
        assert back.commands.run("echo vm").stdout == "vm\n"
    finally:
        for sandbox in made:
            sandbox.kill()


def test_paused_fork_rollback_and_batch_through_the_gateway(vm_cluster: LocalCluster) -> None:
    """On the VM node, through the gateway: the SDK's fork of a paused sandbox (children on its
    node, the parent stays paused), a batch from its snapshot (on the snapshot's node), and a
    rollback answered with the new token."""
    key = {"X-API-KEY": vm_cluster.keys["vm"]}
    made: list[str] = []
    try:
        sbx = None
        for _ in range(4):
            candidate = Sandbox.create(template="base", timeout=300)
            made.append(candidate.sandbox_id)
            if on_node(vm_cluster, candidate.sandbox_id, 0):
                sbx = candidate
                break
        assert sbx is not None, "no create was placed on the VM node"
        sbx.files.write("/home/user/mark.txt", "before")
        snap = httpx.post(f"{vm_cluster.url}/sandboxes/{sbx.sandbox_id}/snapshots", json={},
                          headers=key, timeout=120).json()["snapshotID"]
        sbx.files.write("/home/user/mark.txt", "after")
        sbx.pause()
        forked = Sandbox.fork(sbx.sandbox_id, count=2, timeout=300)
        assert not [f for f in forked if isinstance(f, Exception)], forked
        made += [f.sandbox_id for f in forked]
        for child in forked:
            assert on_node(vm_cluster, child.sandbox_id, 0)
            assert child.files.read("/home/user/mark.txt") == "after"
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED

        batch = httpx.post(f"{vm_cluster.url}/snapshots/{snap}/fork", headers=key, timeout=300,
                           json={"count": 2, "timeout": 300})
        assert batch.status_code == 201, batch.text
        ids = [r["sandbox"]["sandboxID"] for r in batch.json()]
        made += ids
        for cid in ids:
            assert on_node(vm_cluster, cid, 0)
            assert Sandbox.connect(cid).files.read("/home/user/mark.txt") == "before"

        rolled = httpx.post(f"{vm_cluster.url}/sandboxes/{sbx.sandbox_id}/rollback",
                            json={"snapshotID": snap}, headers=key, timeout=300)
        assert rolled.status_code == 200, rolled.text
        assert rolled.json()["envdAccessToken"] != sbx._envd_access_token
        back = Sandbox.connect(sbx.sandbox_id, timeout=300)
        assert back.files.read("/home/user/mark.txt") == "before"
    finally:
        for sid in made:
            with contextlib.suppress(Exception):
                Sandbox.kill(sid)
