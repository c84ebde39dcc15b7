"""VM runtime on QEMU: boot, pause, restore, fork, network slots, warm pools (see README.md)."""

from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.errors import (
    GuestNotReadyError,
    ModeMismatchError,
    NetworkError,
    QMPError,
    RuntimeError_,
    SnapshotError,
    VMDiedError,
)
from agentenv.runtime.vm import VM, BootSpec, DiskSource, Runtime

__all__ = [
    "VM",
    "BootSpec",
    "DiskSource",
    "GuestNotReadyError",
    "ModeMismatchError",
    "NetworkError",
    "QMPError",
    "Runtime",
    "RuntimeConfig",
    "RuntimeError_",
    "SnapshotError",
    "VMDiedError",
]
