"""A disk as the runtime holds it while a VM runs: what it is, the sealed layers under it, and
what serves it (a blockd device or a plain file)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentenv.snapshot.record import DiskConfig, LayerRef


@dataclass
class AttachedDisk:
    config: DiskConfig
    layers: list[LayerRef]  # sealed layers under the device's upper (oldest first)
    device_id: str | None = None  # blockd device
    file: Path | None = None
