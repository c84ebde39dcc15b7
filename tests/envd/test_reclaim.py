"""envd's cold-memory setting (guest/envd/reclaim.py) without a VM: the wire contract with the
host's `ColdMemory`, bad bodies refused naming the field, the kernel files it writes (a tree of
plain files standing in for DAMON's sysfs directory), and the route on an envd that does not
own the machine. The kernel's side is tests/runtime/test_cold_memory.py (a real guest)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pydantic
import pytest

from agentenv.envd_client import ColdMemory, Watermarks
from agentenv.guest.envd.reclaim import Reclaim, ReclaimError, parse, system_ram

from .conftest import EnvdProcess

# /proc/iomem of a 1 GiB q35 guest (abridged), and of a 4 GiB one (RAM above the PCI hole).
IOMEM_1G = """\
00000000-00000fff : Reserved
00001000-0009fbff : System RAM
000a0000-000bffff : PCI Bus 0000:00
00100000-3ffd8fff : System RAM
  01000000-01ffffff : Kernel code
3ffd9000-3fffffff : Reserved
"""
IOMEM_4G = IOMEM_1G.replace("00100000-3ffd8fff", "00100000-7fffffff") + \
    "100000000-17fffffff : System RAM\n"

SCHEME = "kdamonds/0/contexts/0/schemes/0"


def fake_admin(root: Path, regions: int = 2) -> Path:
    """The files DAMON's sysfs directory would have once the counts are written."""
    admin = root / "admin"
    context = admin / "kdamonds/0/contexts/0"
    scheme = admin / SCHEME
    dirs = [context / "monitoring_attrs/intervals", scheme / "quotas/weights",
            scheme / "watermarks", scheme / "filters/0", scheme / "stats"]
    dirs += [context / f"targets/0/regions/{i}" for i in range(regions)]
    dirs += [scheme / "access_pattern" / name for name in ("sz", "nr_accesses", "age")]
    for directory in dirs:
        directory.mkdir(parents=True, exist_ok=True)
    (admin / "kdamonds/nr_kdamonds").write_text("0\n")
    (admin / "kdamonds/0/state").write_text("off\n")
    (admin / "kdamonds/0/pid").write_text("123\n")
    for name in ("nr_tried", "sz_tried", "nr_applied", "sz_applied", "qt_exceeds"):
        (scheme / "stats" / name).write_text("7\n")
    return admin


def reclaim_in(tmp_path: Path, iomem: str = IOMEM_1G, swaps: str = "") -> Reclaim:
    (tmp_path / "iomem").write_text(iomem)
    (tmp_path / "swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n" + swaps)
    return Reclaim(admin=str(fake_admin(tmp_path)), iomem=str(tmp_path / "iomem"),
                   swaps=str(tmp_path / "swaps"))


def test_the_host_setting_is_what_the_guest_reads() -> None:
    setting = parse(ColdMemory(minAgeSeconds=30, sampleMs=100, aggregationMs=2000).wire())
    assert setting.enabled and setting.min_age_s == 30
    assert setting.min_age_aggregations == 15  # ages count aggregation intervals
    assert setting.watermarks == (1000, 999, 0)  # always on: free memory never passes 100%
    assert parse(ColdMemory.off().wire()).enabled is False
    # min_age not a whole number of aggregations: rounded up, never below one
    assert parse(ColdMemory(minAgeSeconds=3.5, aggregationMs=1000).wire()).min_age_aggregations == 4


@pytest.mark.parametrize(("body", "message"), [
    ([], "JSON object"),
    ({"enabled": "yes"}, "enabled must be true or false"),
    ({"enabled": True, "minAgeSeconds": 30}, "missing fields"),
    ({**ColdMemory().wire(), "minAgeSeconds": -1}, "minAgeSeconds must be a number"),
    ({**ColdMemory().wire(), "quotaMBPerSecond": 1.5}, "quotaMBPerSecond must be an integer"),
    ({**ColdMemory().wire(), "sampleMs": 500, "aggregationMs": 100}, "at least sampleMs"),
    ({**ColdMemory().wire(), "watermarks": {"high": 10, "mid": 20, "low": 0}}, "high >= mid"),
    ({**ColdMemory().wire(), "watermarks": [1000, 999, 0]}, "watermarks must be an object"),
    ({**ColdMemory().wire(), "swap": True}, "unknown fields"),
])
def test_bad_bodies_are_refused_naming_the_field(body: object, message: str) -> None:
    with pytest.raises(ReclaimError, match=message) as raised:
        parse(body)
    assert raised.value.status == 400


def test_the_host_model_refuses_what_the_guest_would() -> None:
    for bad in ({"minAgeSeconds": 0.5}, {"sampleMs": 100, "aggregationMs": 50},
                {"minAgeSeconds": 1, "aggregationMs": 2000}, {"quotaCpuMsPerSecond": 0},
                {"watermarks": {"high": 1, "mid": 2, "low": 0}}, {"reclaim": "yes"},
                {"minAgeSeconds": 30, "extra": 1}):
        with pytest.raises(pydantic.ValidationError):
            ColdMemory.model_validate(bad)
    assert Watermarks().high == 1000


