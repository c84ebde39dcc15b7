"""The node with `--backend vm` (QEMU VMs through agentenv.runtime) driven by the official e2b SDK:
the built-in `base` template (Debian + python3/git/curl) is built on first start, sandboxes are
restores of its boot snapshot, pause keeps memory (a background process survives pause/connect),
fork starts children from a running sandbox's memory. A node killed with SIGKILL re-adopts its
running VMs; a VM that dies on its own leaves the API; the `base` template cannot be deleted;
scripts/up.sh and scripts/down.sh (`make up`, `make down`) run on the module's state directory."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import conftest
from .conftest import COUNTER, NodeProcess, counter_value, pid_alive, wait_counting

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

NET_PREFIX = "avt"
FIRST_SLOT = 24001  # slot addresses disjoint from other runtimes' (tests/runtime starts at 1)

def vm_node_process(state_dir: Path, log_path: Path) -> NodeProcess:
    return conftest.vm_node_process(state_dir, log_path, NET_PREFIX, FIRST_SLOT)


@pytest.fixture(scope="module")
def vm_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("vmnode")
    node = vm_node_process(base / "state", base / "node.log")
    t0 = time.monotonic()
    with conftest.serving_vm_node(node, NET_PREFIX):
        print(f"\nvm node ready (base template built) in {time.monotonic() - t0:.1f} s")
        yield node
    # The graceful stop paused what still ran; nothing of the node survives it.
    assert not subprocess.run(["pgrep", "-f", str(node.state_dir)], capture_output=True).stdout


def test_create_run_files_pause_connect_kill(vm_node: NodeProcess) -> None:
    from e2b import Sandbox, SandboxState

    timings: dict[str, float] = {}
    creates: list[float] = []
    extra: list[Sandbox] = []
    for _ in range(3):
        t0 = time.perf_counter()
        extra.append(Sandbox.create(template="base", timeout=300, envs={"GREETING": "hello"}))
        creates.append(time.perf_counter() - t0)
    sbx = extra.pop(0)
    try:
        info = sbx.get_info()
        assert info.state == SandboxState.RUNNING
        result = sbx.commands.run("echo hi; echo $GREETING")
        assert result.stdout.split() == ["hi", "hello"]
        # The base template's own userland: Debian 12 with python3, git and curl.
        tools = sbx.commands.run(
            "cat /etc/debian_version; python3 -c 'print(6*7)'; git --version; curl --version")
        assert tools.exit_code == 0, tools.stderr
        lines = tools.stdout.splitlines()
        assert lines[0].startswith("12.") and lines[1] == "42"
        assert lines[2].startswith("git version") and lines[3].startswith("curl ")
        # The sizes the API shows are the VM's (E2B create takes none: the template's).
        detail = Sandbox.get_info(sbx.sandbox_id)
        assert (detail.cpu_count, detail.memory_mb) == (2, 512)
        size = sbx.commands.run("nproc; grep MemTotal /proc/meminfo").stdout.split()
        assert int(size[0]) == 2 and 400 << 10 < int(size[2]) <= 512 << 10
        # The template's cold-memory reclaim came with its snapshot (docs/templates.md §7):
        # DAMON's pageout scheme runs, for pages untouched 30 s (15 aggregations of 2 s).
        damon = sbx.commands.run(
            "cd /sys/kernel/mm/damon/admin/kdamonds/0; cat state contexts/0/schemes/0/action"
            " contexts/0/schemes/0/access_pattern/age/min", user="root").stdout.split()
        assert damon == ["on", "pageout", "15"], damon
        sbx.files.write("/home/user/notes.txt", "kept across pause")
        assert sbx.files.read("/home/user/notes.txt") == "kept across pause"

        sbx.commands.run(COUNTER, background=True, timeout=0)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(Exception):
                if counter_value(sbx) >= 3:
                    break
            assert time.monotonic() < deadline, "the background counter did not start"
            time.sleep(0.2)
        before = counter_value(sbx)

        charged = _charged_disks(vm_node)
        t0 = time.perf_counter()
        sbx.pause()
        timings["pause_s"] = time.perf_counter() - t0
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED

        t0 = time.perf_counter()
        again = Sandbox.connect(sbx.sandbox_id, timeout=300)
        timings["connect_s"] = time.perf_counter() - t0
        after = counter_value(again)
        # Memory was kept: the same process counts on from where it stopped (a new one
        # would start again at 1).
        assert after >= before
        deadline = time.monotonic() + 30
        while counter_value(again) <= after:
            assert time.monotonic() < deadline, "the counter stopped after connect"
            time.sleep(0.2)
        assert again.files.read("/home/user/notes.txt") == "kept across pause"
        assert again.commands.run("echo $GREETING").stdout.strip() == "hello"
        # The resumed disk's cap still counts what the sandbox wrote before the pause (its
        # sealed upper): the node's resume passed it to blockd.
        assert _charged_disks(vm_node) == charged + 1

        sample = again.get_metrics()
        assert sample, "no metrics"
        last = sample[-1]
        assert last.cpu_count == 2 and last.mem_total == 512 << 20
        assert 0 < last.mem_used <= last.mem_total
        assert 0 < last.disk_used <= last.disk_total == 4 << 30

        assert again.kill() is True
        assert again.is_running() is False
    finally:
        for other in [sbx, *extra]:
            with contextlib.suppress(Exception):
                other.kill()
    timings["create_p50_s"] = statistics.median(creates)
    timings["create_max_s"] = max(creates)
    print("\nvm backend timings:", json.dumps({k: round(v, 3) for k, v in timings.items()}))


def _charged_disks(node: NodeProcess) -> int:
    """The node's writable blockd devices whose cap counts sealed uppers of their own."""
    from agentenv.blockd.client import BlockdClient

    with BlockdClient(node.state_dir / "vm-backend" / "blockd" / "blockd.sock") as client:
        return sum(1 for d in client.list() if not d.readonly and d.chain_used)


