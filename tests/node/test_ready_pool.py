"""The VM backend's ready pools (node/ready_pool.py) on a real node driven by the official e2b SDK:
a create takes a pre-restored, warmed VM and gives it the sandbox's identity (env vars, token,
clock, E2B_SANDBOX_ID); two creates never share a VM; the pool refills; a pooled QEMU killed
while parked is discarded and never handed out; pooled VMs never show in the API's list; a
snapshot used as a template gets a pool of its own, dropped when the snapshot is deleted; a
graceful stop leaves no pooled QEMU behind."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from agentenv.errors import AgentEnvError
from agentenv.node.ready_pool import ReadyPoolConfig

from . import conftest
from .conftest import NodeProcess, pid_alive

NET_PREFIX = "avp"
FIRST_SLOT = 32001  # 32001-32400; bench/api_bench.py's bare runtime starts at 32401
POOL_SIZE = 2


def test_pool_config_from_env() -> None:
    config = ReadyPoolConfig.from_env({"AENV_VM_POOL_LOW": "3", "AENV_VM_POOL_HIGH": "1"})
    assert (config.low, config.high, config.enabled) == (3, 3, True)  # high never below low
    assert ReadyPoolConfig.from_env({"AENV_VM_POOL_LOW": "0"}).enabled is False
    assert ReadyPoolConfig.from_env({}).low == 2
    with pytest.raises(AgentEnvError, match="AENV_VM_POOL_LOW must be a number"):
        ReadyPoolConfig.from_env({"AENV_VM_POOL_LOW": "two"})
    with pytest.raises(AgentEnvError, match="bad ready-pool setting"):
        ReadyPoolConfig.from_env({"AENV_VM_POOL_HIGH": "-1"})


@pytest.fixture(scope="module")
def pool_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("poolnode")
    node = conftest.vm_node_process(
        base / "state", base / "node.log", NET_PREFIX, FIRST_SLOT,
        extra_env={"AENV_VM_POOL_LOW": str(POOL_SIZE), "AENV_VM_POOL_HIGH": str(POOL_SIZE)})
    with conftest.serving_vm_node(node, NET_PREFIX):
        yield node
    # The graceful stop killed the parked VMs too: nothing of the node survives it.
    assert not subprocess.run(["pgrep", "-f", str(node.state_dir)], capture_output=True).stdout
    assert not list((node.state_dir / "vm-backend" / "pool").glob("*.vm.json"))


def _log(node: NodeProcess, msg: str) -> list[dict[str, object]]:
    found = []
    for raw in node.log_path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            line = json.loads(raw)
            if isinstance(line, dict) and line.get("msg") == msg:
                found.append(line)
    return found


def _parked(node: NodeProcess) -> dict[str, int]:
    """Parked VMs, vm id -> QEMU pid, from the pool's manifests of VMs the log says are ready."""
    ready = {str(x["vm"]) for x in _log(node, "ready pool VM parked")}
    out = {}
    for path in (node.state_dir / "vm-backend" / "pool").glob("*.vm.json"):
        with contextlib.suppress(OSError, ValueError):
            manifest = json.loads(path.read_text())
            if manifest["id"] in ready:
                out[manifest["id"]] = int(manifest["pid"])
    return out


def _wait_parked(node: NodeProcess, count: int = POOL_SIZE, timeout: float = 90) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while len(parked := _parked(node)) < count:
        assert time.monotonic() < deadline, f"the pool holds {len(parked)} VMs, not {count}"
        time.sleep(0.1)
    return parked


def _pool_metric(node: NodeProcess, sample: str) -> float:
    """The sum of the node's /metrics samples whose line starts with `sample`."""
    text = httpx.get(node.url + "/metrics", headers={"X-API-KEY": node.api_key},
                     trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(sample))


def _sandbox_vm(node: NodeProcess, sandbox_id: str) -> tuple[str, int]:
    manifest = json.loads(
        (node.state_dir / "vm-backend" / "sandboxes" / f"{sandbox_id}.vm.json").read_text())
    return manifest["id"], int(manifest["pid"])


def _from_pool(node: NodeProcess, sandbox_id: str) -> bool:
    return any(x.get("sandbox_id") == sandbox_id
               for x in _log(node, "sandbox VM from the ready pool"))



