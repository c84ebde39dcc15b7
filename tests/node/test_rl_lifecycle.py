"""The RL lifecycle on the VM backend (issue 27), with real VMs and the official e2b SDK where it
has the call (httpx for the extensions): fork trees and their garbage collection, fork from a
paused sandbox, rollback, batch creates from a snapshot. Counts are kept small (TCG is slow)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from . import conftest
from .conftest import NodeProcess

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

NET_PREFIX = "alc"  # unique: a test teardown deletes every {NET_PREFIX}-s* namespace
FIRST_SLOT = 31801  # 31801-32000: disjoint from the other VM test modules and benches


@pytest.fixture(scope="module")
def rl_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("rlnode")
    node = conftest.vm_node_process(
        base / "state", base / "node.log", NET_PREFIX, FIRST_SLOT,
        extra_env={"AENV_GC_GRACE_SECONDS": "0", **conftest.NO_READY_POOLS})
    with conftest.serving_vm_node(node, NET_PREFIX):
        yield node


def _snapshot_dirs(node: NodeProcess) -> set[str]:
    root = node.state_dir / "vm-backend" / "runtime" / "snapshots"
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def _wait(predicate: Any, seconds: float = 120.0, what: str = "condition",
          explain: Any = None) -> None:
    """Wait for `predicate`; on a timeout the failure carries `explain()` (what the guest saw)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() >= deadline:
            detail = ""
            if explain is not None:
                try:
                    detail = explain()
                except Exception as exc:  # the explanation must not hide the failure
                    detail = f"(no explanation: {exc!r})"
            raise AssertionError(f"{what} not reached in {seconds} s\n{detail}")
        time.sleep(0.2)


# What a guest whose background counter stopped shows (processes, the kernel's last words).
_COUNTER_DIAGNOSIS = ("date; cat /proc/uptime /proc/loadavg /tmp/count; "
                      "ps -eo pid,stat,wchan:24,etime,cmd | grep -v ' \\['; free -m; dmesg | tail -n 30")


def _fork(api: httpx.Client, sandbox_id: str, count: int) -> list[str]:
    answer = api.post(f"/sandboxes/{sandbox_id}/fork", json={"count": count, "timeout": 300})
    assert answer.status_code == 201, answer.text
    results = answer.json()
    assert all("sandbox" in r for r in results), results
    return [r["sandbox"]["sandboxID"] for r in results]


def test_three_level_fork_tree_keeps_layers_while_descendants_need_them(
        rl_node: NodeProcess) -> None:
    """root -> middle -> two leaves. Kill the middle (and the root): the leaves still run, pause
    and restore with the files of every level; kill the leaves: every layer of the tree goes."""
    from e2b import Sandbox

    before = _snapshot_dirs(rl_node)
    made: list[str] = []
    with rl_node.client() as api:
        try:
            root = Sandbox.create(template="base", timeout=300)
            made.append(root.sandbox_id)
            root.files.write("/home/user/level0.txt", "root")
            (middle_id,) = _fork(api, root.sandbox_id, 1)
            made.append(middle_id)
            middle = Sandbox.connect(middle_id, timeout=300)
            middle.files.write("/home/user/level1.txt", "middle")
            leaves = _fork(api, middle_id, 2)
            made.extend(leaves)
            assert {s["sandboxID"] for s in api.get(f"/sandboxes/{middle_id}/children").json()
                    } == set(leaves)
            assert api.get(f"/sandboxes/{leaves[0]}").json()["parentSandboxID"] == middle_id
            tree = _snapshot_dirs(rl_node) - before
            assert len(tree) == 2  # the two fork points

            middle.kill()
            root.kill()
            time.sleep(2.5)  # a debounced collection runs after each kill
            assert tree <= _snapshot_dirs(rl_node), "a fork point went while leaves need it"
            for i, leaf_id in enumerate(leaves):
                leaf = Sandbox.connect(leaf_id, timeout=300)
                assert leaf.files.read("/home/user/level0.txt") == "root"
                assert leaf.files.read("/home/user/level1.txt") == "middle"
                leaf.files.write("/home/user/level2.txt", f"leaf {i}")
                leaf.pause()
                again = Sandbox.connect(leaf_id, timeout=300)
                assert again.files.read("/home/user/level1.txt") == "middle"
                assert again.files.read("/home/user/level2.txt") == f"leaf {i}"
            assert tree <= _snapshot_dirs(rl_node)
            for leaf_id in leaves:
                Sandbox.kill(leaf_id)
            _wait(lambda: _snapshot_dirs(rl_node) == before, what="every layer of the tree freed")
        finally:
            for sid in made:
                with contextlib.suppress(Exception):
                    api.delete(f"/sandboxes/{sid}")


