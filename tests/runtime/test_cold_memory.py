"""Cold memory back to the host, in one real guest (the project's kernel, init, tools disk and
envd): a sandbox reads 300 MiB of files, then idles; its guest kernel's DAMON scheme pages the
cold page cache out (guest/envd/reclaim.py), free-page reporting hands the freed pages to QEMU,
and QEMU drops them (runtime/qemu.py), so the host memory of its QEMU falls by at least 80% of
what the read added (the goal is within two minutes: bench/reclaim_bench.py); the files still
read back, from the disk, unchanged.

The setting is made in the booted guest and the guest is paused and restored before the read,
as a template's sandbox is: the DAMON context lives in the snapshot's memory, and the restored
guest's RAM is a private mapping of the snapshot's memory device (what the host holds for the
VM is its QEMU's proportional set: private pages whole, the shared file's pages in part). A
short schedule (pages cold for 10 s) keeps the test quick; the default is 30 s."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from agentenv.envd_client import ColdMemory, EnvdClient
from agentenv.runtime.vm import VM, BootSpec
from agentenv.testing.harness import guest_sh, pss_kib, real_guest_disks

from .conftest import Env

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

GUEST_CACHE = Path(os.environ.get("AENV_TEST_GUEST_STATE", "/var/cache/aenv-test/guest/state"))
MiB = 1 << 20
FILE_MIB = 160
WARM_MIB = 32
MEMORY_MIB = 1024  # the page cache of the read plus what the guest runs, with room to spare
DISK_BYTES = 1 << 30
GIVEN_BACK = 0.8  # of FILE_MIB
# A bound for a mechanism that stopped, not the goal: the 10 s schedule gives the memory back
# in about 40-100 s, and a loaded 2-core host under TCG took 121 s once (the two minutes of the
# goal are bench/reclaim_bench.py's figure, measured, not asserted here).
DEADLINE_S = 360.0
SCHEDULE = ColdMemory(minAgeSeconds=10, sampleMs=50, aggregationMs=1000)
T = TypeVar("T")


def held_mib(vm: VM) -> float:
    """What the host holds for the VM: its QEMU's PSS (smaps_rollup)."""
    return pss_kib(vm.pid)["Pss"] / 1024


def run(env: Env, vm: VM, script: str) -> str:
    return env.loop.run(guest_sh(vm, script), timeout=400)


def envd_call(env: Env, vm: VM, call: Callable[[EnvdClient], Awaitable[T]]) -> T:
    async def go() -> T:
        envd = EnvdClient(vm.envd_url)
        try:
            return await call(envd)
        finally:
            await envd.close()

    return env.loop.run(go())


def reclaimed(env: Env, vm: VM) -> int:
    """Bytes the guest's scheme paged out so far."""
    return int(envd_call(env, vm, lambda envd: envd.cold_memory())["stats"]["bytesReclaimed"])


def wait_for(condition: Callable[[], bool], what: str, deadline: float = DEADLINE_S) -> None:
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < deadline, f"waited {deadline:.0f} s for {what}"
        time.sleep(1)


def read_sectors(env: Env, vm: VM) -> int:
    """Sectors read so far from the disk holding the guest's root."""
    out = run(env, vm, "dev=$(awk '$2 == \"/\" {print $1}' /proc/mounts); dev=${dev##*/};"
                       " awk -v d=\"$dev\" '$3 == d {print $6}' /proc/diskstats")
    return int(out.strip())


@contextlib.contextmanager
def real_envd_init(env: Env) -> Iterator[None]:
    saved = env.runtime.config.envd_init_path
    env.runtime.config.envd_init_path = "/init"  # the real envd (the test guest's is a CGI)
    try:
        yield
    finally:
        env.runtime.config.envd_init_path = saved


def random_file(path: Path, mib: int) -> str:
    """`mib` MiB of random bytes at `path`; their sha256."""
    digest = hashlib.sha256()
    with path.open("wb") as f:
        for _ in range(mib):
            block = os.urandom(MiB)
            digest.update(block)
            f.write(block)
    return digest.hexdigest()


