"""The node's heartbeat sender (node/heartbeat.py) against a real scheduler process: a
process-backend node registers, its sandboxes are bound by reconciliation and unbound when
killed, and it is down once it stops heartbeating."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.cluster_keys import node_key
from agentenv.node.host_use import HostProbe
from tests.control.conftest import RedisServer, SchedulerProcess
from tests.control.helpers import SECRET, call, wait_for
from tests.node.conftest import NodeProcess


@pytest.fixture
def sched(redis_server: RedisServer, prefix: str, tmp_path: Path) -> Iterator[SchedulerProcess]:
    proc = SchedulerProcess(redis_server.url, prefix, tmp_path / "scheduler.log",
                            "--heartbeat-interval", "0.3", "--reconcile-grace", "0.5")
    proc.start()
    yield proc
    proc.stop()


def test_node_heartbeats_register_and_reconcile(sched: SchedulerProcess, tmp_path: Path) -> None:
    node = NodeProcess(
        tmp_path / "state", tmp_path / "node.log",
        extra_args=("--backend", "process", "--scheduler", sched.address, "--node-id", "node-a",
                    "--cluster-secret-file", str(sched.secret_file)),
    )
    try:
        node.start()
        nodes = wait_for("node-a to register", lambda: [
            n for n in call(sched.address, "list_nodes") if n.node_id == "node-a" and n.up])
        info = nodes[0]
        assert info.address == f"127.0.0.1:{node.port}"
        assert "base" in info.status.templates
        assert info.status.disk_free_bytes > 0
        # the node's own admission figures (node/admission.py room): its ceilings at the
        # default ratios of the host it reports, what it counts per sandbox, its disk floor
        st = info.status
        host = HostProbe().sample()
        assert (st.host_cpus, st.host_memory_mib) == (host.cpus, host.memory_total_mib)
        assert (st.cpu_total, st.memory_total_mib) == (14 * host.cpus,
                                                      5 * host.memory_total_mib)
        assert st.cpu_free == st.cpu_total
        assert st.cpu_bound == f"14 x {host.cpus} host CPUs, AENV_CPU_REQUEST_RATIO"
        assert 0 < st.memory_free_mib <= st.memory_total_mib and st.memory_bound
        assert (st.sandbox_overhead_mib, st.sandbox_overhead_per_vcpu_mib) == (128, 4)
        assert st.disk_floor_bytes == 1 << 30 and st.memory_available_mib > 0
        assert st.HasField("cpu_pressure") == (host.cpu_pressure is not None)
        sizes = {t.template_id: (t.vcpus, t.memory_mib) for t in st.template_sizes}
        assert sizes["base"] == (2, 512)

        # a node of a cluster serves its gateway only: the node's key and the team, as the
        # gateway sends them
        with httpx.Client(base_url=node.url, headers={"x-agentenv-node-key": node_key(SECRET,
                                                                                      "node-a"),
                                                      "x-agentenv-team": "alpha"},
                          timeout=60, trust_env=False) as api:
            created = api.post("/sandboxes", json={"templateID": "base", "timeout": 60})
            assert created.status_code == 201, created.text
            sandbox_id = created.json()["sandboxID"]
            # Created on the node directly (no gateway): the heartbeat's list adds the binding.
            where = wait_for("the binding", lambda: call(sched.address, "lookup", sandbox_id))
            # with the team the gateway named (a binding made from a heartbeat keeps it)
            assert (where.node_id, where.node_up, where.team_id) == ("node-a", True, "alpha")
            assert where.node_address == info.address
            counted = wait_for("the running count", lambda: [
                n for n in call(sched.address, "list_nodes") if n.status.running == 1])
            assert counted[0].status.cpu_free == info.status.cpu_free - 2
            assert api.delete(f"/sandboxes/{sandbox_id}").status_code == 204
        wait_for("the binding to go", lambda: call(sched.address, "lookup", sandbox_id) is None)

        node.stop()
        down = wait_for("node-a to be down", lambda: [
            n for n in call(sched.address, "list_nodes") if n.node_id == "node-a" and not n.up],
            timeout=10)
        assert down[0].down_reason.startswith("no heartbeat for")
    finally:
        node.cleanup()
