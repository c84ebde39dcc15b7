"""blockd's native data path: connections served by native threads (several devices on
several threads at once, without the GIL), with flush/trim/write-zeroes and seals interleaved."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv.blockd import nbd
from agentenv.blockd.device import Device, DeviceRecord
from agentenv.storage import native
from agentenv.storage.image import Image
from tests.blockd.conftest import Daemon, Stack
from tests.blockd.nbdclient import CMD_TRIM, CMD_WRITE_ZEROES, NbdClient
from tests.blockd.test_lifecycle import seq_of, stamp

if not native.available():  # the project's build compiles it (make venv): not built is a failure
    pytest.fail(f"native core not built: {native.unavailable_reason()}", pytrace=False)

BLOCK = 4096
MiB = 1 << 20


def _native_threads(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (name, CPU ns) of the process's native serving threads."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            if name.startswith("nbd:"):
                cpu_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
                out[int(tid)] = (name, cpu_ns)
    return out


@pytest.mark.slow
def test_many_connections_on_many_devices_with_seals(daemon: Daemon, stack: Stack,
                                                     short_tmp: Path) -> None:
    """Three devices, two connections each (each owning its own blocks), random writes,
    trims, write-zeroes and flushes while the devices are sealed twice: every block reads
    what its last operation left; each device is served by threads of its own."""
    nblocks = stack.size // BLOCK
    with daemon.client() as client:
        infos = [client.create(lowers=stack.lowers, upper_dir=short_tmp / f"up{n}")
                 for n in range(3)]
    models: dict[tuple[str, int], bytes] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    started = threading.Barrier(7)

    def worker(info: object, part: int) -> None:
        rng = random.Random(part)
        conn = NbdClient(info.nbd, info.export)  # type: ignore[attr-defined]
        mine = list(range(part % 2, nblocks, 2))  # the two connections of a device split it
        started.wait(30)
        try:
            for i in range(400):
                block = rng.choice(mine)
                kind = rng.random()
                if kind < 0.7:
                    data = f"{part}:{i}:".encode().ljust(BLOCK, bytes([part]))
                    conn.write(block * BLOCK, data)
                elif kind < 0.85:
                    error, _ = conn.request(CMD_TRIM, block * BLOCK, BLOCK)
                    assert error == 0
                    data = bytes(BLOCK)
                else:
                    error, _ = conn.request(CMD_WRITE_ZEROES, block * BLOCK, BLOCK)
                    assert error == 0
                    data = bytes(BLOCK)
                with lock:
                    models[(info.id, block)] = data  # type: ignore[attr-defined]
                if i % 40 == 0:
                    conn.flush()
        except BaseException as exc:
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(info, 2 * n + k))
               for n, info in enumerate(infos) for k in range(2)]
    for t in threads:
        t.start()
    started.wait(30)
    with daemon.client() as client:
        for info in infos:  # seals while the writers run
            client.snapshot(info.id)
        for info in infos:
            client.snapshot(info.id)
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert daemon.proc is not None
    for info in infos:
        conn = NbdClient(info.nbd, info.export)
        disk = b"".join(conn.read(pos, 1 << 20) for pos in range(0, stack.size, 1 << 20))
        conn.close()
        for block in range(nblocks):
            want = models.get((info.id, block),
                              stack.expected[block * BLOCK : (block + 1) * BLOCK])
            assert disk[block * BLOCK : (block + 1) * BLOCK] == want, (info.id, block)


@pytest.mark.slow
@pytest.mark.skipif(native.available() and not native.enabled(),
                    reason=f"{native.ENV_SWITCH}=0: blockd serves on the Python path")
def test_two_devices_are_served_by_two_native_threads_at_once(daemon: Daemon, stack: Stack,
                                                              short_tmp: Path) -> None:
    with daemon.client() as client:
        a = client.create(lowers=stack.lowers, upper_dir=short_tmp / "a")
        b = client.create(lowers=stack.lowers, upper_dir=short_tmp / "b")
    conns = [NbdClient(a.nbd, a.export), NbdClient(b.nbd, b.export)]
    for conn in conns:  # both connections open and serving at the same time
        for i in range(200):
            conn.write(i * BLOCK, bytes([i % 256]) * BLOCK)
            assert conn.read(i * BLOCK, BLOCK) == bytes([i % 256]) * BLOCK
    assert daemon.proc is not None
    threads = _native_threads(daemon.proc.pid)
    by_name = {name: (tid, cpu) for tid, (name, cpu) in threads.items()}
    assert f"nbd:{a.id}" in by_name and f"nbd:{b.id}" in by_name, threads
    assert by_name[f"nbd:{a.id}"][0] != by_name[f"nbd:{b.id}"][0]
    assert by_name[f"nbd:{a.id}"][1] > 0 and by_name[f"nbd:{b.id}"][1] > 0
    for conn in conns:
        conn.close()


@pytest.mark.slow
def test_kill9_under_writes_on_several_devices_keeps_every_flushed_write(
        daemon: Daemon, stack: Stack, short_tmp: Path) -> None:
    """Two devices, two connections each, writing and flushing; blockd is killed (-9) once
    every connection has flushed a few times; after a restart every block holds at least the
    last write its connection had flushed."""
    nblocks = 256
    with daemon.client() as client:
        infos = [client.create(lowers=stack.lowers, upper_dir=short_tmp / f"k{n}")
                 for n in range(2)]
    flushed: dict[int, int] = {}
    flushes = {part: 0 for part in range(4)}
    stop = threading.Event()

    def writer(info: object, part: int) -> None:
        conn = NbdClient(info.nbd, info.export)  # type: ignore[attr-defined]
        seq = 0
        try:
            while not stop.is_set():
                seq += 1
                block = part % 2 + 2 * (seq % (nblocks // 2))  # the two connections interleave
                conn.write(block * BLOCK, stamp(part * 10**6 + seq))
                if seq % 20 == 0:
                    conn.flush()
                    flushed[part] = seq
                    flushes[part] += 1
        except (OSError, ConnectionError):
            pass  # the daemon died under us
        finally:
            conn.sock.close()

    threads = [threading.Thread(target=writer, args=(infos[part // 2], part)) for part in range(4)]
    for t in threads:
        t.start()
    for _ in range(600):  # until every connection has flushed a few times
        if all(n >= 3 for n in flushes.values()):
            break
        threading.Event().wait(0.05)
    daemon.kill9()
    stop.set()
    for t in threads:
        t.join(30)
    assert all(n >= 3 for n in flushes.values()), flushes
    daemon.start()
    for n, info in enumerate(infos):
        conn = NbdClient(info.nbd, info.export)
        state = [seq_of(conn.read(b * BLOCK, BLOCK)) for b in range(nblocks)]
        conn.close()
        for part in (2 * n, 2 * n + 1):
            last = flushed[part]
            for seq in range(max(1, last - nblocks // 2 + 1), last + 1):
                block = part % 2 + 2 * (seq % (nblocks // 2))
                assert state[block] >= part * 10**6 + seq, (info.id, part, block, seq)


_CLIENT = r"""
import sys
sys.path.insert(0, sys.argv[3])
from tests.blockd.nbdclient import NbdClient
status = 1
try:
    conn = NbdClient(sys.argv[1], "disk", timeout=15)
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(300):
        conn.write(i * 4096, bytes([i % 251]) * 4096)
    conn.flush()
    ok = all(conn.read(i * 4096, 4096) == bytes([i % 251]) * 4096 for i in range(300))
    status = 0 if ok else 2