def test_fork_children_share_memory_and_files(vm_node: NodeProcess) -> None:
    from e2b import Sandbox

    parent = Sandbox.create(template="base", timeout=300)
    children: list[Sandbox] = []
    try:
        parent.files.write("/home/user/origin.txt", "from the parent")
        parent.commands.run(COUNTER, background=True, timeout=0)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(Exception):
                if counter_value(parent) >= 2:
                    break
            assert time.monotonic() < deadline, "the background counter did not start"
            time.sleep(0.2)
        t0 = time.perf_counter()
        results = parent.fork(count=2, timeout=120)
        fork_s = time.perf_counter() - t0
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, errors
        children = [r for r in results if isinstance(r, Sandbox)]
        assert len({c.sandbox_id for c in children} | {parent.sandbox_id}) == 3
        for child in children:
            # Each child has its own envd token and runs the parent's counter on its own copy.
            assert child.files.read("/home/user/origin.txt") == "from the parent"
            first = counter_value(child)
            deadline = time.monotonic() + 30
            while counter_value(child) <= first:
                assert time.monotonic() < deadline, "the counter does not run in the fork"
                time.sleep(0.2)
            child.files.write("/home/user/origin.txt", f"child {child.sandbox_id}")
        # Children and parent do not share disks.
        assert parent.files.read("/home/user/origin.txt") == "from the parent"
        assert parent.is_running()
        print(f"\nvm backend fork of 2: {fork_s:.3f} s")
    finally:
        for sbx in [*children, parent]:
            with contextlib.suppress(Exception):
                sbx.kill()


def test_node_restart_keeps_paused_sandboxes_and_the_template(vm_node: NodeProcess) -> None:
    """A graceful stop pauses what runs; the next start reuses the cached base template and
    a connect resumes the sandbox with its processes."""
    from e2b import Sandbox

    sbx = Sandbox.create(template="base", timeout=300)
    try:
        sbx.commands.run(COUNTER, background=True, timeout=0)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(Exception):
                if counter_value(sbx) >= 2:
                    break
            assert time.monotonic() < deadline, "the background counter did not start"
            time.sleep(0.2)
        before = counter_value(sbx)
        assert vm_node.stop() in (0, -15)
        t0 = time.monotonic()
        vm_node.start()
        restart_s = time.monotonic() - t0
        assert "base template reused" in vm_node.log_path.read_text()
        again = Sandbox.connect(sbx.sandbox_id, timeout=300)
        assert counter_value(again) >= before
        print(f"\nvm node restart (template cached): {restart_s:.1f} s")
    finally:
        with contextlib.suppress(Exception):
            Sandbox.kill(sbx.sandbox_id)


