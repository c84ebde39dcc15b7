"""Declared interfaces between layers match what their implementations offer."""

from __future__ import annotations

import inspect
from pathlib import Path

from agentenv.blockd.client import AsyncBlockdClient, DiskService

RUNTIME = Path(__file__).parents[1] / "src/agentenv/runtime"


def test_the_runtime_s_blockd_protocol_is_what_the_client_offers() -> None:
    """Runtime, its disks and snapshots take a `DiskService` (blockd/client.py), not Any: the
    client the node passes must offer each of its methods with the same parameters."""
    for name in ("create", "seal", "release"):
        declared = inspect.signature(getattr(DiskService, name))
        offered = inspect.signature(getattr(AsyncBlockdClient, name))
        assert list(declared.parameters) == list(offered.parameters), name
        assert declared.return_annotation == offered.return_annotation, name
    assert "socket_path" in DiskService.__annotations__
    for module in ("vm", "disks", "snapshots", "memdev"):
        assert "blockd: Any" not in (RUNTIME / f"{module}.py").read_text(), module