def test_cold_page_cache_goes_back_to_the_host_and_reads_again(env: Env) -> None:
    from agentenv.guest.build.assets import build_assets

    assets = build_assets(GUEST_CACHE)
    work = env.root / "cold-memory"
    work.mkdir()
    # The files are on the guest's disk from the start, written by the host (random data made
    # by a TCG guest costs tens of seconds); the guest's page cache holds none of them.
    digests: dict[str, str] = {}

    def populate(root: Path) -> None:
        digests["data"] = random_file(root / "data.bin", FILE_MIB)
        random_file(root / "warm.bin", WARM_MIB)

    disks = real_guest_disks(assets, work, DISK_BYTES, populate)
    rt, loop = env.runtime, env.loop
    with real_envd_init(env):
        vm = loop.run(rt.boot(BootSpec(
            kernel=assets.kernel, initramfs=assets.initramfs, cmdline=assets.cmdline_base,
            memory_mib=MEMORY_MIB, disks=disks)))
        try:
            status = envd_call(env, vm, lambda envd: envd.set_cold_memory(SCHEDULE))
            assert status["enabled"] is True and status["minAgeSeconds"] == 10, status
            # The files through the page cache once, then the caches dropped: the guest's free
            # memory is what a guest's that read them and moved on holds (freed pages reported
            # to the host), the timed part starts clean.
            run(env, vm, "cat /data.bin /warm.bin > /dev/null && echo 1 > /proc/sys/vm/drop_caches")
            # As a template's sandbox: a restore of a snapshot holding the DAMON context.
            record = loop.run(rt.pause(vm, wait_teardown=True))
            vm = loop.run(rt.restore(record))
            status = envd_call(env, vm, lambda envd: envd.cold_memory())
            assert status["enabled"] is True and status["minAgeSeconds"] == 10, status

            # A first, small round: QEMU translates (TCG) and allocates for the guest's read,
            # reclaim and reporting paths once, in memory of its own that is not guest RAM;
            # the measured round then sees the guest's memory only. It also shows the restored
            # scheme at work.
            reclaimed_before = reclaimed(env, vm)
            run(env, vm, "cat /warm.bin > /dev/null")
            wait_for(lambda: reclaimed(env, vm) - reclaimed_before >= 0.8 * WARM_MIB * MiB,
                     f"the guest to page out the {WARM_MIB} MiB read first")
            reclaimed_before = reclaimed(env, vm)

            before = held_mib(vm)
            run(env, vm, "cat /data.bin > /dev/null")
            peak = held_mib(vm)
            print(f"\nhost memory of the VM: {before:.0f} MiB, {peak:.0f} MiB after reading "
                  f"{FILE_MIB} MiB")
            # The read is in the host's memory: the page cache of the guest is the host's RAM.
            assert peak - before >= 0.8 * FILE_MIB, (before, peak)

            t0 = time.monotonic()
            target = peak - GIVEN_BACK * FILE_MIB
            while (now := held_mib(vm)) > target:
                elapsed = time.monotonic() - t0
                assert elapsed < DEADLINE_S, (
                    f"after {elapsed:.0f} s the VM's QEMU holds {now:.0f} MiB, {peak - now:.0f} "
                    f"MiB below the {peak:.0f} MiB after the read; {GIVEN_BACK * FILE_MIB:.0f} "
                    f"MiB were to go back (guest: {envd_call(env, vm, lambda e: e.cold_memory())})")
                time.sleep(1)
            elapsed = time.monotonic() - t0
            status = envd_call(env, vm, lambda envd: envd.cold_memory())
            print(f"given back {peak - now:.0f} MiB of {FILE_MIB} in {elapsed:.0f} s "
                  f"({now:.0f} MiB held); guest: {status['stats']}")
            assert reclaimed(env, vm) - reclaimed_before >= GIVEN_BACK * FILE_MIB * MiB, status

            # The files read again, whole and unchanged, from the disk (the cache is gone).
            sectors = read_sectors(env, vm)
            again = run(env, vm, "sha256sum /data.bin")
            assert digests["data"] in again, again
            read_mib = (read_sectors(env, vm) - sectors) * 512 / MiB
            assert read_mib >= GIVEN_BACK * FILE_MIB, f"{read_mib:.0f} MiB read from the disk"
        finally:
            with contextlib.suppress(Exception):
                loop.run(rt.kill(vm))
