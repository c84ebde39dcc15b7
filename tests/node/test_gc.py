"""Layer garbage collection (node/gc.py), the pause crash window and blockd restarts.

Process backend: a real node process (orphans at startup, references kept) and one in-process
app (the grace period). VM backend (QEMU, blockd, the official e2b SDK), one node for the module
(network prefix "agc", slots from 31001) with AENV_GC_GRACE_SECONDS=0 so a pass deletes at once
what nothing references: pause snapshots, fork points, snapshots deleted under running
sandboxes, the node killed right after a pause snapshot, blockd restarted under a running VM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from agentenv.blockd.launch import BlockdProcess
from agentenv.node.server import ServeOptions, build_app
from tests.node import conftest
from tests.node.conftest import COUNTER, NodeProcess, counter_value, pid_alive, wait_counting
from tests.node.test_api import run


def vm_test(test: Any) -> Any:
    """QEMU, root and slow: the marks of a VM-backend test."""
    return pytest.mark.qemu(pytest.mark.root(pytest.mark.slow(test)))


def _metric(node: NodeProcess, name: str) -> float:
    text = httpx.get(node.url + "/metrics", headers={"X-API-KEY": node.api_key},
                     trust_env=False).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} missing")


def _plant(path: Path, size: int = 1 << 20) -> None:
    """A leftover a crashed node could leave: a directory holding one file of `size` bytes."""
    path.mkdir(parents=True)
    with open(path / "data", "wb") as f:
        f.write(os.urandom(size))


def test_startup_pass_deletes_orphans_and_keeps_what_is_referenced(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "state", tmp_path / "node.log",
                       extra_env={"AENV_GC_GRACE_SECONDS": "0"})
    try:
        node.start()
        with node.client() as api:
            a = api.post("/v2/sandboxes", json={"timeout": 600}).json()
            b = api.post("/v2/sandboxes", json={"timeout": 600}).json()
            run(node, a["sandboxID"], a["envdAccessToken"], "echo kept > /home/user/k.txt")
            snap = api.post(f"/sandboxes/{a['sandboxID']}/snapshots", json={}).json()
            assert api.post(f"/sandboxes/{b['sandboxID']}/pause", json={}).status_code == 204
        assert node.stop() in (0, -15)

        backend = node.state_dir / "process-backend"
        ghosts = [backend / "sandboxes" / "ighost", backend / "snapshots" / "sghost"]
        for ghost in ghosts:
            _plant(ghost)
        node.start()
        for ghost in ghosts:
            assert not ghost.exists(), ghost
        assert _metric(node, "aenv_node_gc_reclaimed_files_total") >= 2
        assert _metric(node, "aenv_node_gc_reclaimed_bytes_total") >= 2 << 20
        snapshot_dir = backend / "snapshots" / snap["snapshotID"]
        assert snapshot_dir.is_dir()
        for sid in (a["sandboxID"], b["sandboxID"]):
            assert (backend / "sandboxes" / sid).is_dir()
        with node.client() as api:
            assert api.post(f"/v2/sandboxes/{a['sandboxID']}/connect", json={}).status_code == 201
            assert run(node, a["sandboxID"], a["envdAccessToken"], "cat /home/user/k.txt") == "kept\n"
            # A sandbox made from the snapshot, then the snapshot deleted: the sandbox runs on.
            c = api.post("/v2/sandboxes", json={"templateID": snap["snapshotID"]}).json()
            assert api.delete(f"/templates/{snap['snapshotID']}").status_code == 204
            assert not snapshot_dir.exists()
            assert run(node, c["sandboxID"], c["envdAccessToken"], "cat /home/user/k.txt") == "kept\n"
            for sid in (a["sandboxID"], b["sandboxID"], c["sandboxID"]):
                assert api.delete(f"/sandboxes/{sid}").status_code == 204
        assert sorted(p.name for p in (backend / "sandboxes").iterdir()) == []
    finally:
        node.cleanup()


def test_grace_period_and_references_in_process(tmp_path: Path) -> None:
    """A fresh orphan (it could be a snapshot being written) is kept until the grace period is
    over; a template's snapshot and a live sandbox's files are never taken."""
    state = tmp_path / "state"
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    key = (state / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        gc = app.orchestrator.gc
        sid = client.post("/v2/sandboxes", json={"timeout": 600}).json()["sandboxID"]
        snap = client.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"]
        backend = state / "process-backend"
        orphan = backend / "snapshots" / "sorphan"
        _plant(orphan, 4096)

        gc.grace_seconds = 3600
        report = client.portal.call(gc.collect, "test")
        assert orphan.exists() and str(orphan) in report.kept_fresh
        assert report.files == 0

        old = time.time() - 7200
        for path in (orphan, orphan / "data"):
            os.utime(path, (old, old))
        report = client.portal.call(gc.collect, "test")
        assert not orphan.exists()
        assert report.deleted == [str(orphan)] and report.files == 1 and report.bytes >= 4096

        gc.grace_seconds = 0
        report = client.portal.call(gc.collect, "test")
        assert report.deleted == []
        assert (backend / "snapshots" / snap).is_dir() and (backend / "sandboxes" / sid).is_dir()
        assert client.delete(f"/sandboxes/{sid}").status_code == 204


# --- the VM backend ----------------------------------------------------------------------------
NET_PREFIX = "agc"
FIRST_SLOT = 31001
@pytest.fixture(scope="module")
def gc_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("gcnode")
    node = conftest.vm_node_process(
        base / "state", base / "node.log", NET_PREFIX, FIRST_SLOT,
        extra_env={"AENV_GC_GRACE_SECONDS": "0", **conftest.NO_READY_POOLS})
    with conftest.serving_vm_node(node, NET_PREFIX):
        yield node


def _snapshot_dirs(node: NodeProcess) -> set[str]:
    root = node.state_dir / "vm-backend" / "runtime" / "snapshots"
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def _gc_reclaimed(node: NodeProcess) -> float:
    text = httpx.get(node.url + "/metrics", headers={"X-API-KEY": node.api_key},
                     trust_env=False).text
    for line in text.splitlines():
        if line.startswith("aenv_node_gc_reclaimed_files_total "):
            return float(line.split()[1])
    raise AssertionError("no GC metric")


def _wait(predicate: Any, seconds: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {seconds} s"
        time.sleep(0.1)


@vm_test
def test_killed_and_forked_sandboxes_leave_nothing_behind(gc_node: NodeProcess) -> None:
    """create -> pause -> kill: its pause snapshot is gone. fork -> kill the parent: the fork
    point stays while children run (a child pauses and resumes from it), goes with them."""
    from e2b import Sandbox

    before = _snapshot_dirs(gc_node)
    sbx = Sandbox.create(template="base", timeout=300)
    sbx.files.write("/home/user/a.txt", "a")
    sbx.pause()
    paused = _snapshot_dirs(gc_node) - before
    assert len(paused) == 1
    Sandbox.kill(sbx.sandbox_id)
    _wait(lambda: _snapshot_dirs(gc_node) == before, what="pause snapshot deleted")
    assert not (gc_node.state_dir / "vm-backend" / "sandboxes" / f"{sbx.sandbox_id}.json").exists()

    parent = Sandbox.create(template="base", timeout=300)
    children: list[Any] = []
    try:
        parent.files.write("/home/user/origin.txt", "from the parent")
        children = [c for c in parent.fork(count=2, timeout=300) if isinstance(c, Sandbox)]
        assert len(children) == 2
        fork_points = _snapshot_dirs(gc_node) - before
        assert len(fork_points) == 1
        reclaimed = _gc_reclaimed(gc_node)
        parent.kill()
        time.sleep(2.5)  # a debounced pass runs after the kill
        assert fork_points <= _snapshot_dirs(gc_node), "the fork point went while children run"
        child = children[0]
        child.pause()  # the child's pause snapshot names the fork point's layers
        again = Sandbox.connect(child.sandbox_id, timeout=300)
        assert again.files.read("/home/user/origin.txt") == "from the parent"
        for c in children:
            c.kill()
        _wait(lambda: _snapshot_dirs(gc_node) == before, what="fork point and pauses deleted")
        assert _gc_reclaimed(gc_node) >= reclaimed
    finally:
        for other in [parent, *children]:
            with contextlib.suppress(Exception):
                other.kill()


@vm_test
def test_deleted_snapshots_keep_layers_others_use(gc_node: NodeProcess) -> None:
    """A snapshot deleted while a sandbox made from it runs keeps its layers until that
    sandbox is gone; a snapshot whose layers a later snapshot names keeps them until both go."""
    from e2b import Sandbox

    before = _snapshot_dirs(gc_node)
    with gc_node.client() as api:
        # Not secure: a sandbox made from a snapshot of a secure one is refused by the
        # snapshot's envd (it keeps the source's token; a known gap of the VM backend).
        created = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300,
                                                  "secure": False})
        assert created.status_code == 201, created.text
    src = Sandbox.connect(created.json()["sandboxID"], timeout=300)
    users: list[Any] = []
    try:
        with gc_node.client() as api:
            src.files.write("/home/user/s.txt", "one")
            first = api.post(f"/sandboxes/{src.sandbox_id}/snapshots", json={}).json()["snapshotID"]
            src.files.write("/home/user/s.txt", "two")
            second = api.post(f"/sandboxes/{src.sandbox_id}/snapshots", json={}).json()["snapshotID"]
            src.kill()
            made = _snapshot_dirs(gc_node) - before
            assert len(made) == 2
            user = Sandbox.create(template=first, timeout=300)
            users.append(user)
            assert api.delete(f"/templates/{first}").status_code == 204
            time.sleep(2.5)
            assert made <= _snapshot_dirs(gc_node)  # `user` runs on the first's layers
            user.pause()
            again = Sandbox.connect(user.sandbox_id, timeout=300)
            assert again.files.read("/home/user/s.txt") == "one"
            again.kill()
            # The second snapshot names the first's sealed disk layer: still kept.
            time.sleep(2.5)
            assert made <= _snapshot_dirs(gc_node)
            assert api.delete(f"/templates/{second}").status_code == 204
            _wait(lambda: _snapshot_dirs(gc_node) == before, what="both snapshots deleted")
    finally:
        for other in [src, *users]:
            with contextlib.suppress(Exception):
                other.kill()


@vm_test
def test_node_killed_right_after_the_pause_snapshot_loses_nothing(gc_node: NodeProcess) -> None:
    """Fault injection: AENV_TEST_CRASH_AT=pause-snapshot-written makes the node os._exit right
    after the runtime wrote the pause snapshot, before the node recorded it (the window a kill -9
    would hit). The next start finds the snapshot: the sandbox is paused and resumes with its
    files and its running process."""
    from e2b import Sandbox, SandboxState

    assert gc_node.stop() in (0, -15)
    gc_node.extra_env["AENV_TEST_CRASH_AT"] = "pause-snapshot-written"
    try:
        gc_node.start()
        sbx = Sandbox.create(template="base", timeout=300)
        sbx.files.write("/home/user/crash.txt", "kept")
        sbx.commands.run(COUNTER, background=True, timeout=0)
        before = wait_counting(sbx)
        with gc_node.client() as api, pytest.raises(httpx.HTTPError):
            api.post(f"/sandboxes/{sbx.sandbox_id}/pause", json={})
        assert gc_node.proc is not None and gc_node.proc.wait(timeout=30) == 86
        gc_node.proc = None
    finally:
        del gc_node.extra_env["AENV_TEST_CRASH_AT"]
    gc_node.start()
    try:
        assert "pause completed after a node crash" in gc_node.log_path.read_text()
        # The crashed node never released the stopped VM's disks: the startup pass did.
        from agentenv.blockd.client import BlockdClient

        sock = gc_node.state_dir / "vm-backend" / "blockd" / "blockd.sock"
        with BlockdClient(sock, timeout=5) as client:
            uppers = [d.upper_dir for d in client.list() if d.upper_dir]
        assert all(Path(u).exists() for u in uppers), uppers
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        again = Sandbox.connect(sbx.sandbox_id, timeout=300)
        assert again.files.read("/home/user/crash.txt") == "kept"
        after = counter_value(again)
        assert after >= before  # the same process counts on
        _wait(lambda: counter_value(again) > after, what="counter running after resume")
    finally:
        with contextlib.suppress(Exception):
            Sandbox.kill(sbx.sandbox_id)


@vm_test
def test_blockd_restart_under_running_vms_keeps_them(gc_node: NodeProcess) -> None:
    """kill -9 of the node, then blockd restarted (it recovers its devices; the VM's NBD
    connections were cut and QEMU reconnects to the same sockets): the next start adopts the VM,
    which goes on with its disks; the node works on."""
    from e2b import Sandbox, SandboxState

    from agentenv.blockd.client import BlockdClient

    sbx = Sandbox.create(template="base", timeout=300)
    manifest = json.loads((gc_node.state_dir / "vm-backend" / "sandboxes"
                           / f"{sbx.sandbox_id}.vm.json").read_text())
    qemu_pid = int(manifest["pid"])
    devices = {d["device_id"] for d in manifest["disks"] if d.get("device_id")}
    assert devices and manifest["blockd"]["pid"]
    gc_node.kill9()
    root = gc_node.state_dir / "vm-backend" / "blockd"
    old = int((root / "blockd.pid").read_text())
    os.kill(old, signal.SIGKILL)
    _wait(lambda: not pid_alive(old), what="blockd gone")
    new = BlockdProcess(root / "state", root / "blockd.sock", root / "blockd.log", fuse=False,
                        detach=True).spawn()
    try:
        def answers() -> bool:
            try:
                with BlockdClient(root / "blockd.sock", timeout=2) as client:
                    return {d.id for d in client.list()} >= devices  # recovered, same ids
            except Exception:
                return False

        _wait(answers, what="restarted blockd recovering the devices")
        (root / "blockd.pid").write_text(f"{new.pid}\n")  # the node reuses this blockd
        gc_node.start()
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING
        assert pid_alive(qemu_pid)
        with BlockdClient(root / "blockd.sock", timeout=5) as client:
            assert devices <= {d.id for d in client.list()}
        again = Sandbox.connect(sbx.sandbox_id)
        again.files.write("after-restart", "still here")  # the home directory: on the disk
        assert again.commands.run("sync; cat after-restart").stdout == "still here"
        fresh = Sandbox.create(template="base", timeout=120)
        assert fresh.commands.run("echo ok").stdout.strip() == "ok"
        fresh.kill()
    finally:
        with contextlib.suppress(Exception):
            Sandbox.kill(sbx.sandbox_id)
        # The node stops this blockd at its graceful stop (it is the node's blockd now).
        with contextlib.suppress(Exception):
            new.wait(timeout=0.1)