finally:
    import os
    os.write(int(sys.argv[2]), bytes([status]))
"""


@contextlib.contextmanager
def _served(image: native.NativeImage, sock_path: str) -> Iterator[None]:
    """Serve `image` over NBD at `sock_path` from an event loop on a thread of this process."""
    loop = asyncio.new_event_loop()
    executor = ThreadPoolExecutor(2)
    servers: list[asyncio.AbstractServer] = []

    async def start() -> None:
        record = DeviceRecord(id="disk", kind="disk", socket=sock_path, source=None,
                              upper_dir=None, owns_upper=False, readonly=False,
                              size=image.virtual_size)
        device = Device(record, image, executor)
        servers.append(await nbd.start_unix_server(sock_path,
                                                   nbd.SingleExportTable("disk", device)))

    async def shutdown() -> None:
        for server in servers:
            server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)

    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        yield
    finally:
        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(60)  # clients are gone
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        loop.close()
        executor.shutdown()


def test_native_connection_is_served_while_python_holds_the_gil(stack: Stack,
                                                                 short_tmp: Path) -> None:
    """A connection keeps being served while this process's GIL is held by a blocking C
    call: the request loop never needs Python. (On the Python path the client times out.)"""
    image = native.NativeImage.create(stack.lowers, short_tmp / "up")
    sock_path = str(short_tmp / "disk.sock")
    status_r, status_w = os.pipe()
    root = str(Path(__file__).resolve().parents[2])
    try:
        with _served(image, sock_path):
            client = subprocess.Popen(
                [sys.executable, "-c", _CLIENT, sock_path, str(status_w), root],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(status_w,))
            try:
                assert client.stdout is not None and client.stdin is not None
                assert client.stdout.readline() == b"ready\n"
                # Wait for the hand-over: the core names its thread after the export right
                # before it lets go of the GIL for good.
                deadline = 300
                while deadline and not any(
                        name == "nbd:disk" for name, _ in _native_threads(os.getpid()).values()):
                    deadline -= 1
                    threading.Event().wait(0.1)
                assert deadline, "the connection was not handed to a native thread"
                client.stdin.write(b"go\n")
                client.stdin.flush()
                buf = ctypes.create_string_buffer(1)
                # PyDLL keeps the GIL across the call: nothing in Python runs until the
                # client reports (it gives up after 15 s without replies).
                got = ctypes.PyDLL(None).read(status_r, buf, 1)
                assert got == 1
                assert buf.raw == b"\x00", f"client status {buf.raw[0]}"
            finally:
                client.kill()
                client.wait(10)
    finally:
        os.close(status_r)
        os.close(status_w)
        image.close()


_nbd_ops = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["write", "write_fua"]), st.integers(0, 4 * MiB - 1),
                  st.integers(1, 70 * 1024), st.integers(0, 255)),
        st.tuples(st.sampled_from(["trim", "zeroes"]), st.integers(0, 4 * MiB - 1),
                  st.integers(1, 300 * 1024), st.just(0)),
        # Reads of 512 KiB and more are split over helper threads on a multi-core host.
        st.tuples(st.just("read"), st.integers(0, 4 * MiB - 1), st.integers(1, 1200 * 1024),
                  st.just(0)),
        st.tuples(st.just("flush"), st.just(0), st.just(0), st.just(0)),
    ),
    min_size=1, max_size=40,
)


def test_nbd_requests_on_the_native_loop_match_the_reference(stack: Stack,
                                                             short_tmp: Path) -> None:
    """Random NBD requests (unaligned writes, FUA, trims, write-zeroes, reads, flushes) sent
    to the native loop read back exactly what the reference Image gives for the same
    operations."""
    image = native.NativeImage.create(stack.lowers, short_tmp / "nat")
    reference = Image.create(stack.lowers, short_tmp / "ref")
    sock_path = str(short_tmp / "disk.sock")
    size = stack.size
    try:
        with _served(image, sock_path):
            conn = NbdClient(sock_path, "disk")

            @settings(max_examples=60, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow,
                                             HealthCheck.function_scoped_fixture])
            @given(sequence=_nbd_ops)
            def run(sequence: list[tuple[str, int, int, int]]) -> None:
                for kind, offset, length, fill in sequence:
                    length = min(length, size - offset)
                    if kind.startswith("write"):
                        data = bytes([fill]) * length
                        conn.write(offset, data, fua=kind == "write_fua")
                        reference.write(offset, data)
                    elif kind in ("trim", "zeroes"):
                        error, _ = conn.request(CMD_TRIM if kind == "trim" else CMD_WRITE_ZEROES,
                                                offset, length)
                        assert error == 0
                        reference.write_zeroes(offset, length)
                    elif kind == "read":
                        assert conn.read(offset, length) == reference.read(offset, length)
                    else:
                        conn.flush()

            run()
            disk = b"".join(conn.read(pos, MiB) for pos in range(0, size, MiB))
            assert disk == reference.read(0, size)
            conn.close()
    finally:
        image.close()
        reference.close()
