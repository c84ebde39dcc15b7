"""Admission control: a node with small limits refuses creates, resumes and forks it cannot
hold with 429/503 naming the limit, and leaves nothing behind (node/admission.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.node.admission import Admission, AdmissionRefused
from agentenv.node.records import State
from tests.node.conftest import NodeProcess

# Process backend sandboxes: 512 MiB, 2 vCPUs -> 512 + 64 + 64 + 8 = 648 MiB each.
PER_SANDBOX_MB = 648


def _files(state_dir: Path) -> set[str]:
    """Everything under the state directory but the database's own files and logs."""
    return {str(p.relative_to(state_dir)) for p in state_dir.rglob("*")
            if not p.name.startswith("node.db") and "logs" not in p.parts}


def _error(answer: httpx.Response, status: int, *words: str) -> str:
    assert answer.status_code == status, answer.text
    message = answer.json()["message"]
    for word in words:
        assert word in message, message
    return str(message)


@pytest.fixture
def small_node(tmp_path: Path) -> Iterator[NodeProcess]:
    node = NodeProcess(tmp_path / "state", tmp_path / "node.log",
                       extra_env={"AENV_MEMORY_BUDGET_MB": str(2 * PER_SANDBOX_MB + 4),
                                  "AENV_MAX_SANDBOXES": "3"})
    node.start()
    try:
        yield node
    finally:
        node.cleanup()


def test_full_memory_budget_refuses_create_resume_fork_and_leaves_nothing(
        small_node: NodeProcess) -> None:
    with small_node.client() as api:
        first = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
        second = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
        assert first.status_code == 201 and second.status_code == 201, second.text
        a, b = first.json()["sandboxID"], second.json()["sandboxID"]
        before_files = _files(small_node.state_dir)
        listed = {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}

        refused = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
        message = _error(refused, 429, "memory budget", "AENV_MEMORY_BUDGET_MB")
        print(f"\nrefused create: {refused.status_code} {message}")
        assert {s["sandboxID"] for s in api.get("/v2/sandboxes").json()} == listed
        assert _files(small_node.state_dir) == before_files

        # A fork needs room for its children.
        _error(api.post(f"/sandboxes/{a}/fork", json={"count": 1}), 429, "memory budget")
        assert {s["sandboxID"] for s in api.get("/v2/sandboxes").json()} == listed
        assert api.get(f"/sandboxes/{a}").json()["state"] == "running"

        # Paused, b holds nothing: a new sandbox fits, and then b cannot come back.
        assert api.post(f"/sandboxes/{b}/pause").status_code == 204
        third = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
        assert third.status_code == 201, third.text
        _error(api.post(f"/sandboxes/{b}/connect", json={"timeout": 60}), 429, "memory budget")
        assert api.get(f"/sandboxes/{b}").json()["state"] == "paused"

        # Room again once a sandbox ends.
        assert api.delete(f"/sandboxes/{third.json()['sandboxID']}").status_code == 204
        assert api.post(f"/sandboxes/{b}/connect", json={"timeout": 60}).status_code in (200, 201)
        assert api.get(f"/sandboxes/{b}").json()["state"] == "running"


def test_free_disk_limit_answers_503(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "state", tmp_path / "node.log",
                       extra_env={"AENV_MIN_FREE_DISK_MB": str(1 << 40)})
    node.start()
    try:
        with node.client() as api:
            before = _files(node.state_dir)
            _error(api.post("/v2/sandboxes", json={"templateID": "base"}), 503,
                   "free disk", "AENV_MIN_FREE_DISK_MB")
            assert api.get("/v2/sandboxes").json() == []
            assert _files(node.state_dir) == before
    finally:
        node.cleanup()


def test_disk_reserve_refuses_create_with_503_naming_the_disk(tmp_path: Path) -> None:
    """Below AENV_DISK_RESERVE blockd refuses every disk's growth (storage/budget.py): a node
    whose own free-disk floor is lower still refuses the create, naming the reserve."""
    node = NodeProcess(tmp_path / "state", tmp_path / "node.log",
                       extra_env={"AENV_MIN_FREE_DISK_MB": "0",
                                  "AENV_DISK_RESERVE": str(1 << 60)})
    node.start()
    try:
        with node.client() as api:
            before = _files(node.state_dir)
            _error(api.post("/v2/sandboxes", json={"templateID": "base"}), 503,
                   "free disk", "state filesystem", str(node.state_dir), "AENV_DISK_RESERVE")
            assert api.get("/v2/sandboxes").json() == []
            assert _files(node.state_dir) == before
    finally:
        node.cleanup()


class _Rec:
    def __init__(self, state: State, memory_mb: int = 512, cpu_count: int = 2) -> None:
        self.state, self.memory_mb, self.cpu_count = state, memory_mb, cpu_count


def test_limits_count_running_sandboxes_and_reservations(tmp_path: Path) -> None:
    admission = Admission(tmp_path, max_sandboxes=2, memory_budget_mb=10_000,
                          memory_reserve_mb=0, min_free_disk_mb=0)
    records = [_Rec(State.RUNNING), _Rec(State.PAUSED), _Rec(State.PAUSED)]
    held = admission.admit("fork", records, 512, 2)  # type: ignore[arg-type]
    with pytest.raises(AdmissionRefused) as refused:
        admission.admit("create sandbox", records, 512, 2)  # type: ignore[arg-type]
    assert refused.value.status == 429 and refused.value.limit == "max_sandboxes"
    assert "sandbox limit reached (2 of 2" in str(refused.value)
    admission.release(held)
    admission.release(held)  # twice is harmless
    admission.release(admission.admit("create sandbox", records, 512, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="AENV_MEMORY_OVERCOMMIT"):
        Admission.from_env(tmp_path, {"AENV_MEMORY_OVERCOMMIT": "lots"})
    budget = Admission.from_env(tmp_path, {"AENV_MEMORY_OVERCOMMIT": "2"}).memory_budget_mb
    assert budget > 0



@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_vm_backend_full_memory_budget_refuses_the_next_create(
        shared_vm_node: NodeProcess) -> None:
    """The same on the VM backend, on the session's shared VM node (its budget holds two base
    sandboxes): the third create gets 429 naming the limit before any VM, disk or record."""
    from tests.node.conftest import BASE_SANDBOX_MB, SHARED_VM_BUDGET_MB

    node = shared_vm_node
    manifests = node.state_dir / "vm-backend" / "sandboxes"
    made: list[str] = []
    with node.client() as api:
        base = next(t for t in api.get("/templates").json() if "base" in t["aliases"])
        assert (base["memoryMB"], base["cpuCount"]) == (512, 2)  # what the budget assumes
        try:
            for _ in range(2):
                created = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
                assert created.status_code == 201, created.text
                made.append(created.json()["sandboxID"])
            listed = {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}
            kept = set(manifests.glob("*.vm.json"))  # one per VM (QEMU pid, slot, disks)
            assert len(kept) == 2, kept

            refused = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
            message = _error(refused, 429, "memory budget", "AENV_MEMORY_BUDGET_MB",
                             f"{2 * BASE_SANDBOX_MB} MiB of {SHARED_VM_BUDGET_MB} MiB")
            print(f"\nrefused VM create: {refused.status_code} {message}")
            assert {s["sandboxID"] for s in api.get("/v2/sandboxes").json()} == listed
            assert set(manifests.glob("*.vm.json")) == kept
        finally:
            for sid in made:
                api.delete(f"/sandboxes/{sid}")
        # Room again once one is gone.
        again = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
        assert again.status_code == 201, again.text
        api.delete(f"/sandboxes/{again.json()['sandboxID']}")