def test_a_tree_forked_from_pauses_keeps_and_frees_its_layers(rl_node: NodeProcess) -> None:
    """Fork of a paused root, then of that child once paused: killing the root and the middle
    leaves the leaf running on their pause snapshots (it pauses and resumes with every level's
    files); killing the leaf frees every layer of the tree."""
    from e2b import Sandbox

    before = _snapshot_dirs(rl_node)
    made: list[str] = []
    try:
        root = Sandbox.create(template="base", timeout=300)
        made.append(root.sandbox_id)
        root.files.write("/home/user/level0.txt", "root")
        root.pause()
        (middle,) = Sandbox.fork(root.sandbox_id, count=1, timeout=300)
        made.append(middle.sandbox_id)
        middle.files.write("/home/user/level1.txt", "middle")
        middle.pause()
        (leaf,) = Sandbox.fork(middle.sandbox_id, count=1, timeout=300)
        made.append(leaf.sandbox_id)
        Sandbox.kill(root.sandbox_id)
        Sandbox.kill(middle.sandbox_id)
        time.sleep(2.5)  # a debounced collection runs after each kill
        leaf.files.write("/home/user/level2.txt", "leaf")
        leaf.pause()
        again = Sandbox.connect(leaf.sandbox_id, timeout=300)
        assert [again.files.read(f"/home/user/level{i}.txt") for i in range(3)] == [
            "root", "middle", "leaf"]
        again.kill()
        _wait(lambda: _snapshot_dirs(rl_node) == before, what="every layer of the tree freed")
    finally:
        for sid in made:
            with contextlib.suppress(Exception):
                Sandbox.kill(sid)


#: what a restore adds beside a snapshot's state: the pages its guest touched first, read ahead
#: by later restores (runtime/memdev.py); not the snapshot's memory, disks or devices
RESTORE_CACHE = {"startup-pack.json"}


def _tree_files(path: Path) -> dict[str, str]:
    """sha256 of every file of a snapshot directory's state (memory and disk layers, device
    state, record)."""
    import hashlib

    out = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()
                       and p.name not in RESTORE_CACHE):
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out[str(file.relative_to(path))] = digest.hexdigest()
    return out


def _pause_dir(node: NodeProcess, sandbox_id: str) -> Path:
    """The directory of the sandbox's latest pause snapshot (the VM backend lists what a
    sandbox owns in <state>/vm-backend/sandboxes/<id>.json)."""
    import json

    owned = json.loads((node.state_dir / "vm-backend" / "sandboxes" / f"{sandbox_id}.json"
                        ).read_text())
    return Path(owned[-1])


#: children of the paused-parent fork (the issue's 8: about 5 s under KVM)
FORK = 8
#: children of the running fork after it: that a resumed parent forks at all (forks of a
#: running sandbox are test_lifecycle's and test_vm_backend's)
RUNNING_FORK = 2


def _random_hex(sbx: Any) -> str:
    """16 bytes of the guest kernel's random pool (what os.urandom reads), read by `od`: a
    Python start per child cost seconds under TCG."""
    return str(sbx.commands.run(
        "od -An -N16 -tx1 /dev/urandom | tr -d ' \\n'").stdout.strip())


