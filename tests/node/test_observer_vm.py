"""Metrics and console logs of a real VM (the shared VM node): guest and host-side memory,
disk, and a line the guest writes to its serial console."""

from __future__ import annotations

import time

import pytest
from e2b import Sandbox

from .conftest import NodeProcess, sdk_pointed_at

pytestmark = pytest.mark.qemu  # boots VMs


def test_vm_metrics_are_real_and_console_lines_reach_the_logs(
        shared_vm_node: NodeProcess) -> None:
    with sdk_pointed_at(shared_vm_node), shared_vm_node.client() as api:
        sbx = Sandbox.create(template="base", timeout=120)
        try:
            (metric, *_) = sbx.get_metrics()
            assert metric.mem_total == 512 << 20 and 0 < metric.mem_used < metric.mem_total
            assert metric.cpu_count == 2 and metric.disk_total > 0
            raw = api.get(f"/sandboxes/{sbx.sandbox_id}/metrics").json()[-1]
            assert raw["memUsedHost"] > 0 and raw["memCache"] > 0  # guest's cache, from envd
            sbx.commands.run("echo aenv-console-marker > /dev/console", user="root")
            deadline = time.monotonic() + 30
            while True:  # the next sample reads the console; the route samples when stale
                logs = api.get(f"/v2/sandboxes/{sbx.sandbox_id}/logs",
                               params={"search": "aenv-console-marker"}).json()["logs"]
                if logs or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert logs and logs[0]["fields"] == {"source": "console"}
        finally:
            sbx.kill()
