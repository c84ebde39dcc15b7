"""Fixtures for blockd: layer stacks built with the storage engine, and a real daemon process."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentenv.blockd.client import BlockdClient
from agentenv.blockd.launch import BlockdProcess

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


class Daemon(BlockdProcess):
    """`aenv blockd` running as a real process, its state, socket and log under `root`."""

    def __init__(self, root: Path, fuse: bool = True) -> None:
        super().__init__(root / "state", root / "ctl.sock", root / "blockd.log", fuse=fuse)
        self.root = root

    def client(self) -> BlockdClient:
        return BlockdClient(self.socket)


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
