"""What blockd's operations return: typed records, one JSON object each on the wire.

The daemon's operations return these; the RPC transport (rpc.py) turns them into JSON with
`to_wire`, and the clients (client.py) read them back with `from_json`, which ignores fields it
does not know (a newer daemon may answer more).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

R = TypeVar("R", bound="Result")


@dataclass(frozen=True)
class Result:
    """Base of the answers: JSON out, JSON in."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls: type[R], data: dict[str, Any]) -> R:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class DeviceInfo(Result):
    """A device as `create`, `resize` and `list` answer it."""

    id: str
    nbd: str  # the device's NBD unix socket
    export: str  # its NBD export name
    file: str | None  # the device as a regular file (FUSE), when the daemon runs FUSE
    size: int
    readonly: bool
    kind: str = "disk"  # "disk" (writable, own upper) or "shared" (read-only, refcounted)
    source: str | None = None  # image config (writable) or image/layer (read-only) it reopens
    upper_dir: str | None = None
    refcount: int = 1
    upper_limit: int | None = None  # cap on the disk's own writes in bytes (None: none)
    chain_used: int = 0  # bytes of its own sealed uppers, counted against upper_limit
    upper_used: int = 0  # bytes of its current upper
    stats: dict[str, int] = field(default_factory=dict)  # device.DeviceStats as a dict

    @property
    def uri(self) -> str:
        """The device as QEMU and libnbd name it."""
        return f"nbd+unix:///{self.export}?socket={self.nbd}"


@dataclass(frozen=True)
class Pong(Result):
    pid: int
    devices: int


@dataclass(frozen=True)
class Released(Result):
    released: str
    refcount: int  # what is left (0: the device is gone)


@dataclass(frozen=True)
class Sealed(Result):
    layer: str  # the sealed layer's path
    chain_used: int = 0  # the disk's own sealed uppers, this one included (a resume's charge)


def to_wire(result: Any) -> Any:
    """An operation's return value as JSON-ready data (records, lists of them, None = {})."""
    if result is None:
        return {}
    if isinstance(result, Result):
        return result.to_json()
    if is_dataclass(result) and not isinstance(result, type):
        return asdict(result)
    if isinstance(result, list | tuple):
        return [to_wire(item) for item in result]
    return result
