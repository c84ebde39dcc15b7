"""Errors of the VM runtime; every one is fit to show to a user."""

from __future__ import annotations

from agentenv.errors import AgentEnvError


class RuntimeError_(AgentEnvError):
    """Base of every runtime error (named with a trailing underscore to keep the builtin)."""


class QMPError(RuntimeError_):
    """QEMU answered a QMP command with an error, or the QMP connection failed."""


class VMDiedError(RuntimeError_):
    """The QEMU process of a VM exited when it should not have."""


class GuestNotReadyError(RuntimeError_):
    """envd inside the guest did not answer in time."""


class GuestRefusedError(GuestNotReadyError):
    """envd answered /init with a 4xx: what was asked cannot be done in this guest (a shared
    volume in a guest without the NFS client); retrying will not help."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class SnapshotError(RuntimeError_):
    """A snapshot could not be taken, or a snapshot cannot be restored."""


class ModeMismatchError(SnapshotError):
    """A snapshot taken under one accelerator (kvm/tcg) cannot be restored under another."""


class NetworkError(RuntimeError_):
    """A network slot could not be set up or torn down."""


class DiskError(RuntimeError_):
    """blockd could not provide a VM's disk (a layer missing or unreadable, blockd refusing)."""
