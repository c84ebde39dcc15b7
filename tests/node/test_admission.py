"""Admission control: a node with small limits refuses creates, resumes and forks it cannot
hold with 429 naming the resource, the figures and the setting, and leaves nothing behind; it
admits by what its sandboxes use (ceilings on what they request, a floor of real headroom:
MemAvailable and PSI) (node/admission.py)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.node.admission import Admission, AdmissionRefused, size_text
from agentenv.node.host_use import HostProbe
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
        message = _error(refused, 429, "memory: requested", "AENV_MEMORY_BUDGET_MB",
                         f"{3 * PER_SANDBOX_MB} MiB would exceed the budget of "
                         f"{2 * PER_SANDBOX_MB + 4} MiB")
        assert refused.headers["should-retry"] == "false"
        assert refused.headers["x-agentenv-refused"] == "memory"
        print(f"\nrefused create: {refused.status_code} {message}")
        assert {s["sandboxID"] for s in api.get("/v2/sandboxes").json()} == listed
        assert _files(small_node.state_dir) == before_files

        # A fork needs room for its children.
        _error(api.post(f"/sandboxes/{a}/fork", json={"count": 1}), 429, "memory: requested")
        assert {s["sandboxID"] for s in api.get("/v2/sandboxes").json()} == listed
        assert api.get(f"/sandboxes/{a}").json()["state"] == "running"

        # Paused, b holds nothing: a new sandbox fits, and then b cannot come back.
        assert api.post(f"/sandboxes/{b}/pause").status_code == 204
        third = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
        assert third.status_code == 201, third.text
        _error(api.post(f"/sandboxes/{b}/connect", json={"timeout": 60}), 429,
               "memory: requested")
        assert api.get(f"/sandboxes/{b}").json()["state"] == "paused"

        # Room again once a sandbox ends.
        assert api.delete(f"/sandboxes/{third.json()['sandboxID']}").status_code == 204
        assert api.post(f"/sandboxes/{b}/connect", json={"timeout": 60}).status_code in (200, 201)
        assert api.get(f"/sandboxes/{b}").json()["state"] == "running"


def test_free_disk_limit_answers_429(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "state", tmp_path / "node.log",
                       extra_env={"AENV_MIN_FREE_DISK_MB": str(1 << 40)})
    node.start()
    try:
        with node.client() as api:
            before = _files(node.state_dir)
            _error(api.post("/v2/sandboxes", json={"templateID": "base"}), 429,
                   "disk: free disk low", "AENV_MIN_FREE_DISK_MB")
            assert api.get("/v2/sandboxes").json() == []
            assert _files(node.state_dir) == before
    finally:
        node.cleanup()


def test_disk_reserve_refuses_create_with_429_naming_the_disk(tmp_path: Path) -> None:
    """Below AENV_DISK_RESERVE blockd refuses every disk's growth (storage/budget.py): a node
    whose own free-disk floor is lower still refuses the create, naming the reserve."""
    node = NodeProcess(tmp_path / "state", tmp_path / "node.log",
                       extra_env={"AENV_MIN_FREE_DISK_MB": "0",
                                  "AENV_DISK_RESERVE": str(1 << 60)})
    node.start()
    try:
        with node.client() as api:
            before = _files(node.state_dir)
            _error(api.post("/v2/sandboxes", json={"templateID": "base"}), 429,
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
                          memory_reserve_mb=0, min_free_disk_mb=0, cpu_pressure_max=0,
                          memory_pressure_max=0)
    records = [_Rec(State.RUNNING), _Rec(State.PAUSED), _Rec(State.PAUSED)]
    held = admission.admit("fork", records, 512, 2)  # type: ignore[arg-type]
    with pytest.raises(AdmissionRefused) as refused:
        admission.admit("create sandbox", records, 512, 2)  # type: ignore[arg-type]
    assert refused.value.status == 429 and refused.value.limit == "max_sandboxes"
    assert "sandbox limit reached (2 of 2" in str(refused.value)
    admission.release(held)
    admission.release(held)  # twice is harmless
    admission.release(admission.admit("create sandbox", records, 512, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"AENV_MEMORY_OVERCOMMIT is gone.*REQUEST_RATIO"):
        Admission.from_env(tmp_path, {"AENV_MEMORY_OVERCOMMIT": "2"})
    with pytest.raises(ValueError, match="AENV_CPU_REQUEST_RATIO"):
        Admission.from_env(tmp_path, {"AENV_CPU_REQUEST_RATIO": "lots"})
    with pytest.raises(ValueError, match="AENV_CPU_PRESSURE_MAX=101 is over 100"):
        Admission.from_env(tmp_path, {"AENV_CPU_PRESSURE_MAX": "101"})
    defaults = Admission.from_env(tmp_path, {})
    host = defaults.probe.sample()
    assert defaults.cpu_ceiling == 14 * host.cpus
    assert defaults.memory_ceiling_mb == 5 * host.memory_total_mib



# --- by use: the ceilings by ratio, the floor of real headroom ----------------------------------


def node_metrics(node: NodeProcess) -> dict[str, float]:
    """The node's Prometheus samples, by name and labels as written."""
    with node.client() as api:
        text = api.get("/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_memory_ceiling_by_ratio_is_a_429_naming_memory_that_the_sdk_shows_at_once(
        tmp_path: Path) -> None:
    """Creates past AENV_MEMORY_REQUEST_RATIO x MemTotal get 429 naming memory, the figures and
    the setting; the official SDK raises it with the message after one request (the refusal
    says Should-Retry: false; it would otherwise try three times more)."""
    from e2b import RateLimitException, Sandbox

    from tests.node.conftest import sdk_pointed_at

    total = HostProbe().sample().memory_total_mib
    ratio = (2 * PER_SANDBOX_MB + 8) / total  # room for two sandboxes
    node = NodeProcess(tmp_path / "state", tmp_path / "node.log",
                       extra_env={"AENV_MEMORY_REQUEST_RATIO": repr(ratio)})
    node.start()
    made: list[str] = []
    try:
        with node.client() as api:
            for _ in range(2):
                created = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
                assert created.status_code == 201, created.text
                made.append(created.json()["sandboxID"])
            refused = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
            message = _error(
                refused, 429, f"cannot create sandbox: memory: requested "
                f"{size_text(3 * PER_SANDBOX_MB)} would exceed {ratio:g} x {size_text(total)} "
                "host memory (AENV_MEMORY_REQUEST_RATIO)")
            print(f"\nrefused create: {message}")
            with sdk_pointed_at(node), pytest.raises(RateLimitException) as raised:
                Sandbox.create(template="base", timeout=60)
            assert message in str(raised.value), raised.value
            assert {s["sandboxID"] for s in api.get("/v2/sandboxes").json()} == set(made)
        refusals = ('aenv_node_admission_refusals_total{limit="memory_requested",'
                    'resource="memory"}')
        assert node_metrics(node)[refusals] == 2  # the SDK asked once
    finally:
        node.cleanup()