def test_a_second_node_of_the_host_takes_the_base_template_from_its_cache(
        vm_node: NodeProcess, tmp_path: Path) -> None:
    """The nodes of one host share the built-in templates (AENV_VM_TEMPLATE_CACHE): a second
    node boots no template VM, and its sandboxes restore the shared boot snapshot in place."""
    from e2b import Sandbox

    other = conftest.vm_node_process(tmp_path / "state", tmp_path / "node.log", "avs", 24401,
                                     extra_env=conftest.NO_READY_POOLS)
    with conftest.serving_vm_node(other, "avs"):
        log = other.log_path.read_text()
        assert "base template taken from the host's cache" in log, log[-3000:]
        assert "booting the template VM" not in log
        template = json.loads((other.state_dir / "templates" / "base" / "template.json")
                              .read_text())
        assert Path(template["record_dir"]).parent == conftest.template_cache()
        sbx = Sandbox.create(template="base", timeout=120)
        try:
            assert sbx.commands.run("echo from the shared template").stdout.strip() == \
                "from the shared template"
        finally:
            sbx.kill()


def _qemu_pid(node: NodeProcess, sandbox_id: str) -> int:
    manifest = node.state_dir / "vm-backend" / "sandboxes" / f"{sandbox_id}.vm.json"
    return int(json.loads(manifest.read_text())["pid"])


# Runs as a sandbox's QEMU (its uid, gid and groups, no capabilities): what it could open.
_PROBE = r"""
import json, sys
out = {}
for path in json.loads(sys.argv[1]):
    try:
        with open(path, "rb") as f:
            f.read(1)
        out[path] = "ok"
    except OSError as exc:
        out[path] = type(exc).__name__
print(json.dumps(out))
"""