def test_system_ram_is_every_top_level_range(tmp_path: Path) -> None:
    (tmp_path / "iomem").write_text(IOMEM_4G)
    assert system_ram(str(tmp_path / "iomem")) == [
        (0x1000, 0x9fc00), (0x100000, 0x80000000), (0x100000000, 0x180000000)]
    # what a user without CAP_SYS_ADMIN reads: every address zero
    (tmp_path / "iomem").write_text("00000000-00000000 : System RAM\n")
    with pytest.raises(ReclaimError, match="no System RAM"):
        system_ram(str(tmp_path / "iomem"))


def read(admin: Path, name: str) -> str:
    return (admin / name).read_text().strip()


def test_apply_writes_the_pageout_scheme(tmp_path: Path) -> None:
    reclaim = reclaim_in(tmp_path)
    admin = Path(reclaim.admin)
    states: list[str] = []  # what the kernel's `state` file was told, in order
    write = reclaim._write
    reclaim._write = lambda name, value: (  # type: ignore[method-assign]
        states.append(str(value)) if name.endswith("/state") else None, write(name, value))[1]
    status = reclaim.apply(ColdMemory(minAgeSeconds=30, quotaMBPerSecond=64,
                                      quotaCpuMsPerSecond=20, sampleMs=100,
                                      aggregationMs=2000).wire())
    context, scheme = "kdamonds/0/contexts/0", SCHEME
    # started once the scheme is written, then asked for its counters
    assert states == ["on", "update_schemes_stats"]
    assert read(admin, f"{context}/operations") == "paddr"
    assert read(admin, f"{context}/monitoring_attrs/intervals/sample_us") == "100000"
    assert read(admin, f"{context}/monitoring_attrs/intervals/aggr_us") == "2000000"
    assert read(admin, f"{context}/targets/0/regions/nr_regions") == "2"
    assert [read(admin, f"{context}/targets/0/regions/1/{k}") for k in ("start", "end")] == [
        str(0x100000), str(0x3ffd9000)]
    assert read(admin, f"{scheme}/action") == "pageout"
    assert read(admin, f"{scheme}/access_pattern/nr_accesses/max") == "0"
    assert read(admin, f"{scheme}/access_pattern/age/min") == "15"
    assert read(admin, f"{scheme}/quotas/bytes") == str(64 << 20)
    assert read(admin, f"{scheme}/quotas/ms") == "20"
    assert read(admin, f"{scheme}/quotas/weights/age_permil") == "1000"
    assert [read(admin, f"{scheme}/watermarks/{k}") for k in ("high", "mid", "low")] == [
        "1000", "999", "0"]
    # no swap: anonymous pages are filtered out (they could not be paged out)
    assert read(admin, f"{scheme}/filters/nr_filters") == "1"
    assert read(admin, f"{scheme}/filters/0/type") == "anon"
    assert status["enabled"] and status["minAgeSeconds"] == 30 and status["skipAnonymous"]
    assert status["quotaMBPerSecond"] == 64 and status["sampleMs"] == 100
    assert status["stats"]["bytesReclaimed"] == 7  # the kernel's counters, as they read

    (admin / "kdamonds/0/state").write_text("on\n")  # what the running kernel shows
    assert reclaim.apply({"enabled": False}) == {"available": True, "enabled": False}
    assert states[-1] == "off" and read(admin, "kdamonds/0/state") == "off"


def test_with_swap_anonymous_memory_is_reclaimed_too(tmp_path: Path) -> None:
    reclaim = reclaim_in(tmp_path, swaps="/dev/zram0 partition 262140 0 100\n")
    reclaim.apply(ColdMemory().wire())
    assert read(Path(reclaim.admin), f"{SCHEME}/filters/nr_filters") == "0"


def test_a_kernel_without_damon_is_501(tmp_path: Path) -> None:
    reclaim = Reclaim(admin=str(tmp_path / "none"))
    assert reclaim.status() == {"available": False}
    with pytest.raises(ReclaimError) as raised:
        reclaim.apply(ColdMemory().wire())
    assert raised.value.status == 501


def test_route_on_an_envd_that_does_not_own_the_machine(envd: EnvdProcess) -> None:
    """envd serving a directory (tests, the process backend) touches no kernel setting: 501,
    which a template build logs as a warning; a malformed body is still a 400."""
    with httpx.Client(base_url=envd.url, timeout=10) as http:
        assert http.get("/aenv/reclaim").json() == {"available": False}
        refused = http.post("/aenv/reclaim", json=ColdMemory().wire())
        assert refused.status_code == 501 and "owns the machine" in refused.json()["message"]
        assert http.post("/aenv/reclaim", content=b"{").status_code == 400
        assert http.put("/aenv/reclaim", json={}).status_code == 405
