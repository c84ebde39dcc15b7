"""What no guest reaches, whatever its policy: the private and special ranges, and the node's own
networks where they are not among those.

The fixed list (WALL_NETS) covers a node whose networks are private. A node on a network in
public address space has neighbours there (other nodes' APIs, blockd's P2P port, the scheduler,
Redis) that the fixed list does not name, so the networks on the interfaces that carry the
host's default routes are walled too, and an operator adds the cluster's other ranges with
`AENV_NET_WALL_RANGES` (comma-separated CIDRs). The slot's own rules, the host's forward rules
and the egress proxy all wall the same set (`extra_walls`), read once per process.
"""

from __future__ import annotations

import functools
import json
import subprocess
from ipaddress import IPv4Network, collapse_addresses

from agentenv.settings import setting_text

WALL_RANGES_ENV = "AENV_NET_WALL_RANGES"

#: Always denied to guests, whatever their policy.
WALL_NETS = tuple(IPv4Network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.168.0.0/16", "224.0.0.0/4", "240.0.0.0/4"))


class WallError(ValueError):
    pass


def _ip_json(*argv: str) -> list[dict[str, object]]:
    out = subprocess.run(["ip", "-j", *argv], capture_output=True, text=True, check=False)
    if out.returncode != 0 or not out.stdout.strip():
        return []
    found = json.loads(out.stdout)
    return found if isinstance(found, list) else []


def uplink_networks(netns: str | None = None) -> tuple[IPv4Network, ...]:
    """The IPv4 networks on the interfaces of the default routes (of `netns`, else this
    process's namespace) that WALL_NETS does not already hold."""
    where = ("-n", netns) if netns else ()
    devices = sorted({str(r["dev"]) for r in _ip_json(*where, "-4", "route", "show", "default")
                      if r.get("dev")})
    nets: list[IPv4Network] = []
    for device in devices:
        for link in _ip_json(*where, "-4", "addr", "show", "dev", device):
            for info in link.get("addr_info") or []:  # type: ignore[attr-defined]
                if info.get("family") == "inet" and info.get("local"):
                    net = IPv4Network(f"{info['local']}/{info.get('prefixlen', 32)}",
                                      strict=False)
                    if not any(net.subnet_of(wall) for wall in WALL_NETS):
                        nets.append(net)
    return tuple(collapse_addresses(nets))


def configured_wall_ranges(raw: str | None = None) -> tuple[IPv4Network, ...]:
    """AENV_NET_WALL_RANGES: the cluster's ranges to wall besides the uplink's."""
    raw = setting_text(WALL_RANGES_ENV) if raw is None else raw
    out: list[IPv4Network] = []
    for item in (x.strip() for x in raw.split(",")):
        if not item:
            continue
        try:
            out.append(IPv4Network(item, strict=False))
        except ValueError:
            raise WallError(f"{WALL_RANGES_ENV}: {item!r} is not an IPv4 CIDR") from None
    return tuple(out)


@functools.cache
def extra_walls() -> tuple[IPv4Network, ...]:
    """The uplink's networks and the configured ranges (read once per process)."""
    return tuple(collapse_addresses([*uplink_networks(), *configured_wall_ranges()]))