@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_pooled_vms_are_not_sandboxes(pool_node: NodeProcess) -> None:
    from e2b import Sandbox

    parked = _wait_parked(pool_node)
    assert len(parked) == POOL_SIZE and all(pid_alive(pid) for pid in parked.values())
    assert _pool_metric(pool_node, "aenv_node_ready_pool_vms") == POOL_SIZE
    assert Sandbox.list().next_items() == []
    with pool_node.client() as api:
        assert api.get("/v2/sandboxes").json() == []
        assert api.get("/sandboxes").json() == []


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_pooled_create_has_the_sandbox_identity(pool_node: NodeProcess) -> None:
    from e2b import Sandbox

    parked = _wait_parked(pool_node)
    time.sleep(2)  # parked a while: a clock left at the snapshot's time would show
    sbx = Sandbox.create(template="base", timeout=120, envs={"GREETING": "hello"},
                         metadata={"purpose": "pool-test"})
    try:
        assert _from_pool(pool_node, sbx.sandbox_id)
        assert _pool_metric(pool_node, 'aenv_node_ready_pool_events_total{event="taken"') >= 1
        vm_id, pid = _sandbox_vm(pool_node, sbx.sandbox_id)
        assert parked.get(vm_id) == pid, "the sandbox does not run on a VM the pool parked"
        assert not (pool_node.state_dir / "vm-backend" / "pool" / f"{vm_id}.vm.json").exists()
        host_before = time.time()
        out = sbx.commands.run(
            "date +%s.%N; echo $GREETING; echo $E2B_SANDBOX_ID; echo $E2B_SANDBOX; echo $E2B_TEMPLATE_ID"
        ).stdout.split()
        host_after = time.time()
        guest_now = float(out[0])
        assert host_before - 1.0 <= guest_now <= host_after + 1.0, (guest_now, host_before)
        assert out[1:4] == ["hello", sbx.sandbox_id, "true"]
        # Nothing the pool did to warm the guest is left: no process, the template's files.
        assert sbx.commands.list() == []
        assert sbx.files.exists("/home/user/created-here") is False
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.metadata == {"purpose": "pool-test"}
        assert out[4:] == [info.template_id]
        # The token is the sandbox's own: a wrong one is refused.
        answer = httpx.post(f"{pool_node.url}/process.Process/List", json={}, headers={
            "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983",
            "X-Access-Token": "wrong", "Content-Type": "application/json"}, trust_env=False)
        assert answer.status_code == 401
    finally:
        sbx.kill()


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_concurrent_creates_never_share_a_vm_and_the_pool_refills(
        pool_node: NodeProcess) -> None:
    from e2b import Sandbox

    _wait_parked(pool_node)
    count = POOL_SIZE + 1  # one more than the pool holds: that one restores
    with ThreadPoolExecutor(count) as workers:
        boxes = list(workers.map(lambda _: Sandbox.create(template="base", timeout=120),
                                 range(count)))
    try:
        vms = [_sandbox_vm(pool_node, b.sandbox_id) for b in boxes]
        assert len({vm for vm, _ in vms}) == count and len({pid for _, pid in vms}) == count
        assert sum(_from_pool(pool_node, b.sandbox_id) for b in boxes) >= 1
        for box in boxes:
            box.files.write("/home/user/owner.txt", box.sandbox_id)
            assert box.commands.run("echo $E2B_SANDBOX_ID").stdout.strip() == box.sandbox_id
        for box in boxes:  # each its own disk
            assert box.files.read("/home/user/owner.txt") == box.sandbox_id
        refilled = _wait_parked(pool_node)
        assert not set(refilled) & {vm for vm, _ in vms}
    finally:
        for box in boxes:
            with contextlib.suppress(Exception):
                box.kill()


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_a_killed_pooled_vm_is_discarded(pool_node: NodeProcess) -> None:
    from e2b import Sandbox

    parked = _wait_parked(pool_node)
    victim, pid = next(iter(parked.items()))
    discarded = len(_log(pool_node, "ready pool VM discarded"))
    os.kill(pid, 9)
    deadline = time.monotonic() + 15
    while len(_log(pool_node, "ready pool VM discarded")) <= discarded:
        assert time.monotonic() < deadline, "the dead pooled VM was not discarded"
        time.sleep(0.05)
    # The discard is logged first; its manifest goes once the runtime has reaped the VM.
    manifest = pool_node.state_dir / "vm-backend" / "pool" / f"{victim}.vm.json"
    while manifest.exists():
        assert time.monotonic() < deadline, "the dead pooled VM's manifest was kept"
        time.sleep(0.05)
    boxes = [Sandbox.create(template="base", timeout=120) for _ in range(POOL_SIZE)]
    try:
        for box in boxes:
            assert _sandbox_vm(pool_node, box.sandbox_id)[0] != victim
            assert box.commands.run("echo alive").stdout.strip() == "alive"
    finally:
        for box in boxes:
            with contextlib.suppress(Exception):
                box.kill()
    _wait_parked(pool_node)


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_snapshot_template_gets_a_pool_dropped_with_it(pool_node: NodeProcess) -> None:
    """A snapshot of a secure sandbox used as a template: the create (and the pool's warm-up)
    carry the snapshot guest's token; deleting the snapshot ends its pool."""
    from e2b import Sandbox

    source = Sandbox.create(template="base", timeout=120)
    made: list[Sandbox] = []
    try:
        source.files.write("/home/user/from-snapshot.txt", "kept")
        with pool_node.client() as api:
            answer = api.post(f"/sandboxes/{source.sandbox_id}/snapshots", json={})
            assert answer.status_code == 201, answer.text
            snapshot_id = answer.json()["snapshotID"]
        first = Sandbox.create(template=snapshot_id, timeout=120)
        made.append(first)
        assert first.files.read("/home/user/from-snapshot.txt") == "kept"
        assert first.commands.run("echo $E2B_SANDBOX_ID").stdout.strip() == first.sandbox_id
        added = [x for x in _log(pool_node, "ready pool added") if not x.get("pinned")]
        assert added, "the snapshot template got no pool"
        key = str(added[-1]["pool"])
        deadline = time.monotonic() + 90
        while not [x for x in _log(pool_node, "ready pool VM parked") if x["pool"] == key]:
            assert time.monotonic() < deadline, "the snapshot's pool parked no VM"
            fails = [x for x in _log(pool_node, "ready pool fill failed") if x["pool"] == key]
            assert not fails, fails
            time.sleep(0.1)
        second = Sandbox.create(template=snapshot_id, timeout=120)
        made.append(second)
        assert _from_pool(pool_node, second.sandbox_id)
        assert second.files.read("/home/user/from-snapshot.txt") == "kept"
        assert second.commands.run("echo $E2B_SANDBOX_ID").stdout.strip() == second.sandbox_id
        for box in made:
            box.kill()
        made.clear()
        with pool_node.client() as api:
            assert api.delete(f"/templates/{snapshot_id}").status_code == 204
        deadline = time.monotonic() + 15
        while not [x for x in _log(pool_node, "ready pool dropped") if x["pool"] == key]:
            assert time.monotonic() < deadline, "the deleted snapshot's pool was not dropped"
            time.sleep(0.05)
        # Only the base template's VMs remain (once the base pool's refill is done, every
        # pool manifest is a parked base VM).
        deadline = time.monotonic() + 90
        while True:
            parked = _parked(pool_node)
            pooled = {json.loads(p.read_text())["id"]
                      for p in (pool_node.state_dir / "vm-backend" / "pool").glob("*.vm.json")}
            if set(parked) == pooled and len(pooled) == POOL_SIZE:
                break
            assert time.monotonic() < deadline, (parked, pooled)
            time.sleep(0.1)
        snapshot_vms = {str(x["vm"]) for x in _log(pool_node, "ready pool VM parked")
                        if x["pool"] == key}
        assert snapshot_vms and not snapshot_vms & pooled
    finally:
        for box in [*made, source]:
            with contextlib.suppress(Exception):
                box.kill()


