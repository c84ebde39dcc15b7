"""Snapshots under load, crashes, restarts, hostile clients and the FUSE file."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agentenv.storage.export import export_raw
from agentenv.storage.image import Image

from .conftest import Daemon, MiB, Stack, nbd_uri, run
from .nbdclient import CMD_READ, CMD_WRITE, IHAVEOPT, REQUEST_MAGIC, NbdClient, recv_exact

BLOCK = 4096


def stamp(seq: int) -> bytes:
    """A block that names the write that made it."""
    return struct.pack(">Q", seq) * (BLOCK // 8)


def seq_of(block: bytes) -> int:
    return struct.unpack_from(">Q", block)[0]


def stack_state(lowers: list[Path], nblocks: int) -> list[int]:
    with Image.create(lowers, None) as image:
        data = image.read(0, nblocks * BLOCK)
    return [seq_of(data[i * BLOCK : (i + 1) * BLOCK]) for i in range(nblocks)]


def check_prefix(state: list[int], nblocks: int) -> int:
    """The stack must be exactly the result of writes 1..S for some S (writes go round-robin
    over the blocks, write n to block n % nblocks): no write lost, none reordered."""
    top = max(state)
    for block, got in enumerate(state):
        expected = max((s for s in range(block, top + 1, nblocks) if s > 0), default=0)
        assert got == expected, f"block {block}: has write {got}, expected {expected} (top {top})"
    return top


@pytest.mark.slow
def test_snapshot_while_a_client_writes(daemon: Daemon, short_tmp: Path) -> None:
    nblocks = 256
    with daemon.client() as client:
        info = client.create_blank(nblocks * BLOCK, upper_dir=short_tmp / "up")
    acked = 0
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        nonlocal acked
        try:
            nbd = NbdClient(info.nbd, info.export)
            seq = 1
            while not stop.is_set():
                nbd.write((seq % nblocks) * BLOCK, stamp(seq))
                acked = seq
                seq += 1
            nbd.close()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    layers: list[tuple[Path, int, int]] = []
    try:
        with daemon.client() as client:
            for _ in range(4):
                time.sleep(0.3)
                before = acked
                layer = client.snapshot(info.id)
                after = acked
                layers.append((layer, before, after))
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
    assert acked > 200, f"only {acked} writes went through"
    # Each sealed layer, on top of the previous ones, is a clean cut of the write sequence,
    # holding every write acknowledged before the snapshot was asked for.
    for k, (_layer, before, after) in enumerate(layers):
        top = check_prefix(stack_state([p for p, _, _ in layers[: k + 1]], nblocks), nblocks)
        assert before <= top <= after + 1, (before, top, after)
    # The live device holds them all.
    nbd = NbdClient(info.nbd, info.export)
    live = [seq_of(nbd.read(i * BLOCK, BLOCK)) for i in range(nblocks)]
    nbd.close()
    assert check_prefix(live, nblocks) == acked


@pytest.mark.slow
def test_kill9_keeps_flushed_writes_and_sealed_layers(daemon: Daemon, stack: Stack, short_tmp: Path) -> None:
    nblocks = 512
    with daemon.client() as client:
        info = client.create(lowers=stack.lowers, upper_dir=short_tmp / "up")
        nbd = NbdClient(info.nbd, info.export)
        for seq in range(1, 65):
            nbd.write((seq % nblocks) * BLOCK, stamp(seq))
        nbd.flush()
        sealed = client.snapshot(info.id)
    sealed_hash = hashlib.sha256(sealed.read_bytes()).hexdigest()
    flushed = 64
    seq = 65
    stop = threading.Event()

    def writer() -> None:
        nonlocal flushed, seq
        try:
            while not stop.is_set():
                nbd.write((seq % nblocks) * BLOCK, stamp(seq))
                if seq % 50 == 0:
                    nbd.flush()
                    flushed = seq
                seq += 1
        except (OSError, ConnectionError):
            pass  # the daemon died under us: that is the point

    thread = threading.Thread(target=writer)
    thread.start()
    time.sleep(1.0)
    daemon.kill9()
    stop.set()
    thread.join(10)
    nbd.sock.close()
    assert flushed > 64, "no flush completed while writing"

    daemon.start()
    with daemon.client() as client:
        (again,) = client.list()
    assert again.id == info.id and again.nbd == info.nbd and again.size == stack.size
    assert hashlib.sha256(sealed.read_bytes()).hexdigest() == sealed_hash
    nbd = NbdClient(again.nbd, again.export)
    state = [seq_of(nbd.read(i * BLOCK, BLOCK)) for i in range(nblocks)]
    for block in range(nblocks):
        last_flushed = max((s for s in range(block, flushed + 1, nblocks) if s > 0), default=0)
        if last_flushed:
            assert state[block] >= last_flushed, f"block {block} lost write {last_flushed}"
    # The upper reopened writable.
    nbd.write(0, stamp(10**6))
    nbd.flush()
    assert seq_of(nbd.read(0, BLOCK)) == 10**6
    nbd.close()


def _raw_connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    recv_exact(sock, 18)
    sock.sendall(struct.pack(">I", 3))
    return sock


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_malformed_traffic_is_refused_and_others_keep_serving(daemon: Daemon, stack: Stack) -> None:
    with daemon.client() as client:
        victim = client.create(lowers=stack.lowers)
        bystander = client.create(lowers=stack.lowers)
    reader = NbdClient(bystander.nbd, bystander.export)

    # Bad option magic: the server hangs up.
    sock = _raw_connect(victim.nbd)
    sock.sendall(struct.pack(">QII", 0xDEADBEEF, 7, 0))
    assert _closed(sock)
    # Unknown option: an ERR_UNSUP reply, and negotiation goes on.
    sock = _raw_connect(victim.nbd)
    sock.sendall(struct.pack(">QII", IHAVEOPT, 4242, 3) + b"abc")
    _magic, option, reply, length = struct.unpack(">QIII", recv_exact(sock, 20))
    recv_exact(sock, length)
    assert option == 4242 and reply == (1 << 31) | 1
    # ... a GO with a truncated payload gets ERR_INVALID, an unknown export ERR_UNKNOWN.
    sock.sendall(struct.pack(">QII", IHAVEOPT, 7, 3) + b"\0\0\0")
    _magic, option, reply, length = struct.unpack(">QIII", recv_exact(sock, 20))
    recv_exact(sock, length)
    assert reply == (1 << 31) | 3
    sock.sendall(struct.pack(">QII", IHAVEOPT, 7, 9) + struct.pack(">I", 3) + b"zzz" + b"\0\0")
    _magic, option, reply, length = struct.unpack(">QIII", recv_exact(sock, 20))
    recv_exact(sock, length)
    assert reply == (1 << 31) | 6
    sock.close()
    # Oversized option payload: hang up rather than buffer it.
    sock = _raw_connect(victim.nbd)
    sock.sendall(struct.pack(">QII", IHAVEOPT, 7, 0xFFFFFFF0))
    assert _closed(sock)

    nbd = NbdClient(victim.nbd, victim.export)
    # Huge read: an error reply, and the connection stays usable.
    assert nbd.request(CMD_READ, 0, 0xFFFFFFFF)[0] in (22, 75)
    assert nbd.read(0, 512) == stack.expected[:512]
    # Truncated request, then the client vanishes.
    nbd.sock.sendall(struct.pack(">IHHQ", REQUEST_MAGIC, 0, CMD_WRITE, 7)[:14])
    nbd.sock.close()
    # A bad request magic, and a write too large to buffer: the server hangs up.
    nbd = NbdClient(victim.nbd, victim.export)
    nbd.sock.sendall(struct.pack(">IHHQQI", 0x12345678, 0, CMD_READ, 1, 0, 512))
    assert _closed(nbd.sock)
    nbd = NbdClient(victim.nbd, victim.export)
    nbd.sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_WRITE, 9, 0, 0x7FFFFFFF))
    _magic, error, handle = struct.unpack(">IIQ", recv_exact(nbd.sock, 16))
    assert (error, handle) == (22, 9)
    assert _closed(nbd.sock)
    # Garbage before negotiation even starts.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(victim.nbd)
    recv_exact(sock, 18)
    sock.sendall(b"\xff" * 64)
    assert _closed(sock)

    # The daemon, the victim device and the other device all still serve.
    assert reader.read(4096, 4096) == stack.expected[4096:8192]
    reader.close()
    out = run(["qemu-io", "-f", "raw", "-c", "read 0 1M", nbd_uri(victim)]).stdout
    assert "read 1048576/1048576" in out
    assert daemon.alive()
    with daemon.client() as client:
        assert {d.id for d in client.list()} == {victim.id, bystander.id}


@pytest.mark.root
def test_fuse_file_takes_ext4_and_the_sealed_layer_alone_holds_it(daemon: Daemon, short_tmp: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("loop mounts need root")
    with daemon.client() as client:
        info = client.create_blank(64 * MiB, upper_dir=short_tmp / "up")
    assert info.file is not None
    disk = Path(info.file)
    assert disk.stat().st_size == 64 * MiB
    run(["mkfs.ext4", "-q", "-F", str(disk)])
    mnt = short_tmp / "mnt"
    mnt.mkdir()
    run(["mount", "-o", "loop", str(disk), str(mnt)])
    try:
        (mnt / "hello.txt").write_text("hello from blockd\n")
        payload = os.urandom(3 * MiB)
        (mnt / "sub").mkdir()
        (mnt / "sub" / "blob.bin").write_bytes(payload)
        (mnt / "gone.bin").write_bytes(os.urandom(4 * MiB))
        (mnt / "gone.bin").unlink()
        run(["sync"])
        run(["fstrim", str(mnt)])
    finally:
        run(["umount", str(mnt)])
    run(["e2fsck", "-fn", str(disk)])
    with daemon.client() as client:
        stats = next(d for d in client.list() if d.id == info.id).stats
        assert stats["trims"] > 0, "mkfs/fstrim discards did not reach the device"
        layer = client.snapshot(info.id)
    # The sealed layer alone is the whole filesystem.
    with Image.open(layer, writable=False) as image:
        export_raw(image, short_tmp / "fs.raw")
    run(["e2fsck", "-fn", str(short_tmp / "fs.raw")])
    cat = run(["debugfs", "-R", "cat /hello.txt", str(short_tmp / "fs.raw")]).stdout
    assert cat == "hello from blockd\n"
    blob = subprocess.run(["debugfs", "-R", "cat /sub/blob.bin", str(short_tmp / "fs.raw")],
                          capture_output=True, check=True).stdout
    assert blob == payload
    # The device goes on, on a fresh upper over the sealed layer.
    assert disk.read_bytes() == (short_tmp / "fs.raw").read_bytes()


def test_restart_brings_back_disk_and_shared_devices(daemon: Daemon, stack: Stack, short_tmp: Path) -> None:
    with daemon.client() as client:
        disk = client.create(lowers=stack.lowers, upper_dir=short_tmp / "t", size=stack.size)
        shared = client.create(image=stack.lowers[1], readonly=True)
        client.create(image=stack.lowers[1], readonly=True)
        nbd = NbdClient(disk.nbd, disk.export)
        nbd.write(8192, b"\x5a" * 4096)
        nbd.flush()
        nbd.close()
        # A client still connected when its device is released is cut off, not left hanging.
        blank = client.create_blank(MiB)
        hanging = NbdClient(blank.nbd, blank.export)
        client.release(blank.id)
        assert _closed(hanging.sock)
    daemon.stop()
    # Records of the warm device pool of older versions: an idle device held nothing and is
    # dropped; a taken one comes back as an ordinary disk.
    records = daemon.state_dir / "devices"
    record = json.loads((records / f"{disk.id}.json").read_text())
    (records / f"{disk.id}.json").write_text(json.dumps({**record, "kind": "pool", "taken": True}))
    idle_socket = daemon.state_dir / "nbd" / "didle.sock"
    idle_socket.touch()
    (records / "didle.json").write_text(json.dumps({
        "id": "didle", "kind": "pool", "socket": str(idle_socket), "source": None,
        "upper_dir": None, "owns_upper": False, "readonly": False, "size": MiB, "taken": False}))
    daemon.start()
    with daemon.client() as client:
        devices = {d.id: d for d in client.list()}
        # The shared device is found again by its source: one more create is one more ref.
        assert client.create(image=stack.lowers[1], readonly=True).id == shared.id
    assert set(devices) == {disk.id, shared.id}
    assert not (records / "didle.json").exists() and not idle_socket.exists()
    assert devices[shared.id].refcount == 2 and devices[shared.id].readonly
    again = devices[disk.id]
    assert again.nbd == disk.nbd and again.kind == "disk"
    assert json.loads((records / f"{disk.id}.json").read_text())["kind"] == "disk"
    nbd = NbdClient(again.nbd, again.export)
    assert nbd.read(8192, 4096) == b"\x5a" * 4096
    assert nbd.read(0, 8192) == stack.expected[:8192]
    nbd.close()


def listening_addresses(port: int) -> set[str]:
    """The local addresses TCP sockets listen on at `port` (/proc/net/tcp and tcp6)."""
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(socket.inet_ntop(family, words))
    return found


def test_metrics_endpoint_counts_per_device(short_tmp: Path, stack: Stack) -> None:
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = Daemon(short_tmp, fuse=False)
    d.extra_args = ["--metrics-port", str(port)]
    d.start()
    try:
        with d.client() as client:
            info = client.create(lowers=stack.lowers)
        nbd = NbdClient(info.nbd, info.export)
        for i in range(5):
            nbd.read(i * 4096, 4096)
        nbd.write(0, bytes(4096))
        nbd.close()
        # The native core's counters reach the metrics every second or when a device's info
        # is read: read it, so the scrape does not race the fold.
        with d.client() as client:
            client.list()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        # loopback only, unless told (--metrics-bind): not the node's network's to read
        assert listening_addresses(port) == {"127.0.0.1"}
    finally:
        d.stop()
    assert f'aenv_blockd_reads_total{{device="{info.id}"}} 5.0' in text
    assert f'aenv_blockd_writes_total{{device="{info.id}"}} 1.0' in text
    assert "aenv_blockd_devices 1.0" in text