def test_idle_sandboxes_are_admitted_past_the_physical_cpus_up_to_the_ceiling(
        tmp_path: Path) -> None:
    """A node on one CPU admits 14 vCPUs (AENV_CPU_REQUEST_RATIO's default) of sandboxes that
    wait, seven times its CPU, and refuses the next with 429 naming cpu."""
    one_cpu = {min(os.sched_getaffinity(0))}
    node = NodeProcess(tmp_path / "state", tmp_path / "node.log", cpus=one_cpu)
    node.start()
    try:
        with node.client() as api:
            batch = api.post("/v2/sandboxes",
                             json={"templateID": "base", "timeout": 120, "count": 7})
            assert batch.status_code == 201, batch.text
            assert all("sandbox" in r for r in batch.json()), batch.text  # 7 x 2 vCPUs
            _error(api.post("/v2/sandboxes", json={"templateID": "base"}), 429,
                   "cannot create sandbox: cpu: requested 16 vCPUs would exceed 14 x 1 host "
                   "CPUs (AENV_CPU_REQUEST_RATIO)")
        samples = node_metrics(node)
        assert samples['aenv_node_admission_requested{resource="cpu"}'] == 14
        assert samples['aenv_node_admission_ceiling{resource="cpu"}'] == 14
        assert samples['aenv_node_admission_free{resource="cpu"}'] == 0
    finally:
        node.cleanup()


