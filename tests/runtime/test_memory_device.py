"""Restores from blockd's shared memory device (runtime/memdev.py, blockd/memdev.py): one
read-only FUSE file per snapshot, shared by its VMs' page cache, no raw copy on disk."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import pytest

from agentenv.blockd.client import BlockdClient
from agentenv.runtime.memdev import PACK_NAME, PACK_WINDOW, SharedMemoryDevices
from agentenv.snapshot.record import SnapshotRecord
from agentenv.testing.harness import mapping_kib, pss_kib, sh

from .conftest import Env, count

pytestmark = [pytest.mark.qemu, pytest.mark.root]


def _memory_devices(env: Env) -> list[dict]:
    sock = env.runtime.blockd.socket_path
    with BlockdClient(sock) as client:
        return [d for d in client.call("list")
                if (d.get("source") or "").endswith(".memory.json")]


def _snapshot_dir(record: SnapshotRecord) -> Path:
    return Path(record.device_state).parent


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def test_two_restores_share_one_device_and_its_clean_pages(env: Env, counting: SnapshotRecord) -> None:
    rt = env.runtime
    assert isinstance(rt.memory, SharedMemoryDevices)
    a = env.loop.run(rt.restore(counting))
    b = env.loop.run(rt.restore(counting))
    try:
        assert a.mem_path == b.mem_path
        assert a.mem_path.parent.name == "memfs", f"RAM file is {a.mem_path}, not blockd's device"
        devices = _memory_devices(env)
        assert len(devices) == 1 and devices[0]["source"].endswith(f"-{counting.id}.memory.json")
        assert devices[0]["refcount"] == 1  # the runtime holds one blockd reference...
        assert rt.memory.refcount(counting.id) == 2  # ...for its two VMs
        # No materialised copy of the snapshot's memory anywhere in the runtime's state.
        assert not list(rt.config.memory_dir.glob(f"{counting.id}*"))
        # Both guests run from the snapshot, and read the memory they share.
        for vm in (a, b):
            assert count(env, vm) > 0
            env.loop.run(sh(vm, "cat /bin/busybox > /dev/null; ls -R / > /dev/null 2>&1; echo ok"))
        mem = [pss_kib(vm.pid) for vm in (a, b)]
        ram = [mapping_kib(vm.pid, vm.mem_path) for vm in (a, b)]
        print(f"two restores: process Rss {[m['Rss'] for m in mem]} KiB, Pss "
              f"{[m['Pss'] for m in mem]} KiB; guest RAM mapping {ram}")
        # Clean pages of the device are mapped by both: each counts half in each one's Pss.
        for m in ram:
            assert m["Shared_Clean"] > 8 * 1024, "restores must share the device's clean pages"
            assert m["Pss"] < m["Rss"] - 4 * 1024
        for m in mem:
            assert m["Pss"] < m["Rss"] - 4 * 1024
    finally:
        env.loop.run(rt.kill(a))
        env.loop.run(rt.kill(b))
    # The last VM gone: the device and its image config go too.
    assert rt.memory.refcount(counting.id) == 0
    assert _memory_devices(env) == []
    assert not a.mem_path.exists()


def test_restore_after_page_cache_dropped_and_startup_pack(env: Env, counting: SnapshotRecord) -> None:
    rt = env.runtime
    assert isinstance(rt.memory, SharedMemoryDevices)
    pack = _snapshot_dir(counting) / PACK_NAME
    pack.unlink(missing_ok=True)
    _drop_caches()
    # A fresh device, nothing cached: the restore records the startup pack.
    vm = env.loop.run(rt.restore(counting))
    try:
        first = count(env, vm)
        assert first > 0
        # The load pages are kept at once, the chunk order PACK_WINDOW after the restore.
        deadline = time.monotonic() + PACK_WINDOW + 10
        while not (pack.exists() and "memory" in pack.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        doc = json.loads(pack.read_text())
        assert doc["chunk_size"] == 1 << 20
        chunks = doc["memory"]
        assert chunks and len(chunks) == len(set(chunks))
        assert max(chunks) < counting.machine.memory_bytes >> 20
        # The pages QEMU's start and device-state load mapped: page-aligned, ascending,
        # disjoint, within the RAM, a few hundred KiB (not the 4 MiB windows around each fault
        # that the kernel read for them).
        load = doc["load"]
        assert load and all(o % 4096 == 0 and n > 0 and n % 4096 == 0 for o, n in load)
        assert all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(load))
        assert load[-1][0] + load[-1][1] <= counting.machine.memory_bytes
        assert sum(n for _, n in load) <= 4 << 20
        print(f"startup pack: {len(chunks)} chunks, load {len(load)} ranges, "
              f"{sum(n for _, n in load) >> 10} KiB")
        # A second restore while the first runs, the host's page cache dropped: its acquire
        # reads the load's pages back while QEMU starts.
        _drop_caches()
        rt.memory.last_warm = None
        second = env.loop.run(rt.restore(counting))
        try:
            assert count(env, second) > 0
            deadline = time.monotonic() + 30
            while rt.memory.last_warm is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert rt.memory.last_warm is not None
            assert rt.memory.last_warm["ranges"] == len(load)
            print(f"warm-up of the second restore: {rt.memory.last_warm}, its timings {second.timings}")
        finally:
            env.loop.run(rt.kill(second))
    finally:
        env.loop.run(rt.kill(vm))
    # Again from an empty page cache: this restore prefetches along the pack and runs.
    _drop_caches()
    rt.memory.last_prefetch = None
    rt.memory.last_warm = None
    vm = env.loop.run(rt.restore(counting))
    try:
        assert count(env, vm) > 0
        deadline = time.monotonic() + 30
        while rt.memory.last_prefetch is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rt.memory.last_prefetch is not None
        assert rt.memory.last_prefetch["chunks"] == len(chunks)
        assert rt.memory.last_warm is not None and rt.memory.last_warm["ranges"] == len(load)
    finally:
        env.loop.run(rt.kill(vm))
    assert _memory_devices(env) == []


def test_vm_survives_blockd_killed_and_restarted(env: Env, counting: SnapshotRecord) -> None:
    """The memory device's mount is memfs's, not blockd's: a blockd killed with -9 and started
    again leaves a restored VM running, even as it faults in pages it never touched."""
    from agentenv.blockd import memfs

    rt = env.runtime
    assert env.blockd is not None and env.blockd.proc is not None
    vm = env.loop.run(rt.restore(counting))
    try:
        before = count(env, vm)
        state = env.root / "state"
        memfs_pid = memfs.live_pid(state)
        assert memfs_pid is not None
        env.blockd.proc.kill()
        env.blockd.proc.wait(10)
        _drop_caches()  # the host forgets the device's clean pages: they come from memfs again
        # The guest takes 48 MiB it never touched since the restore (each page read first).
        out = env.loop.run(sh(vm, "yes 0123456789abcdef | head -c 50331648 > /tmp/big; "
                                  "md5sum /tmp/big | cut -c1-8; rm /tmp/big", timeout=180))
        assert len(out.strip()) == 8, out
        env.blockd.start()  # same state directory: devices come back from their records
        assert memfs.live_pid(state) == memfs_pid, "memfs must outlive blockd"
        assert count(env, vm) > before
        assert len(_memory_devices(env)) == 1
    finally:
        env.loop.run(rt.kill(vm))
    assert _memory_devices(env) == []


def test_memory_open_refuses_bad_input(env: Env, counting: SnapshotRecord) -> None:
    from agentenv.blockd.errors import BlockdError

    with BlockdClient(env.runtime.blockd.socket_path) as client:
        with pytest.raises(BlockdError, match="memory key"):
            client.call("memory_open", key="../x", layers=[counting.memory_layers[0].path],
                        size=counting.machine.memory_bytes)
        with pytest.raises(BlockdError, match="does not exist"):
            client.call("memory_open", key="k", layers=["/nonexistent/layer"], size=4096)
        with pytest.raises(BlockdError, match="not 1"):
            client.call("memory_open", key="k2", layers=[counting.memory_layers[0].path], size=1)