def _blockd_devices(node: NodeProcess) -> set[str]:
    from agentenv.blockd.client import BlockdClient

    sock = node.state_dir / "vm-backend" / "blockd" / "blockd.sock"
    with BlockdClient(sock, timeout=10) as client:
        return {d.id for d in client.list()}


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_node_crash_ends_the_pooled_vms(pool_node: NodeProcess) -> None:
    """kill -9 of the node leaves its parked QEMUs running (VMs outlive a crash to be adopted);
    the next start ends them, frees their blockd devices and slots, and fills a new pool."""
    from e2b import Sandbox

    parked = _wait_parked(pool_node)
    time.sleep(0.5)  # let a refill that started with the last take settle
    parked = _wait_parked(pool_node)
    devices = _blockd_devices(pool_node)
    assert len(devices) >= POOL_SIZE
    pool_node.kill9()
    assert all(pid_alive(pid) for pid in parked.values())
    pool_node.start()
    assert "ended the ready-pool VMs of the previous run" in pool_node.log_path.read_text()
    assert not any(pid_alive(pid) for pid in parked.values())
    assert Sandbox.list().next_items() == []
    fresh = _wait_parked(pool_node)
    deadline = time.monotonic() + 30
    while True:  # the new pool holds as many devices as the old one: none leaked
        now = _blockd_devices(pool_node)
        if len(now) == len(devices) and not now & devices:
            break
        assert time.monotonic() < deadline, (devices, now)
        time.sleep(0.1)
    assert not set(fresh) & set(parked)
