"""blockd devices read and written by real NBD clients: qemu-img, qemu-io, nbdinfo, nbdcopy."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from agentenv.blockd.errors import BlockdError
from agentenv.storage.export import export_raw
from agentenv.storage.image import Image

from .conftest import Daemon, MiB, Stack, nbd_uri, run


def exported(source: Path, out: Path) -> bytes:
    """The bytes `aenv image export` produces for an image."""
    with Image.open(source, writable=False) as image:
        export_raw(image, out)
    return out.read_bytes()


def test_stack_reads_back_exactly_the_exported_bytes(daemon: Daemon, stack: Stack, short_tmp: Path) -> None:
    with daemon.client() as client:
        info = client.create(lowers=stack.lowers)
    assert info.size == stack.size and not info.readonly
    assert Path(info.nbd).is_socket()
    # The reference export of the same stack, through the storage engine.
    with Image.create(stack.lowers, None) as ro_image:
        export_raw(ro_image, short_tmp / "ref.raw")
    reference = (short_tmp / "ref.raw").read_bytes()
    assert reference == stack.expected

    run(["qemu-img", "convert", "-f", "raw", "-O", "raw", nbd_uri(info), str(short_tmp / "qemu.raw")])
    assert (short_tmp / "qemu.raw").read_bytes() == reference
    run(["nbdcopy", nbd_uri(info), str(short_tmp / "nbdcopy.raw")])
    assert (short_tmp / "nbdcopy.raw").read_bytes() == reference

    listing = json.loads(run(["nbdinfo", "--json", nbd_uri(info)]).stdout)
    export = listing["exports"][0]
    assert export["export-name"] == info.export
    assert export["export-size"] == stack.size
    assert export["is_read_only"] is False and export["can_flush"] and export["can_trim"]
    names = run(["nbdinfo", "--list", "--json", f"nbd+unix://?socket={info.nbd}"]).stdout
    assert [e["export-name"] for e in json.loads(names)["exports"]] == [info.export]


def test_write_flush_reconnect_read_back(daemon: Daemon, stack: Stack) -> None:
    with daemon.client() as client:
        info = client.create(lowers=stack.lowers)
    uri = nbd_uri(info)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0xa5 1M 256k", "-c", "write -P 0x3c -f 5M 4k",
         "-c", "write -P 0x11 100 1000", "-c", "flush", uri])
    out = run(["qemu-io", "-f", "raw", "-c", "read -P 0xa5 1M 256k", "-c", "read -P 0x3c 5M 4k",
               "-c", "read -P 0x11 100 1000", uri]).stdout
    assert "Pattern verification failed" not in out, out
    # Bytes around the unaligned write are the stack's own.
    with daemon.client() as client:
        image_file = Path(client.list()[0].file or "")
    data = image_file.read_bytes()
    assert data[:100] == stack.expected[:100]
    assert data[1100:4096] == stack.expected[1100:4096]
    stats = next(d for d in daemon.client().list() if d.id == info.id).stats
    assert stats["writes"] >= 3 and stats["bytes_written"] >= 256 * 1024 + 4096 + 1000


def test_trim_and_write_zeroes_read_as_zeros(daemon: Daemon, stack: Stack) -> None:
    with daemon.client() as client:
        info = client.create(lowers=stack.lowers)
    uri = nbd_uri(info)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0x77 0 4M", "-c", "discard 64k 1M",
         "-c", "write -z 2M 1M", "-c", "write -z 3M 1000", "-c", "flush", uri])
    out = run(["qemu-io", "-f", "raw", "-c", "read -P 0 64k 1M", "-c", "read -P 0 2M 1M",
               "-c", "read -P 0 3M 1000", "-c", "read -P 0x77 0 64k",
               "-c", "read -P 0x77 1088k 960k", uri]).stdout
    assert "Pattern verification failed" not in out, out


def test_out_of_range_requests_get_errors_not_disconnects(daemon: Daemon, stack: Stack) -> None:
    from .nbdclient import CMD_READ, CMD_WRITE, NbdClient

    with daemon.client() as client:
        info = client.create(lowers=stack.lowers)
    nbd = NbdClient(info.nbd, info.export)
    assert nbd.size == stack.size
    assert nbd.request(CMD_READ, stack.size - 512, 1024)[0] == 22  # EINVAL
    assert nbd.request(CMD_WRITE, stack.size, 512, bytes(512))[0] == 28  # ENOSPC
    assert nbd.request(99, 0, 0)[0] == 22  # unknown command
    assert nbd.read(0, 4096) == stack.expected[:4096]  # the connection still works
    nbd.close()
    stats = next(d for d in daemon.client().list() if d.id == info.id).stats
    assert stats["errors"] == 3


def test_readonly_image_is_shared_with_a_refcount(daemon: Daemon, stack: Stack, short_tmp: Path) -> None:
    layer = stack.lowers[0]
    with daemon.client() as client:
        first = client.create(image=layer, readonly=True)
        second = client.create(image=layer, readonly=True)
        assert first.id == second.id and second.refcount == 2 and second.readonly
        info = json.loads(run(["nbdinfo", "--json", nbd_uri(first)]).stdout)["exports"][0]
        assert info["is_read_only"] is True
        # Two clients read at once.
        readers = [subprocess.Popen(["nbdcopy", nbd_uri(first), str(short_tmp / f"r{i}.raw")])
                   for i in range(2)]
        assert [p.wait(60) for p in readers] == [0, 0]
        ref = exported(layer, short_tmp / "ref.raw")
        assert (short_tmp / "r0.raw").read_bytes() == ref == (short_tmp / "r1.raw").read_bytes()
        write = subprocess.run(["qemu-io", "-f", "raw", "-c", "write 0 4k", nbd_uri(first)],
                               capture_output=True, text=True)
        assert write.returncode != 0 or "failed" in (write.stdout + write.stderr).lower()
        assert client.release(first.id) == 1
        assert client.release(first.id) == 0
        assert client.list() == []
        with pytest.raises(BlockdError, match="no device"):
            client.release(first.id)


def test_blank_disk_resize_and_bad_requests(daemon: Daemon, short_tmp: Path) -> None:
    with daemon.client() as client:
        blank = client.create_blank(8 * MiB, upper_dir=short_tmp / "blank")
        assert blank.size == 8 * MiB and (short_tmp / "blank" / "image.json").exists()
        out = run(["qemu-io", "-f", "raw", "-c", "read -P 0 0 8M", nbd_uri(blank)]).stdout
        assert "Pattern verification failed" not in out
        grown = client.resize(blank.id, 12 * MiB)
        assert grown.size == 12 * MiB
        assert json.loads(run(["nbdinfo", "--json", nbd_uri(blank)]).stdout)["exports"][0][
            "export-size"] == 12 * MiB
        with pytest.raises(BlockdError, match="does not exist"):
            client.create(image=short_tmp / "missing.json")
        with pytest.raises(BlockdError, match="needs a size"):
            client.create()
        with pytest.raises(BlockdError, match="no device"):
            client.snapshot("nope")
        with pytest.raises(BlockdError, match="unknown op"):
            client.call("frobnicate")
        with pytest.raises(BlockdError, match="already holds an image"):
            client.create_blank(MiB, upper_dir=short_tmp / "blank")


def test_disk_cli_talks_to_the_daemon(daemon: Daemon, stack: Stack, short_tmp: Path) -> None:
    import sys

    aenv = [sys.executable, "-m", "agentenv.cli.main"]
    sock = ["--socket", str(daemon.socket)]
    with daemon.client() as client:
        base = client.create(lowers=stack.lowers, upper_dir=short_tmp / "base")
        client.snapshot(base.id)
        client.release(base.id)
    config = short_tmp / "base" / "image.json"
    # A config with an upper must be refused as a base; an image config of sealed layers works.
    bad = subprocess.run([*aenv, "disk", "create", "--image", str(config), *sock],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "writable upper" in bad.stderr and "Traceback" not in bad.stderr
    with Image.open(config, writable=False) as image:
        lowers = image.lowers
    ro_config = short_tmp / "ro.json"
    ro_config.write_text(json.dumps({"lowers": [{"file": str(p)} for p in lowers]}))
    created = json.loads(run([*aenv, "disk", "create", "--image", str(ro_config), *sock]).stdout)
    assert {"id", "nbd", "export", "file"} <= created.keys()
    assert created["size"] == stack.size
    layer = Path(run([*aenv, "disk", "snapshot", created["id"], *sock]).stdout.strip())
    assert layer.is_file()
    listing = run([*aenv, "disk", "ls", "--json", *sock]).stdout.splitlines()
    assert [json.loads(line)["id"] for line in listing] == [created["id"]]
    run([*aenv, "disk", "rm", created["id"], *sock])
    assert run([*aenv, "disk", "ls", "--json", *sock]).stdout.strip() == ""
    down = subprocess.run([*aenv, "disk", "ls", "--socket", str(short_tmp / "nothing.sock")],
                          capture_output=True, text=True)
    assert down.returncode == 1 and "cannot reach blockd" in down.stderr
    # No --socket: the blockd `make up` starts under $AENV_HOME (<home>/blockd/blockd.sock).
    home = short_tmp / "home"
    (home / "blockd").mkdir(parents=True)
    (home / "blockd" / "blockd.sock").symlink_to(daemon.socket)
    env = {k: v for k, v in os.environ.items() if k != "AENV_BLOCKD_SOCKET"} | {"AENV_HOME": str(home)}
    found = subprocess.run([*aenv, "disk", "ls", "--json"], capture_output=True, text=True, env=env)
    assert found.returncode == 0, found.stderr
    helptext = run([*aenv, "disk", "ls", "--help"]).stdout
    assert "AENV_HOME/blockd/blockd.sock" in helptext


def test_nbd_serve_without_daemon(stack: Stack, short_tmp: Path) -> None:
    import sys
    import time

    sock = short_tmp / "one.sock"
    layer = stack.lowers[0]
    proc = subprocess.Popen([sys.executable, "-m", "agentenv.cli.main", "nbd", "serve", str(layer),
                             "--socket", str(sock)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while not sock.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        info = json.loads(run(["nbdinfo", "--json", f"nbd+unix:///disk?socket={sock}"]).stdout)
        assert info["exports"][0]["is_read_only"] is True
        run(["nbdcopy", f"nbd+unix:///?socket={sock}", str(short_tmp / "out.raw")])
        assert (short_tmp / "out.raw").read_bytes() == exported(layer, short_tmp / "ref.raw")
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0
    assert not sock.exists()
    # The start log says it is read-only, and how to make it writable.
    log = proc.stderr.read().decode() if proc.stderr else ""
    assert "serving read-only" in log and "--upper DIR" in log
    helptext = run([sys.executable, "-m", "agentenv.cli.main", "nbd", "serve", "--help"]).stdout
    assert "READ-ONLY" in helptext and "--upper" in helptext


def test_nbd_serve_with_upper_is_writable(stack: Stack, short_tmp: Path) -> None:
    import sys
    import time

    sock = short_tmp / "rw.sock"
    layer = stack.lowers[0]
    upper = short_tmp / "upper"
    before = layer.read_bytes()
    data = os.urandom(MiB)
    (short_tmp / "in.raw").write_bytes(data)

    def serve() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "agentenv.cli.main", "nbd", "serve",
                                 str(layer), "--socket", str(sock), "--upper", str(upper)],
                                stderr=subprocess.PIPE)
        deadline = time.monotonic() + 15
        while not sock.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return proc

    proc = serve()
    try:
        info = json.loads(run(["nbdinfo", "--json", f"nbd+unix:///disk?socket={sock}"]).stdout)
        assert info["exports"][0]["is_read_only"] is False
        run(["nbdcopy", "--flush", str(short_tmp / "in.raw"), f"nbd+unix:///?socket={sock}"])
    finally:
        proc.terminate()
        proc.wait(10)
    assert "serving writable" in (proc.stderr.read().decode() if proc.stderr else "")
    assert layer.read_bytes() == before, "the layer itself must never be written"
    # Served again with the same --upper: the writes are there.
    proc = serve()
    try:
        run(["nbdcopy", f"nbd+unix:///?socket={sock}", str(short_tmp / "back.raw")])
    finally:
        proc.terminate()
        proc.wait(10)
    assert (short_tmp / "back.raw").read_bytes()[:MiB] == data


def test_second_daemon_on_the_same_state_dir_is_refused(daemon: Daemon, short_tmp: Path) -> None:
    import sys

    second = subprocess.run(
        [sys.executable, "-m", "agentenv.cli.main", "blockd", "--state-dir", str(daemon.state_dir),
         "--socket", str(short_tmp / "other.sock"), "--no-fuse"],
        capture_output=True, text=True, timeout=60)
    assert second.returncode == 1
    assert "another blockd already runs" in second.stderr and "Traceback" not in second.stderr
    with daemon.client() as client:
        assert client.ping()["devices"] == 0


def test_async_client(daemon: Daemon, stack: Stack) -> None:
    import asyncio

    from agentenv.blockd.client import AsyncBlockdClient

    async def scenario() -> None:
        client = AsyncBlockdClient(daemon.socket)
        info = await client.create(lowers=stack.lowers)
        blank = await client.create_blank(MiB)
        assert {d.id for d in await client.list()} == {info.id, blank.id}
        layer = await client.snapshot(info.id)
        assert layer.is_file()
        assert (await client.resize(blank.id, 2 * MiB)).size == 2 * MiB
        assert await client.release(blank.id) == 0
        assert await client.release(info.id) == 0
        with pytest.raises(BlockdError, match="no device"):
            await client.release(info.id)
        # The same client goes on after the daemon restarts under it.
        daemon.stop()
        daemon.start()
        assert await client.list() == []
        await client.close()

    asyncio.run(scenario())


def test_structured_replies_and_block_status(daemon: Daemon, stack: Stack) -> None:
    from .nbdclient import NbdClient

    with daemon.client() as client:
        blank = client.create_blank(16 * MiB)
        info = client.create(lowers=stack.lowers)
    run(["qemu-io", "-f", "raw", "-c", "write -P 7 1M 64k", "-c", "write -z 4M 1M",
         "-c", "write -P 9 8M 8k", nbd_uri(blank)])
    extents = json.loads(run(["nbdinfo", "--map", "--json", nbd_uri(blank)]).stdout)
    data = [(e["offset"], e["length"]) for e in extents if e["type"] == 0]
    assert data == [(1 * MiB, 64 * 1024), (8 * MiB, 8192)], extents
    assert sum(e["length"] for e in extents) == 16 * MiB
    # A sparse copy of the layered disk still reads back exactly.
    mapped = json.loads(run(["qemu-img", "map", "--output=json", "-f", "raw", nbd_uri(info)]).stdout)
    assert sum(m["length"] for m in mapped) == stack.size
    # Structured READ replies, including an error chunk that leaves the connection usable.
    nbd = NbdClient(info.nbd, None)
    nbd.structured()
    nbd.go(info.export)
    ctype, error, got = nbd.read_chunk(4096, 8192)
    assert (ctype, error, got) == (1, 0, stack.expected[4096 : 4096 + 8192])
    ctype, error, _ = nbd.read_chunk(stack.size - 512, 4096)
    assert (ctype, error) == ((1 << 15) + 1, 22)
    assert nbd.read_chunk(0, 0)[0] == 0
    assert nbd.read_chunk(0, 512)[2] == stack.expected[:512]
    nbd.close()


def _pipelined_reads(nbd: object, requests: list[tuple[int, int]], structured: bool) -> dict[int, bytes]:
    """Send every READ before reading any reply (the replies overflow the socket buffers, so
    the server's scatter-gather sends are cut short and the rest is queued), then collect the
    replies by handle."""
    import struct
    import time

    from .nbdclient import recv_exact

    sock = nbd.sock  # type: ignore[attr-defined]
    sock.sendall(b"".join(struct.pack(">IHHQQI", 0x25609513, 0, 0, handle, offset, length)
                          for handle, (offset, length) in enumerate(requests, 1)))
    time.sleep(0.3)
    got: dict[int, bytes] = {}
    for _ in requests:
        if structured:
            magic, flags, ctype, handle, clen = struct.unpack(">IHHQI", recv_exact(sock, 20))
            assert (magic, ctype, flags & 1) == (0x668E33EF, 1, 1)
            payload = recv_exact(sock, clen)
            assert struct.unpack_from(">Q", payload)[0] == requests[handle - 1][0]
            got[handle] = payload[8:]
        else:
            magic, error, handle = struct.unpack(">IIQ", recv_exact(sock, 16))
            assert (magic, error) == (0x67446698, 0)
            got[handle] = recv_exact(sock, requests[handle - 1][1])
    return got


def test_pipelined_large_reads_of_a_fragmented_disk(daemon: Daemon, stack: Stack) -> None:
    """1 MiB reads gathered from the layers and from an upper fragmented by thousands of 4 KiB
    writes (zero-copy pieces of their mmaps), with replies backed up in the socket, read back
    exactly: simple and structured replies, before and after the upper grows past its mapping."""
    import random

    from .nbdclient import NbdClient

    with daemon.client() as client:
        info = client.create(lowers=stack.lowers)
    expected = bytearray(stack.expected)
    rng = random.Random(5)
    writer = NbdClient(info.nbd, info.export)
    requests = [(n * MiB, MiB) for n in range(stack.size // MiB)]
    requests += [(rng.randrange(0, stack.size - MiB), rng.randrange(64 * 1024, MiB)) for _ in range(8)]
    for writes in (300, 2600):  # 2600 x 4 KiB grows the upper past its first mapping
        for _ in range(writes):
            offset = rng.randrange(0, stack.size // 4096) * 4096 + rng.choice([0, 0, 512, 100])
            data = rng.randbytes(min(4096, stack.size - offset))
            writer.write(offset, data)
            expected[offset : offset + len(data)] = data
        for structured in (False, True):
            nbd = NbdClient(info.nbd, None)
            if structured:
                nbd.structured()
            nbd.go(info.export)
            got = _pipelined_reads(nbd, requests, structured)
            for handle, (offset, length) in enumerate(requests, 1):
                assert got[handle] == expected[offset : offset + length], (structured, offset, length)
            nbd.close()
    writer.close()