def test_fork_of_a_paused_sandbox_leaves_it_paused_and_untouched(rl_node: NodeProcess) -> None:
    from e2b import Sandbox

    made: list[str] = []
    with rl_node.client() as api:
        try:
            parent = Sandbox.create(template="base", timeout=300)
            made.append(parent.sandbox_id)
            parent.files.write("/home/user/origin.txt", "from the parent")
            parent.commands.run(conftest.COUNTER, background=True, timeout=0)
            conftest.wait_counting(parent)
            parent.pause()
            pause_dir = _pause_dir(rl_node, parent.sandbox_id)
            hashes = _tree_files(pause_dir)
            assert any(name.startswith("memory") for name in hashes), hashes
            assert any(name.startswith("disk-") for name in hashes), hashes

            t0 = time.perf_counter()
            # The SDK's class-level fork takes a sandbox id: here, of a paused sandbox.
            forked = Sandbox.fork(parent.sandbox_id, count=FORK, timeout=300)
            paused_fork_s = time.perf_counter() - t0
            assert not [f for f in forked if isinstance(f, Exception)], forked
            children = [f.sandbox_id for f in forked]
            made.extend(children)
            assert api.get(f"/sandboxes/{parent.sandbox_id}").json()["state"] == "paused"
            kids = [Sandbox.connect(cid, timeout=300) for cid in children]
            seen_random = set()
            for i, kid in enumerate(kids):
                info = api.get(f"/sandboxes/{kid.sandbox_id}").json()
                assert info["parentSandboxID"] == parent.sandbox_id
                assert kid.files.read("/home/user/origin.txt") == "from the parent"
                first = conftest.counter_value(kid)  # the parent's process runs on in it
                _wait(lambda kid=kid, first=first: conftest.counter_value(kid) > first,
                      what="the parent's counter running in the child",
                      explain=lambda kid=kid: kid.commands.run(
                          _COUNTER_DIAGNOSIS, user="root", timeout=30).stdout)
                seen_random.add(_random_hex(kid))
                kid.files.write("/home/user/mine.txt", f"child {i}")
            assert len(seen_random) == len(kids), "children share their RNG state"
            for i, kid in enumerate(kids):  # independent: each sees only its own write
                assert kid.files.read("/home/user/mine.txt") == f"child {i}"
            assert _tree_files(pause_dir) == hashes, "the parent's pause snapshot changed"
            assert api.get(f"/sandboxes/{parent.sandbox_id}").json()["state"] == "paused"
            assert {s["sandboxID"] for s in api.get(
                f"/sandboxes/{parent.sandbox_id}/children").json()} == set(children)
            for kid in kids:  # room for the running fork's children
                kid.kill()

            # The parent resumes as it was paused; forking it running still works.
            back = Sandbox.connect(parent.sandbox_id, timeout=300)
            assert back.files.read("/home/user/origin.txt") == "from the parent"
            assert not back.files.exists("/home/user/mine.txt")
            t0 = time.perf_counter()
            running_children = _fork(api, parent.sandbox_id, RUNNING_FORK)
            running_fork_s = time.perf_counter() - t0
            made.extend(running_children)
            print(f"\nfork of {FORK} from paused: {paused_fork_s:.2f} s "
                  f"({paused_fork_s / FORK:.2f} s/child); {RUNNING_FORK} from running: {running_fork_s:.2f} s "
                  f"({running_fork_s / RUNNING_FORK:.2f} s/child)")
        finally:
            for sid in made:
                with contextlib.suppress(Exception):
                    api.delete(f"/sandboxes/{sid}")


def _envd_files(node: NodeProcess, sandbox_id: str, token: str, path: str) -> httpx.Response:
    return httpx.get(node.url + "/files", params={"path": path}, trust_env=False, timeout=30,
                     headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983",
                              "X-Access-Token": token})


def test_rollback_restores_a_snapshot_in_place(rl_node: NodeProcess) -> None:
    from e2b import Sandbox

    with rl_node.client() as api:
        sbx = Sandbox.create(template="base", timeout=300)
        sid = sbx.sandbox_id
        try:
            old_token = api.get(f"/sandboxes/{sid}").json()["envdAccessToken"]
            sbx.commands.run("python3 -m http.server 8000 --directory /home/user",
                             background=True, timeout=0)  # no lifetime: conftest.COUNTER
            sbx.files.write("/home/user/state.txt", "before")
            _wait(lambda: sbx.commands.run("curl -s localhost:8000/state.txt || true").stdout
                  == "before", what="the guest's web server")
            assert api.post(f"/sandboxes/{sid}/rollback", json={}).status_code == 409  # no pause
            snap = api.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"]
            sbx.files.write("/home/user/state.txt", "after")
            sbx.files.write("/home/user/later.txt", "later")
            sbx.commands.run("sleep 12345", background=True)
            assert "12345" in sbx.commands.run("ps -eo args").stdout

            t0 = time.perf_counter()
            answer = api.post(f"/sandboxes/{sid}/rollback", json={"snapshotID": snap})
            rollback_s = time.perf_counter() - t0
            assert answer.status_code == 200, answer.text
            new_token = answer.json()["envdAccessToken"]
            assert answer.json()["sandboxID"] == sid and new_token != old_token
            assert _envd_files(rl_node, sid, old_token, "/home/user/state.txt"
                               ).status_code == 401
            assert _envd_files(rl_node, sid, new_token, "/home/user/state.txt").text == "before"

            back = Sandbox.connect(sid, timeout=300)
            assert back.files.read("/home/user/state.txt") == "before"
            assert not back.files.exists("/home/user/later.txt")
            assert "12345" not in back.commands.run("ps -eo args").stdout
            port = httpx.get(rl_node.url + "/state.txt", trust_env=False, timeout=30,
                             headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"})
            assert port.status_code == 200 and port.text == "before"  # its server, proxied
            detail = api.get(f"/sandboxes/{sid}").json()
            assert detail["state"] == "running"

            # To its last pause (no snapshotID): the pause's state, whatever came after.
            back.files.write("/home/user/state.txt", "paused")
            back.pause()
            t0 = time.perf_counter()
            again = Sandbox.connect(sid, timeout=300)
            resume_s = time.perf_counter() - t0
            again.files.write("/home/user/state.txt", "after the pause")
            t0 = time.perf_counter()
            assert api.post(f"/sandboxes/{sid}/rollback", json={}).status_code == 200
            rollback_pause_s = time.perf_counter() - t0
            assert Sandbox.connect(sid, timeout=300).files.read("/home/user/state.txt"
                                                                ) == "paused"
            # A paused sandbox rolls back too (it runs afterwards).
            Sandbox.connect(sid, timeout=300).pause()
            paused = api.post(f"/sandboxes/{sid}/rollback", json={"snapshotID": snap})
            assert paused.status_code == 200, paused.text
            final = Sandbox.connect(sid, timeout=300)
            assert final.files.read("/home/user/state.txt") == "before"
            other = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}).json()
            refused = api.post(f"/sandboxes/{other['sandboxID']}/rollback",
                               json={"snapshotID": snap})
            assert refused.status_code == 400, refused.text  # not a snapshot of its own
            api.delete(f"/sandboxes/{other['sandboxID']}")
            print(f"\nrollback to a snapshot: {rollback_s:.2f} s; to the last pause: "
                  f"{rollback_pause_s:.2f} s; plain resume: {resume_s:.2f} s")
        finally:
            with contextlib.suppress(Exception):
                api.delete(f"/sandboxes/{sid}")