class FakeProc:
    """A /proc of the files admission reads (node/host_use.py), written by the test: the
    host's pressure and memory cannot be driven safely on a shared machine."""

    def __init__(self, root: Path, total_mib: int = 16384) -> None:
        self.root = root
        self.total_mib = total_mib
        self.now = 1000.0
        (root / "pressure").mkdir(parents=True)
        self.set(available_mib=total_mib - 1024, cpu=0.0, memory=0.0)
        self.stat(0, 0)

    def set(self, *, available_mib: int | None = None, cpu: float | None = None,
            memory: float | None = None) -> None:
        if available_mib is not None:
            (self.root / "meminfo").write_text(
                f"MemTotal: {self.total_mib * 1024} kB\nMemFree: 1 kB\n"
                f"MemAvailable: {available_mib * 1024} kB\n")
        for kind, value in (("cpu", cpu), ("memory", memory)):
            if value is not None:
                (self.root / "pressure" / kind).write_text(
                    f"some avg10={value:.2f} avg60=0.00 avg300=0.00 total=1\n"
                    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")

    def stat(self, busy: int, idle: int) -> None:
        """Cumulative ticks: user, nice, system, idle, iowait, irq, softirq, steal."""
        (self.root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0\n")

    def without_psi(self) -> None:
        for kind in ("cpu", "memory"):
            (self.root / "pressure" / kind).unlink()

    def probe(self, cpus: int = 2) -> HostProbe:
        return HostProbe(self.root, cpus=cpus, clock=lambda: self.now)


def _running(count: int, state: State = State.RUNNING) -> list[_Rec]:
    return [_Rec(state) for _ in range(count)]


def test_the_headroom_floor_refuses_by_pressure_and_available_memory(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    admission = Admission(tmp_path, probe=proc.probe(), min_free_disk_mb=0)
    size = admission.sandbox_mb(512, 2)  # 648 MiB
    records: list[Any] = _running(2)
    admission.release(admission.admit("create sandbox", records, 512, 2))

    proc.set(memory=10.5)  # over AENV_MEMORY_PRESSURE_MAX's 10
    with pytest.raises(AdmissionRefused) as refused:
        admission.admit("create sandbox", records, 512, 2)
    assert (refused.value.status, refused.value.limit, refused.value.resource) == (
        429, "memory_pressure", "memory")
    assert str(refused.value) == (
        "cannot create sandbox: memory: pressure 10.5% (PSI some avg10) is over 10% "
        "(AENV_MEMORY_PRESSURE_MAX)")
    assert admission.room(records).memory_free_mib == 0

    proc.set(memory=0.0, cpu=92.0)
    with pytest.raises(AdmissionRefused) as refused:
        admission.admit("create sandbox", records, 512, 2)
    assert refused.value.limit == "cpu_pressure" and str(refused.value).endswith(
        "cpu: pressure 92.0% (PSI some avg10) is over 90% (AENV_CPU_PRESSURE_MAX)")
    assert admission.room(records).cpu_free == 0

    # MemAvailable: what sandboxes starting will take (1/5 of their request each) and the new
    # one's share must leave the reserve. 4 starting: 4 x 648 / 5 = 518.4 MiB.
    proc.set(cpu=1.0, available_mib=256 + 518 + 129)  # 1 MiB short of 648 / 5 = 129.6
    starting = [*records, *_running(4, State.CREATING)]
    with pytest.raises(AdmissionRefused) as refused:
        admission.admit("create sandbox", starting, 512, 2)
    assert refused.value.limit == "memory_available"
    assert str(refused.value) == (
        "cannot create sandbox: memory: 903 MiB available, less 518 MiB for the sandboxes "
        f"starting and 130 MiB for this (1/5 of {size} MiB requested), would leave less than "
        "256 MiB (AENV_MEMORY_RESERVE_MB)")
    # once they run, MemAvailable holds their memory itself: room again
    admission.release(admission.admit("create sandbox", [*records, *_running(4)], 512, 2))

    # a cluster's node names the resource and the setting, not the host's figures
    admission.shared = True
    with pytest.raises(AdmissionRefused) as refused:
        admission.admit("create sandbox", starting, 512, 2)
    assert str(refused.value) == ("cannot create sandbox: memory: the host's available memory "
                                  "is short (AENV_MEMORY_RESERVE_MB)")
    assert admission.refusals == {"memory_pressure": 1, "cpu_pressure": 1,
                                  "memory_available": 2}


def test_without_psi_cpu_goes_by_the_busy_share(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.without_psi()
    admission = Admission(tmp_path, probe=proc.probe(), min_free_disk_mb=0)
    assert admission.probe.sample().cpu_pressure is None
    proc.now += 5
    proc.stat(busy=950, idle=50)  # 95% busy over the last 5 s
    with pytest.raises(AdmissionRefused) as refused:
        admission.admit("create sandbox", [], 512, 2)
    assert str(refused.value).endswith(
        "cpu: 95.0% busy over the last 10 s (no PSI) is over 90% (AENV_CPU_PRESSURE_MAX)")
    proc.now += 11  # the busy readings leave the 10 s window: 50 busy of 1000 since then
    proc.stat(busy=1000, idle=1000)
    admission.release(admission.admit("create sandbox", [], 512, 2))
    assert Admission(tmp_path, probe=proc.probe(), cpu_pressure_max=0).room([]).cpu_limit == \
        "cpu_requested"


def test_room_is_exactly_what_admit_takes(tmp_path: Path) -> None:
    """What the heartbeat reports (room) is the admission's own decision: over random loads,
    pressures and headroom, a request is admitted exactly when it fits the room."""
    rng = random.Random(31)
    proc = FakeProc(tmp_path / "proc")
    outcomes: dict[str, int] = {}
    for _ in range(300):
        admission = Admission(tmp_path, probe=proc.probe(cpus=rng.choice([1, 2, 8])),
                              cpu_request_ratio=rng.choice([1.0, 4.0, 14.0]),
                              memory_request_ratio=rng.choice([0.5, 2.0, 5.0]),
                              min_free_disk_mb=0)
        proc.set(available_mib=rng.randrange(0, 16384), cpu=rng.choice([0.0, 50.0, 95.0]),
                 memory=rng.choice([0.0, 5.0, 20.0]))
        records: list[Any] = [_Rec(rng.choice([State.RUNNING, State.CREATING, State.PAUSED]),
                                   rng.choice([256, 512, 2048]), rng.choice([1, 2, 4]))
                              for _ in range(rng.randrange(0, 40))]
        memory, cpus, count = rng.choice([256, 512, 4096]), rng.choice([1, 2, 8]), \
            rng.choice([1, 3])
        room = admission.room(records)
        fits = (cpus * count <= room.cpu_free
                and admission.sandbox_mb(memory, cpus) * count <= room.memory_free_mib)
        try:
            admission.release(admission.admit("create sandbox", records, memory, cpus, count))
            admitted, outcome = True, "admitted"
        except AdmissionRefused as exc:
            admitted, outcome = False, exc.limit
            assert exc.limit in (room.cpu_limit, room.memory_limit)
        assert admitted == fits, (room, memory, cpus, count)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # every bound was met along the way
    assert set(outcomes) == {"admitted", "cpu_requested", "cpu_pressure", "memory_requested",
                             "memory_available", "memory_pressure"}, outcomes


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
            message = _error(refused, 429, "memory: requested", "AENV_MEMORY_BUDGET_MB",
                             f"{3 * BASE_SANDBOX_MB} MiB would exceed the budget of "
                             f"{SHARED_VM_BUDGET_MB} MiB")
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