def _as_qemu(pid: int, argv: list[str]) -> str:
    ids: dict[str, list[str]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        ids[key] = value.split()
    groups = ["--groups", ",".join(ids["Groups"])] if ids["Groups"] else ["--clear-groups"]
    out = subprocess.run(["setpriv", "--reuid", ids["Uid"][0], "--regid", ids["Gid"][0],
                          *groups, "--inh-caps=-all", "--bounding-set=-all", "--", *argv],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_sandboxs_qemu_reads_nothing_of_the_node(vm_node: NodeProcess) -> None:
    """The node's database, secrets and logs, and the host's template cache, are out of reach
    of a sandbox's QEMU uid."""
    from e2b import Sandbox

    sbx = Sandbox.create(template="base", timeout=300)
    try:
        pid = _qemu_pid(vm_node, sbx.sandbox_id)
        state = vm_node.state_dir
        targets = [state / "node.db", *sorted((state / "secrets").iterdir()),
                   *sorted(p for p in state.rglob("*.log") if p.is_file()), vm_node.log_path,
                   *sorted(p for p in conftest.template_cache().rglob("*") if p.is_file())]
        assert len(targets) > 6
        opened = json.loads(_as_qemu(pid, ["/usr/bin/python3", "-c", _PROBE,
                                           json.dumps([str(t) for t in targets])]))
        assert not [path for path, outcome in opened.items() if outcome == "ok"], opened
    finally:
        sbx.kill()


def test_node_crash_readopts_running_vms(vm_node: NodeProcess) -> None:
    """kill -9 of the node leaves its QEMU processes running; the next start takes them over
    (QMP, network slot, blockd disks, memory lineage): the sandbox is listed, its files and
    processes are there, and it pauses and resumes; a sandbox paused before the crash resumes."""
    from e2b import Sandbox, SandboxState

    running = Sandbox.create(template="base", timeout=300)
    paused = Sandbox.create(template="base", timeout=300)
    try:
        running.files.write("/home/user/before-crash.txt", "still here")
        running.commands.run(COUNTER, background=True, timeout=0)
        before = wait_counting(running)
        paused.files.write("/home/user/paused.txt", "paused before the crash")
        paused.pause()
        pid = _qemu_pid(vm_node, running.sandbox_id)

        uid = Path(f"/proc/{pid}").stat().st_uid
        leases = Path("/run/aenv/vm-uids")  # RuntimeConfig.vm_uid_lease_dir
        vm_node.kill9()
        assert pid_alive(pid), "the sandbox's QEMU died with the node"
        t0 = time.monotonic()
        vm_node.start()
        restart_s = time.monotonic() - t0
        assert "VM adopted" in vm_node.log_path.read_text()
        # The jailed QEMU's uid stays leased across the crash (no other VM gets it).
        assert (leases / str(uid)).exists()
        assert pid_alive(pid)
        states = {s.sandbox_id: s.state for s in Sandbox.list().next_items()}
        assert states == {running.sandbox_id: SandboxState.RUNNING,
                          paused.sandbox_id: SandboxState.PAUSED}

        again = Sandbox.connect(running.sandbox_id, timeout=300)
        assert again.files.read("/home/user/before-crash.txt") == "still here"
        # The same process counts on (a new one would start again at 1).
        after = counter_value(again)
        assert after >= before
        deadline = time.monotonic() + 30
        while counter_value(again) <= after:
            assert time.monotonic() < deadline, "the counter stopped across the node crash"
            time.sleep(0.2)
        # An adopted VM is a VM like any other: it pauses (memory capture through the adopted
        # QEMU) and resumes.
        again.pause()
        deadline = time.monotonic() + 15
        while pid_alive(pid):  # QEMU quits right after the pause snapshot is durable
            assert time.monotonic() < deadline, "the adopted QEMU outlived its pause"
            time.sleep(0.1)
        deadline = time.monotonic() + 15
        while (leases / str(uid)).exists():  # given back once the adopted QEMU is gone
            assert time.monotonic() < deadline, "the adopted VM's uid stayed leased"
            time.sleep(0.1)
        resumed = Sandbox.connect(running.sandbox_id, timeout=300)
        assert counter_value(resumed) >= after
        assert resumed.files.read("/home/user/before-crash.txt") == "still here"

        woken = Sandbox.connect(paused.sandbox_id, timeout=300)
        assert woken.files.read("/home/user/paused.txt") == "paused before the crash"
        print(f"\nvm node restart after kill -9 with 1 VM to adopt: {restart_s:.1f} s")
    finally:
        for sid in (running.sandbox_id, paused.sandbox_id):
            with contextlib.suppress(Exception):
                Sandbox.kill(sid)


def test_killed_sandboxes_leave_only_template_snapshots(vm_node: NodeProcess) -> None:
    """Pause snapshots and fork points are deleted with their sandboxes. (Before the tests
    that kill a sandbox mid-pause: a snapshot written after its kill began is left to the
    garbage collector, which spares files younger than AENV_GC_GRACE_SECONDS.)"""
    from e2b import Sandbox

    assert Sandbox.list().next_items() == []
    template = json.loads((vm_node.state_dir / "templates" / "base" / "template.json").read_text())
    snapshots = vm_node.state_dir / "vm-backend" / "runtime" / "snapshots"
    # the boot snapshot is the host's (AENV_VM_TEMPLATE_CACHE), not among the node's own
    assert Path(template["record_dir"]).parent == conftest.template_cache()
    assert [str(p) for p in snapshots.iterdir()] == []


def test_dead_vm_leaves_running_and_the_proxy_answers_502(vm_node: NodeProcess) -> None:
    """kill -9 of a sandbox's QEMU: the runtime's on_vm_died reaches the orchestrator, which
    removes the sandbox; the proxy answers 502 "The sandbox was not found"."""
    import httpx
    from e2b import NotFoundException, Sandbox

    sbx = Sandbox.create(template="base", timeout=300)
    try:
        pid = _qemu_pid(vm_node, sbx.sandbox_id)
        os.kill(pid, 9)
        deadline = time.monotonic() + 15
        while sbx.sandbox_id in {s.sandbox_id for s in Sandbox.list().next_items()}:
            assert time.monotonic() < deadline, "the dead sandbox is still listed"
            time.sleep(0.1)
        assert sbx.is_running() is False
        answer = httpx.get(f"{vm_node.url}/health", headers={
            "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}, trust_env=False)
        assert answer.status_code == 502
        assert answer.json()["message"] == "The sandbox was not found"
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sbx.sandbox_id)
        assert not (vm_node.state_dir / "vm-backend" / "sandboxes"
                    / f"{sbx.sandbox_id}.vm.json").exists()
        assert "sandbox lost" in vm_node.log_path.read_text()
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()


@pytest.mark.parametrize("how", ["kill", "pause", "qemu dies"])
def test_a_stopped_sandbox_ends_its_background_command_at_once(
    vm_node: NodeProcess, how: str
) -> None:
    """A VM's TCP connections do not end when it is killed or paused (nothing sends a FIN):
    the proxy closes its streams itself, so `handle.wait()` raises E2B's "sandbox was killed"
    error within 5 s instead of waiting for its own timeout."""
    import threading

    from e2b import Sandbox
    from e2b.exceptions import SandboxNotRunningException

    sbx = Sandbox.create(template="base", timeout=300)
    try:
        handle = sbx.commands.run("sleep 200", background=True, timeout=0)

        stopped_at: list[float] = []

        def stop() -> None:
            stopped_at.append(time.monotonic())  # the 5 s count from the kill or pause
            if how == "kill":
                sbx.kill()
            elif how == "pause":
                sbx.pause()
            else:
                os.kill(_qemu_pid(vm_node, sbx.sandbox_id), 9)

        threading.Timer(1.0, stop).start()
        with pytest.raises(SandboxNotRunningException, match="was killed or reached its end"):
            handle.wait()
        assert time.monotonic() - stopped_at[0] < 5
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()


def test_base_template_cannot_be_deleted(vm_node: NodeProcess) -> None:
    with vm_node.client() as api:
        answer = api.delete("/templates/base")
        assert answer.status_code == 400
        body = answer.json()
        assert body["code"] == 400 and "cannot be deleted" in body["message"]
        listed = {t["templateID"]: t for t in api.get("/templates").json()}
        assert listed["base"]["cpuCount"] == 2 and listed["base"]["memoryMB"] == 512


# A guest loop appending numbered records, each made durable with fsync (coreutils `sync FILE`
# reports a failure); /tmp/acked is the last number whose fsync succeeded (renamed into place:
# a reader never sees it half written), /tmp/err the failure.
FSYNC_WRITER = (
    "i=0; while [ ! -e /tmp/stop ]; do i=$((i+1));"
    " echo rec-$i >> /home/user/records || { echo write-$i > /tmp/err; break; };"
    " sync /home/user/records || { echo fsync-$i > /tmp/err; break; };"
    " echo $i > /tmp/acked.new; mv /tmp/acked.new /tmp/acked; done"
)


def _acked(sbx: object) -> int:
    return int(sbx.commands.run("cat /tmp/acked 2>/dev/null || echo 0").stdout.strip())  # type: ignore[attr-defined]


def test_blockd_killed_is_restarted_under_running_sandboxes(vm_node: NodeProcess) -> None:
    """kill -9 of the node's blockd while a sandbox writes with fsync: /health says 503 with
    the reason at once, the node starts blockd again (same devices, same sockets), the
    sandbox's QEMU reconnects and goes on without an error, every acknowledged record is on
    disk, and a create during the outage waits and hands out a working sandbox."""
    import httpx
    from e2b import Sandbox, SandboxState

    pidfile = vm_node.state_dir / "vm-backend" / "blockd" / "blockd.pid"
    sbx = Sandbox.create(template="base", timeout=300)
    created: Sandbox | None = None
    try:
        sbx.commands.run(FSYNC_WRITER, background=True, timeout=0)  # as COUNTER
        deadline = time.monotonic() + 60
        while _acked(sbx) < 5:
            assert time.monotonic() < deadline, "the writer did not start"
            time.sleep(0.2)
        old_pid = int(pidfile.read_text())
        os.kill(old_pid, 9)
        t0 = time.monotonic()
        reason = ""
        while time.monotonic() - t0 < 5:
            answer = httpx.get(vm_node.url + "/health", timeout=5)
            if answer.status_code == 503:
                reason = answer.json()["reason"]
                break
            time.sleep(0.05)
        assert "blockd" in reason, "a dead blockd must make /health unhealthy with the reason"
        # A create during the outage waits for blockd and gets a working sandbox.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            creating = pool.submit(Sandbox.create, template="base", timeout=300)
            while httpx.get(vm_node.url + "/health", timeout=5).status_code != 200:
                assert time.monotonic() - t0 < 60, "blockd was not started again"
                time.sleep(0.05)
            healthy_s = time.monotonic() - t0
            created = creating.result(300)
            create_s = time.monotonic() - t0
        created.files.write("/home/user/new.txt", "written after the restart")
        assert created.commands.run("sync; cat /home/user/new.txt").stdout == \
            "written after the restart"
        new_pid = int(pidfile.read_text())
        assert new_pid != old_pid and pid_alive(new_pid)

        at = _acked(sbx)
        deadline = time.monotonic() + 120  # TCG guest on a loaded host: seconds per record
        while _acked(sbx) <= at + 2:
            if time.monotonic() > deadline:
                why = sbx.commands.run("cat /tmp/err; dmesg | tail -n 20", user="root").stdout
                raise AssertionError(f"the writer did not go on after the restart "
                                     f"(acked {at} -> {_acked(sbx)}): {why}")
            time.sleep(0.2)
        sbx.commands.run("touch /tmp/stop; sleep 1")
        assert sbx.commands.run("cat /tmp/err 2>/dev/null || true").stdout.strip() == ""
        dmesg = sbx.commands.run("dmesg | grep -iE 'I/O error|EXT4-fs error' || true",
                                 user="root").stdout
        assert dmesg.strip() == "", dmesg
        last = _acked(sbx)
        records = sbx.commands.run("echo 3 > /proc/sys/vm/drop_caches; cat /home/user/records",
                                   user="root").stdout.split()
        assert records[:last] == [f"rec-{i}" for i in range(1, last + 1)]
        assert sbx.get_info().state == SandboxState.RUNNING
        # The remade NBD socket of its writable disk is again its jailed QEMU's alone.
        pid = _qemu_pid(vm_node, sbx.sandbox_id)
        manifest = vm_node.state_dir / "vm-backend" / "sandboxes" / f"{sbx.sandbox_id}.vm.json"
        argv = (Path(json.loads(manifest.read_text())["workdir"]) / "argv").read_text()
        writable = re.findall(r"server\.path=([^,\s]+),export=[^,]+,read-only=off", argv)
        assert writable
        for sock in writable:
            st = os.stat(sock)
            assert (st.st_uid, oct(st.st_mode & 0o777)) == \
                (Path(f"/proc/{pid}").stat().st_uid, "0o600")
        print(f"\nblockd kill -9: healthy again after {healthy_s:.2f} s, a create begun during "
              f"the outage done after {create_s:.2f} s, {last} records acknowledged, none lost")
    finally:
        for one in (sbx, created):
            if one is not None:
                with contextlib.suppress(Exception):
                    one.kill()


def test_blockd_back_without_a_sandboxs_disk_is_reported(vm_node: NodeProcess) -> None:
    """blockd comes back with different state (a device record lost while it was down): the
    node sees it at once, /health names the sandbox, the sandbox is still listed (not deleted),
    and killing it makes the node healthy again."""
    import httpx
    from e2b import Sandbox

    sbx = Sandbox.create(template="base", timeout=300)
    try:
        manifest = json.loads((vm_node.state_dir / "vm-backend" / "sandboxes"
                               / f"{sbx.sandbox_id}.vm.json").read_text())
        [device] = [d["device_id"] for d in manifest["disks"] if d.get("device_id")]
        blockd_root = vm_node.state_dir / "vm-backend" / "blockd"
        pid = int((blockd_root / "blockd.pid").read_text())
        os.kill(pid, 9)
        (blockd_root / "state" / "devices" / f"{device}.json").unlink()
        deadline = time.monotonic() + 60
        while True:
            answer = httpx.get(vm_node.url + "/health", timeout=5)
            if answer.status_code == 503 and sbx.sandbox_id in answer.json()["reason"]:
                break
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.1)
        assert device in answer.json()["reason"]
        assert sbx.sandbox_id in {s.sandbox_id for s in Sandbox.list().next_items()}
        assert "lost its disks in a blockd restart" in vm_node.log_path.read_text()
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()
    assert httpx.get(vm_node.url + "/health", timeout=5).status_code == 200


def test_make_up_and_down(vm_node: NodeProcess) -> None:
    """scripts/up.sh (`make up`) on the module's state directory (its base template is built):
    blockd and a VM-backend node in the background, the three E2B variables printed, an SDK
    sandbox works; a second run only reports the running node; scripts/down.sh (`make down`)
    pauses the sandbox and stops both daemons."""
    import re
    import sqlite3

    from e2b import Sandbox

    from .conftest import free_port

    repo = Path(__file__).resolve().parents[2]
    state = vm_node.state_dir
    if vm_node.proc is not None:
        assert vm_node.stop() in (0, -15)
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("AENV_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_VOLUME_API_URL",
                        "E2B_API_KEY")}
    env |= {"AENV_HOME": str(state), "AENV_PORT": str(port),
            "AENV_VM_ASSETS_DIR": str(conftest.GUEST_STATE),
            "AENV_VM_DEBIAN_CACHE": str(conftest.DEBIAN_CACHE),
            # make up builds code-interpreter-v1 too: the session's other nodes may have
            "AENV_VM_TEMPLATE_CACHE": str(conftest.template_cache()),
            "AENV_VM_NETWORK_PREFIX": NET_PREFIX, "AENV_VM_FIRST_SLOT": str(FIRST_SLOT)}

    def script(name: str) -> tuple[subprocess.CompletedProcess[str], float]:
        t0 = time.monotonic()
        done = subprocess.run(["bash", str(repo / "scripts" / name)], env=env, cwd=repo,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done, time.monotonic() - t0

    up, up_s = script("up.sh")
    exports = dict(re.findall(r"export (E2B_\w+)=(\S+)", up.stdout))
    assert exports == {"E2B_API_URL": f"http://127.0.0.1:{port}",
                       "E2B_SANDBOX_URL": f"http://127.0.0.1:{port}",
                       "E2B_VOLUME_API_URL": f"http://127.0.0.1:{port}",
                       "E2B_API_KEY": vm_node.api_key}
    node_pid = int((state / "node.pid").read_text())
    blockd_pid = int((state / "blockd.pid").read_text())
    assert pid_alive(node_pid) and pid_alive(blockd_pid)
    assert "--backend vm" in Path(f"/proc/{node_pid}/cmdline").read_bytes().replace(
        b"\0", b" ").decode()
    try:
        with conftest.environ_set(exports):
            sbx = Sandbox.create(template="base", timeout=300)
            assert sbx.commands.run("echo up").stdout.strip() == "up"

            again, again_s = script("up.sh")
            assert "already running" in again.stdout and again_s < 15
            assert int((state / "node.pid").read_text()) == node_pid
            assert dict(re.findall(r"export (E2B_\w+)=(\S+)", again.stdout)) == exports

            # blockd killed under the running node: make up (or the node's supervisor, first)
            # starts it again; the node and its sandbox go on.
            os.kill(blockd_pid, 9)
            third, _ = script("up.sh")
            assert "node already running" in third.stdout, third.stdout
            blockd_pid = int((state / "blockd.pid").read_text())
            assert pid_alive(blockd_pid)
            assert sbx.commands.run("echo again").stdout.strip() == "again"

            down, down_s = script("down.sh")
            assert "node stopped" in down.stdout and "blockd stopped" in down.stdout
            assert not pid_alive(node_pid) and not pid_alive(blockd_pid)
            with contextlib.closing(sqlite3.connect(state / "node.db")) as db:
                rows = dict(db.execute("SELECT id, state FROM sandboxes").fetchall())
            assert rows == {sbx.sandbox_id: "paused"}
            assert "node not running" in script("down.sh")[0].stdout
            print(f"\nmake up (template cached) {up_s:.1f} s, again {again_s:.1f} s, "
                  f"down {down_s:.1f} s")
    finally:
        subprocess.run(["bash", str(repo / "scripts" / "down.sh")], env=env, capture_output=True)