def test_batch_from_a_snapshot_on_the_vm_backend(rl_node: NodeProcess) -> None:
    from e2b import Sandbox

    made: list[str] = []
    with rl_node.client() as api:
        try:
            src = Sandbox.create(template="base", timeout=300)
            made.append(src.sandbox_id)
            src.files.write("/home/user/seed.txt", "seed")
            snap = api.post(f"/sandboxes/{src.sandbox_id}/snapshots", json={}
                            ).json()["snapshotID"]
            answer = api.post(f"/snapshots/{snap}/fork", json={"count": 2, "timeout": 300})
            assert answer.status_code == 201, answer.text
            ids = [r["sandbox"]["sandboxID"] for r in answer.json()]
            made.extend(ids)
            for i, cid in enumerate(ids):
                kid = Sandbox.connect(cid, timeout=300)
                assert kid.files.read("/home/user/seed.txt") == "seed"
                kid.files.write("/home/user/seed.txt", f"kid {i}")
            for i, cid in enumerate(ids):
                assert Sandbox.connect(cid, timeout=300).files.read("/home/user/seed.txt"
                                                                    ) == f"kid {i}"
            assert {s["sandboxID"] for s in api.get(f"/snapshots/{snap}/children").json()
                    } == set(ids)
        finally:
            for sid in made:
                with contextlib.suppress(Exception):
                    api.delete(f"/sandboxes/{sid}")


def test_rollout_pool_branches_a_paused_trajectory_and_rolls_back(rl_node: NodeProcess) -> None:
    """agentenv.rollout on the VM backend: set up, pause, branch 2 from the paused root (it
    stays paused), step each, roll one back to its last pause; the pool cleans up."""
    import asyncio

    from agentenv.rollout import RolloutPool

    async def scenario() -> None:
        async with RolloutPool(api_url=rl_node.url, api_key=rl_node.api_key,
                               timeout=300) as pool:
            root = await pool.create()
            await root.write("/home/user/env.txt", "set up")
            await root.pause()
            branches = await root.branch(2)
            for i, branch in enumerate(branches):
                assert await branch.read("/home/user/env.txt") == "set up"
                await branch.step(f"echo {i} > /home/user/step.txt")
            with rl_node.client() as api:
                assert api.get(f"/sandboxes/{root.sandbox_id}").json()["state"] == "paused"
            await branches[0].pause()
            await branches[0].resume()
            await branches[0].step("echo later > /home/user/step.txt")
            await branches[0].rollback()
            assert (await branches[0].read("/home/user/step.txt")).strip() == "0"
            assert (await branches[1].read("/home/user/step.txt")).strip() == "1"
        with rl_node.client() as api:
            assert api.get("/v2/sandboxes").json() == []

    asyncio.run(scenario())


