"""Files a QEMU writes are read bounded: a QEMU taken over owns their descriptors and can make
them any size, sparse, at no cost (the red team grew the node to 4 GiB through qemu.stderr)."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from agentenv.runtime.devstate import DEVICE_STATE_MAX, finish_device_state
from agentenv.runtime.errors import SnapshotError
from agentenv.runtime.qemu import file_tail


def test_a_huge_sparse_stderr_is_read_from_its_tail(tmp_path: Path) -> None:
    stderr = tmp_path / "qemu.stderr"
    with open(stderr, "wb") as f:
        f.truncate(8 << 30)  # 8 GiB of holes: what ftruncate on QEMU's fd 2 makes
        f.seek(0, 2)
        f.write(b"qemu-system-x86_64: the real reason\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert file_tail(stderr, 100).endswith("the real reason")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB


def test_a_device_state_past_any_vms_is_refused_unread(tmp_path: Path) -> None:
    raw = tmp_path / "devstate.raw"
    with open(raw, "wb") as f:
        f.truncate(DEVICE_STATE_MAX + 1)
    with pytest.raises(SnapshotError, match="more than any VM's"):
        finish_device_state(raw, tmp_path / "devstate", "q35")
    assert not (tmp_path / "devstate").exists()
