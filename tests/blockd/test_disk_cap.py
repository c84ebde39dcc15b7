"""The per-disk cap on upper growth, end to end through blockd and QEMU's NBD client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from agentenv.blockd.errors import BlockdError
from agentenv.blockd.launch import BlockdStartFailed
from agentenv.blockd.results import Sealed

from .conftest import Daemon, MiB, Stack, nbd_uri, run
from .nbdclient import CMD_WRITE, NbdClient


def _qemu_io(uri: str, *commands: str) -> subprocess.CompletedProcess[str]:
    args = ["qemu-io", "-f", "raw"]
    for command in commands:
        args += ["-c", command]
    return subprocess.run([*args, uri], capture_output=True, text=True, timeout=120)


def test_capped_disk_refuses_growth_with_enospc_and_keeps_serving(short_tmp: Path, stack: Stack) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = Daemon(short_tmp, fuse=False)
    # The node default comes from the environment (AENV_DISK_UPPER_LIMIT, as `make up` passes it).
    d.extra_args = ["--metrics-port", str(port)]
    os.environ["AENV_DISK_UPPER_LIMIT"] = "3M"
    try:
        d.start()
    finally:
        del os.environ["AENV_DISK_UPPER_LIMIT"]
    try:
        with d.client() as client:
            capped = client.create(lowers=stack.lowers)
            capped_raw = {i["id"]: i for i in client.call("list")}[capped.id]
            uncapped = client.call("create", lowers=[str(p) for p in stack.lowers], upper_limit=0)
            small = client.call("create", lowers=[str(p) for p in stack.lowers],
                                upper_limit=MiB)
        assert capped_raw["upper_limit"] == 3 * MiB
        assert uncapped["upper_limit"] is None and small["upper_limit"] == MiB
        uri = nbd_uri(capped)
        # A guest rewriting the same 1 MiB a hundred times: reused in place, never full.
        for i in range(20):
            run(["qemu-io", "-f", "raw", "-c", f"write -P {i} 1M 1M", "-c", "flush", uri])
        # Growing past the cap: ENOSPC on the wire, qemu-io reports it.
        out = _qemu_io(uri, "write -P 0x5a 4M 4M")
        assert "No space left on device" in out.stdout + out.stderr, out
        # The disk keeps serving: reads, rewrites of held blocks, and what still fits.
        run(["qemu-io", "-f", "raw", "-c", "read -P 19 1M 1M", "-c", "write -P 0x33 1M 64k",
             "-c", "write -P 0x44 8M 512k", "-c", "read -P 0x44 8M 512k", uri])
        # A raw client sees the NBD error code itself, and the connection stays up.
        nbd = NbdClient(capped.nbd, capped.export)
        assert nbd.request(CMD_WRITE, 12 * MiB, 4 * MiB, bytes(4 * MiB))[0] == 28  # ENOSPC
        assert nbd.read(MiB, 4096) == b"\x33" * 4096
        nbd.close()
        # Uncapped: the same big write succeeds.
        run(["qemu-io", "-f", "raw", "-c", "write -P 0x5a 4M 8M",
             f"nbd+unix:///{uncapped['export']}?socket={uncapped['nbd']}"])
        with d.client() as client:
            info = {i["id"]: i for i in client.call("list")}[capped.id]
        assert info["stats"]["enospc"] >= 2
        # 20 rewrites of 1 MiB counted once, plus the 512 KiB that fit (and two index entries).
        assert info["upper_used"] == MiB + 512 * 1024 + 2 * 16
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        line = next(x for x in text.splitlines()
                    if x.startswith(f'aenv_blockd_enospc_total{{device="{capped.id}"}}'))
        assert float(line.split()[-1]) >= 2
        # The cap is in the device record: it holds after a restart too.
        d.stop()
        d.start()
        out = _qemu_io(uri, "write -P 1 4M 4M")
        assert "No space left on device" in out.stdout + out.stderr, out
        run(["qemu-io", "-f", "raw", "-c", "read -P 0x44 8M 512k", uri])
    finally:
        d.stop()
    log = d.log_file.read_text()
    assert "disk full: write refused with ENOSPC" in log
    # Logged once a minute at most, not per refused request.
    assert log.count("disk full: write refused") <= 4


def test_bad_upper_limit_is_refused(daemon: Daemon, stack: Stack) -> None:
    with daemon.client() as client:
        for bad in (-5, "1G", 1.5):
            try:
                client.call("create", lowers=[str(p) for p in stack.lowers], upper_limit=bad)
            except BlockdError as exc:
                assert "upper_limit must be a non-negative number of bytes" in str(exc)
            else:
                raise AssertionError(f"upper_limit={bad!r} was accepted")
    bad_env = subprocess.run(
        [sys.executable, "-m", "agentenv.cli.main", "blockd", "--upper-limit", "lots", "--state-dir", "/nonexistent/x"],
        capture_output=True, text=True, timeout=60,
    )
    assert bad_env.returncode != 0 and "is not a size" in bad_env.stderr


def test_default_cap_is_a_share_of_the_state_filesystem(short_tmp: Path, stack: Stack) -> None:
    """Without AENV_DISK_UPPER_LIMIT a writable disk is capped at 25% of the filesystem that
    holds blockd's state (one guest filling its disk cannot fill the host's); "N%" sets the
    share and 0 turns the cap off."""
    import shutil

    total = shutil.disk_usage(short_tmp).total
    saved = os.environ.pop("AENV_DISK_UPPER_LIMIT", None)
    try:
        for setting, expected in ((None, total // 4), ("10%", total // 10), ("0", None)):
            d = Daemon(short_tmp / f"d{len(str(setting))}{setting or ''}".replace("%", "p"),
                       fuse=False)
            d.root.mkdir()
            if setting is not None:
                d.extra_args = ["--upper-limit", setting]
            d.start()
            try:
                with d.client() as client:
                    made = client.call("create", lowers=[str(p) for p in stack.lowers])
                    unlimited = client.create(lowers=stack.lowers, upper_limit=0)
                    listed = {i["id"]: i for i in client.call("list")}
                assert made["upper_limit"] == expected, setting
                assert listed[unlimited.id]["upper_limit"] is None
            finally:
                d.kill9()
    finally:
        if saved is not None:
            os.environ["AENV_DISK_UPPER_LIMIT"] = saved


def test_a_bad_share_is_refused(short_tmp: Path) -> None:
    d = Daemon(short_tmp, fuse=False)
    d.extra_args = ["--upper-limit", "120%"]
    with pytest.raises(BlockdStartFailed, match="a percentage is between 0 and 100"):
        d.start()


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "python"])
def test_the_cap_bounds_the_disks_own_chain_across_seals_and_resumes(
        short_tmp: Path, stack: Stack, native: str) -> None:
    """A seal (a fork point, a pause) must not renew the cap: the disk's own sealed uppers stay
    counted, on the device that keeps serving, after a daemon restart, and on the device a
    resume makes over the sealed layers (create's chain_used, from the seal's answer)."""
    d = Daemon(short_tmp, fuse=False)
    d.extra_args = ["--upper-limit", "4M"]
    os.environ["AENV_BLOCKD_NATIVE"] = native
    try:
        d.start()
    finally:
        del os.environ["AENV_BLOCKD_NATIVE"]
    try:
        with d.client() as client:
            disk = client.create(lowers=stack.lowers)
        uri = nbd_uri(disk)
        run(["qemu-io", "-f", "raw", "-c", "write -P 0x11 0 2M", "-c", "flush", uri])
        with d.client() as client:
            first = Sealed.from_json(client.call(  # a fork point
                "snapshot", id=disk.id, output=str(short_tmp / "fork.layer")))
        assert 2 * MiB < first.chain_used < 2 * MiB + 4096, first
        # The device serves on, with what is left of its 4 MiB: 1 MiB fits, 2 more do not.
        run(["qemu-io", "-f", "raw", "-c", "write -P 0x22 4M 1M", "-c", "flush", uri])
        out = _qemu_io(uri, "write -P 0x33 8M 2M")
        assert "No space left on device" in out.stdout + out.stderr, out
        d.stop()  # the chain is in the device record
        d.start()
        out = _qemu_io(uri, "write -P 0x33 8M 2M")
        assert "No space left on device" in out.stdout + out.stderr, out
        with d.client() as client:
            info = {i.id: i for i in client.list()}[disk.id]
            assert info.chain_used == first.chain_used and info.upper_used > MiB
            # A pause: seal, release; the resume stacks a new upper on the sealed layers and
            # says what they hold of the cap.
            paused = Sealed.from_json(client.call("snapshot", id=disk.id,
                                                  output=str(short_tmp / "paused.layer")))
            assert paused.chain_used == first.chain_used + info.upper_used
            client.release(disk.id)
            resumed = client.create(lowers=[*stack.lowers, Path(first.layer), Path(paused.layer)],
                                    upper_dir=short_tmp / "resumed", chain_used=paused.chain_used)
            fresh = client.create(lowers=[*stack.lowers, Path(first.layer), Path(paused.layer)],
                                  upper_dir=short_tmp / "child")
        assert resumed.chain_used == paused.chain_used
        out = _qemu_io(nbd_uri(resumed), "write -P 0x44 12M 2M")
        assert "No space left on device" in out.stdout + out.stderr, out
        run(["qemu-io", "-f", "raw", "-c", "read -P 0x11 0 2M", "-c", "read -P 0x22 4M 1M",
             "-c", "write -P 0x55 0 4k", nbd_uri(resumed)])  # blocks of the chain: readable
        # A fork child or a create from a template (no chain_used) has the whole cap.
        run(["qemu-io", "-f", "raw", "-c", "write -P 0x66 12M 3M", nbd_uri(fresh)])
        with d.client() as client:  # chain_used is bytes, and only for a writable disk
            with pytest.raises(BlockdError, match="chain_used"):
                client.call("create", lowers=[str(p) for p in stack.lowers], chain_used=-1)
            with pytest.raises(BlockdError, match="chain_used"):
                client.call("create", image=str(paused.layer), readonly=True, chain_used=1)
    finally:
        d.stop()
