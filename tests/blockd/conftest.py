"""Fixtures for blockd: layer stacks built with the storage engine, and a real daemon process."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentenv.blockd.client import BlockdClient
from agentenv.blockd.errors import BlockdUnavailable

MiB = 1 << 20


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="bd", dir="/tmp"))
    yield path
    subprocess.run(["fusermount3", "-u", "-z", "-q", str(path / "state" / "fuse")],
                   stderr=subprocess.DEVNULL, check=False)
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Stack:
    lowers: list[Path]
    expected: bytes
    size: int


def build_stack(folder: Path, layers: int, size: int, seed: int = 1) -> Stack:
    """`layers` sealed overlaybd layers of random extents (and zeroed extents), bottom first,
    with the bytes the stack must read as."""
    from agentenv.storage.builder import LayerBuilder

    rng = random.Random(seed)
    expected = bytearray(size)
    paths: list[Path] = []
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(layers):
        path = folder / f"layer{n:02d}.lsmt"
        extents: dict[int, bytes | _Zero] = {}
        for _ in range(rng.randint(3, 12)):
            length = rng.choice([4096, 16384, 65536, 512 * 1024])
            offset = rng.randrange(0, (size - length) // 4096) * 4096
            if any(o < offset + length and offset < o + n_ for o, n_ in _spans(extents)):
                continue
            zero = n > 0 and rng.random() < 0.2
            extents[offset] = _Zero(length) if zero else rng.randbytes(length)
        with LayerBuilder(path, size) as builder:
            for offset in sorted(extents):
                value = extents[offset]
                if isinstance(value, _Zero):
                    builder.add_zero(offset, value.length)
                    expected[offset : offset + value.length] = bytes(value.length)
                else:
                    builder.add(offset, value)
                    expected[offset : offset + len(value)] = value
        paths.append(path)
    return Stack(paths, bytes(expected), size)


class _Zero:
    def __init__(self, length: int) -> None:
        self.length = length


def _spans(extents: dict[int, bytes | _Zero]) -> list[tuple[int, int]]:
    return [(o, v.length if isinstance(v, _Zero) else len(v)) for o, v in extents.items()]


@pytest.fixture
def stack(short_tmp: Path) -> Stack:
    return build_stack(short_tmp / "layers", 4, 16 * MiB)


class Daemon:
    """`aenv blockd` running as a real process."""

    def __init__(self, root: Path, fuse: bool = True) -> None:
        self.root = root
        self.state_dir = root / "state"
        self.socket = root / "ctl.sock"
        self.fuse = fuse
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = root / "blockd.log"
        self.extra_args: list[str] = []

    def start(self) -> None:
        args = [sys.executable, "-m", "agentenv.cli.main", "blockd", "--state-dir", str(self.state_dir),
                "--socket", str(self.socket)]
        if not self.fuse:
            args.append("--no-fuse")
        args += self.extra_args
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                with BlockdClient(self.socket, timeout=5) as client:
                    client.ping()
                return
            except BlockdUnavailable:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"blockd did not start:\n{self.log_path.read_text()}") from None
                time.sleep(0.05)

    def client(self) -> BlockdClient:
        return BlockdClient(self.socket)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def daemon(short_tmp: Path) -> Iterator[Daemon]:
    if not os.path.exists("/dev/fuse"):
        pytest.fail("/dev/fuse is missing: blockd exposes devices through FUSE")
    d = Daemon(short_tmp)
    d.start()
    yield d
    d.stop()
    assert not os.path.ismount(d.state_dir / "fuse"), "blockd left its FUSE mount behind"


def nbd_uri(info: object) -> str:
    return f"nbd+unix:///{info.export}?socket={info.nbd}"  # type: ignore[attr-defined]


def run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise AssertionError(f"{args[0]} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result