def test_fork_of_a_filesystem_only_pause_cold_boots_the_children(rl_node: NodeProcess) -> None:
    """A pause that kept the disk only: each child boots from its disk (no memory to restore),
    with the parent's files; the parent stays paused."""
    from e2b import Sandbox

    made: list[str] = []
    with rl_node.client() as api:
        try:
            parent = Sandbox.create(template="base", timeout=300)
            made.append(parent.sandbox_id)
            parent.files.write("/home/user/disk.txt", "on disk")
            assert api.post(f"/sandboxes/{parent.sandbox_id}/pause", json={"memory": False}
                            ).status_code == 204
            children = _fork(api, parent.sandbox_id, 2)
            made.extend(children)
            for cid in children:
                assert Sandbox.connect(cid, timeout=300).files.read("/home/user/disk.txt"
                                                                    ) == "on disk"
            detail = api.get(f"/sandboxes/{parent.sandbox_id}").json()
            assert detail["state"] == "paused" and detail["pauseMode"] == "filesystem"
        finally:
            for sid in made:
                with contextlib.suppress(Exception):
                    api.delete(f"/sandboxes/{sid}")


def _owned(node: NodeProcess, sandbox_id: str) -> list[str]:
    import json

    path = node.state_dir / "vm-backend" / "sandboxes" / f"{sandbox_id}.json"
    return list(json.loads(path.read_text())) if path.exists() else []


def _named_by(record_dir: Path) -> set[Path]:
    """The layer files a snapshot record names (its memory and disk stacks)."""
    import json

    record = json.loads((record_dir / "snapshot.json").read_text())
    layers = [*record["memory_layers"], *(x for d in record["disks"] for x in d["layers"])]
    return {Path(x["path"]).resolve() for x in layers}


def _leftovers(earlier: list[Path], named: set[Path]) -> list[str]:
    """Files of earlier pause directories the latest pause does not name."""
    return [str(f) for d in earlier if d.exists() for f in d.iterdir()
            if f.is_file() and f.name != ".released" and f.resolve() not in named]


def _only_the_last_pause(node: NodeProcess, sandbox_id: str, pauses: list[Path],
                         named: set[Path]) -> bool:
    return (_owned(node, sandbox_id) == [str(pauses[-1])]
            and not _leftovers(pauses[:-1], named))


def test_pause_cycles_keep_only_the_last_pause_and_what_it_grew_from(
        rl_node: NodeProcess) -> None:
    """A sandbox paused again and again, each cycle dirtying a third of its RAM: only its last
    pause is a resume or rollback target, so the earlier ones keep nothing but the layers the
    last one names (its disk chain, its memory stack until compacted). Once the stack is
    compacted, no earlier pause holds memory: the sandbox's state on disk stops growing with
    the number of cycles (before, every cycle's memory stayed until the sandbox was deleted)."""
    from e2b import Sandbox

    before = _snapshot_dirs(rl_node)
    sbx = Sandbox.create(template="base", timeout=600)
    sid = sbx.sandbox_id
    try:
        with rl_node.client() as api:
            ram_mib = api.get(f"/sandboxes/{sid}").json()["memoryMB"]
        pauses: list[Path] = []
        compacted = False
        for cycle in range(7):
            out = sbx.commands.run(
                f"dd if=/dev/urandom of=/dev/shm/dirty bs=1M count={ram_mib // 3} 2>/dev/null"
                " && md5sum /dev/shm/dirty", timeout=300).stdout
            digest = out.split()[0]
            sbx.pause()
            owned = _owned(rl_node, sid)
            pauses.append(Path(owned[-1]))
            latest, earlier = pauses[-1], pauses[:-1]
            named = _named_by(latest)
            # The release runs once the pause has answered.
            _wait(functools.partial(_only_the_last_pause, rl_node, sid, pauses, named),
                  seconds=120, what=f"earlier pauses released after cycle {cycle}")
            memory = [p for p in named if p.name.startswith("memory")]
            if cycle and len(memory) == 1 and memory[0].parent == latest.resolve():
                compacted = True  # the whole stack is this pause's own layer
                assert not any(f.name.startswith("memory") for d in earlier if d.exists()
                               for f in d.iterdir())
            sbx = Sandbox.connect(sid, timeout=600)
            again = sbx.commands.run("md5sum /dev/shm/dirty", timeout=120).stdout
            assert again.split()[0] == digest, f"memory lost after cycle {cycle}"
            if compacted:
                break
        assert compacted, "the memory stack was never compacted: raise the cycles"
    finally:
        with contextlib.suppress(Exception):
            Sandbox.kill(sid)
    # Only this test's directories: an earlier test's may still be on their way out.
    deadline = time.monotonic() + 60
    while left := _snapshot_dirs(rl_node) - before:
        assert time.monotonic() < deadline, f"pauses not freed with the sandbox: {left}"
        time.sleep(0.2)
