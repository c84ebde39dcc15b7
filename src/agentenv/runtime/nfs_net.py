"""The network namespace of the node's NFS server (node/nfs.py "Network"; docs/volumes.md §7.1).

ganesha parses every guest's NFS bytes as root; in the host's network namespace a ganesha taken
over would reach every socket of the host: services on loopback (the node API, blockd), abstract
unix sockets (per network namespace), the node's private network, every sandbox's envd at its
guest address (red team of 2026-12-07, tests/redteam/test_nfs_server_escape.py). So it runs in a
namespace of its own, `<prefix>-nfs`, joined to the host by one veth pair:

    host netns                               <prefix>-nfs
    <prefix>nfs  10.11.x.(2i)/31  <--veth-->  nfs0  10.11.x.(2i+1)/31   (ganesha listens here)

- The link's /31 comes from LINK_RANGE (10.11/16: the runtime's own range, walled to every
  guest, never opened by an operator), the first pair no routing table of the host holds a
  route inside of (another node's link, a slot, an address of the host) nor a route other than
  the default around it (a network of the node's), chosen and made under the runtimes'
  host-wide slot lock (runtime/network.py `_host_slot_lock`), as slots are.
- Routes in the namespace: only the link and the guests' range (`clients`, the slots' 10.12/16)
  back through the host; nothing else is routed (no default route).
- nftables in the namespace (`inet aenv_nfs`), nothing else in or out: input takes new TCP
  to the server's address and port from `clients` on nfs0, and packets of connections so
  accepted; output lets out only packets of those connections (and ICMP errors about them);
  every other packet the namespace sends is refused at once (a TCP reset to the sender, else
  ICMP admin-prohibited: a connect fails at once instead of waiting); forwarding off and
  dropped; no IPv6 (ganesha's rpcbind registration at start tries [::1]:111 first: a dropped
  SYN hung its start). Its own loopback passes: nothing listens in the namespace but ganesha,
  and the resets of the refusals reach the sender that way.
- Abstract unix sockets are per network namespace: the host's are out of its reach, and a
  name it binds is bound only in its own namespace.

The host's side (runtime/network.py `host_ruleset` with `nfs_address`): the slots' NFS
redirect is a DNAT to the server's address and port (the guest's source address is kept: the
exports' client lists name guest addresses), forwarded to the link only when DNATed so, and
masqueraded by no runtime's table (a source NAT to itself at `srcnat - 10`, `nfs_post`: every
runtime's host table masquerades 10.12/16 leaving by any interface but its own slots', so with
two runtimes on the host, a test session's, ganesha saw the host's end of the link and its
namespace dropped the SYN: the guests' mounts timed out); from the link, only packets of those
flows are forwarded, and nothing reaches the host itself.

`create` remakes the namespace whole (a leftover of an earlier run is deleted first); `remove`
deletes it (the veth pair goes with it). A node claims its link at start (`claim`, reusing the
/31 its leftover namespace had when still free), ganesha's start remakes it and its stop
removes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

from agentenv.runtime.errors import NetworkError
from agentenv.runtime.network import NETNS_DIR, _host_slot_lock, nfs_netns_name, nfs_veth

#: Where the links of NFS namespaces come from (a /31 each).
LINK_RANGE = IPv4Network("10.11.0.0/16")
#: The guests' addresses as the host sees them: the slots' range (runtime/network.py).
SLOT_RANGE = IPv4Network("10.12.0.0/16")
SERVER_IF = "nfs0"
TABLE = "inet aenv_nfs"


def _run(*argv: str, stdin: str | None = None) -> str:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetworkError(f"{' '.join(argv[:5])} failed: {proc.stderr.strip()}")
    return proc.stdout


@dataclass(frozen=True)
class NfsNet:
    """The namespace of one node's NFS server: `prefix` is its runtime's network prefix,
    `host_address` the host's end of the link (the server's is the next address), `port` the
    server's port, `clients` the networks that may connect to it."""

    prefix: str
    host_address: str
    port: int
    clients: tuple[str, ...] = (str(SLOT_RANGE),)

    def __post_init__(self) -> None:
        host = IPv4Address(self.host_address)
        if int(host) % 2 or host not in LINK_RANGE:
            raise NetworkError(f"NFS link address {host} is not the first of a /31 in "
                               f"{LINK_RANGE}")
        if not 0 < self.port < 65536:
            raise NetworkError(f"NFS port {self.port} is out of range")
        for net in self.clients:
            IPv4Network(net)

    @property
    def name(self) -> str:
        return nfs_netns_name(self.prefix)

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.name

    @property
    def host_veth(self) -> str:
        return nfs_veth(self.prefix)

    @property
    def server_address(self) -> str:
        return str(IPv4Address(self.host_address) + 1)

    @property
    def link(self) -> IPv4Network:
        return IPv4Network(f"{self.host_address}/31")

    def exists(self) -> bool:
        return self.path.exists()

    def ruleset(self) -> str:
        clients = ", ".join(self.clients)
        return (
            f"add table {TABLE}\n"
            f"delete table {TABLE}\n"
            f"table {TABLE} {{\n"
            "    chain input {\n"
            "        type filter hook input priority filter; policy drop;\n"
            # its own loopback: nothing listens in the namespace but ganesha, and the resets
            # output's rejects make for its refused connections come back this way
            '        iifname "lo" accept\n'
            "        ct state established,related accept\n"
            f'        iifname "{SERVER_IF}" ip saddr {{ {clients} }} '
            f"ip daddr {self.server_address} tcp dport {self.port} ct state new accept\n"
            "    }\n"
            "    chain output {\n"
            "        type filter hook output priority filter; policy drop;\n"
            '        oifname "lo" accept\n'
            "        ct state established,related accept\n"
            # refused at once, not dropped: a dropped SYN would keep its sender waiting
            # (ganesha's rpcbind registration at start, on loopback)
            "        meta l4proto tcp reject with tcp reset\n"
            "        reject with icmpx type admin-prohibited\n"
            "    }\n"
            "    chain forward {\n"
            "        type filter hook forward priority filter; policy drop;\n"
            "    }\n"
            "}\n")

    def create(self) -> None:
        """Make the namespace (module doc), whole: one of that name is deleted first. Under
        the runtimes' host-wide slot lock; NetworkError when the link's /31 is routed by
        someone else meanwhile."""
        lock = _host_slot_lock()
        try:
            self._remove()
            if _link_taken(self.link):
                raise NetworkError(f"the NFS server's link {self.link} is routed on this host "
                                   "by something else now")
            self._build()
        finally:
            os.close(lock)

    def _build(self) -> None:
        _run("ip", "netns", "add", self.name)
        try:
            _run("ip", "-batch", "-", stdin=(
                f"link add {self.host_veth} type veth peer name {SERVER_IF} netns {self.name}\n"
                f"addr add {self.host_address}/31 dev {self.host_veth}\n"
                f"link set {self.host_veth} up\n"))
            routes = "".join(f"route add {net} via {self.host_address}\n"
                             for net in self.clients
                             if not IPv4Network(net).subnet_of(self.link))
            _run("ip", "-n", self.name, "-batch", "-", stdin=(
                "link set lo up\n"
                f"addr add {self.server_address}/31 dev {SERVER_IF}\n"
                f"link set {SERVER_IF} up\n" + routes))
            sysctls = ["net.ipv4.ip_forward=0"]
            if os.path.exists("/proc/sys/net/ipv6"):
                sysctls += [f"net.ipv6.conf.{dev}.disable_ipv6=1"
                            for dev in ("all", "default", "lo", SERVER_IF)]
            _run("ip", "netns", "exec", self.name, "sysctl", "-qw", *sysctls)
            _run("nsenter", f"--net={self.path}", "nft", "-f", "-", stdin=self.ruleset())
        except BaseException:
            with contextlib.suppress(NetworkError):
                self._remove()
            raise

    def _remove(self) -> None:
        if self.exists():
            _run("ip", "netns", "del", self.name)
        with contextlib.suppress(NetworkError):  # gone with the namespace, normally
            _run("ip", "link", "del", self.host_veth)

    def remove(self) -> None:
        """Delete the namespace and its link (nothing if there is none)."""
        self._remove()


def _link_taken(link: IPv4Network) -> bool:
    """Whether a routing table of the host holds a route inside `link` (another node's link,
    a slot, an address of the host's), or a route of a /16 or narrower around it (a network of
    the node's in 10.11/16: the link would shadow two of its addresses). Broader routes (a
    10/8 through a VPN) are not counted, as for the slots."""
    inside = _run("ip", "-4", "-o", "route", "show", "table", "all", "to", "root", str(link))
    if inside.strip():
        return True
    around = _run("ip", "-4", "-o", "route", "show", "table", "all", "to", "match", str(link))
    for line in around.splitlines():
        words = line.split()
        if words and words[0] in _ROUTE_TYPES:
            words = words[1:]
        if not words or words[0] == "default":
            continue
        with contextlib.suppress(ValueError):
            if IPv4Network(words[0], strict=False).prefixlen >= 16:
                return True
    return False


_ROUTE_TYPES = ("unicast", "local", "broadcast", "multicast", "anycast", "nat", "unreachable",
                "prohibit", "blackhole", "throw")


def leftover_address(prefix: str) -> str | None:
    """The host's end of the link of `prefix`'s NFS namespace an earlier run left, if any."""
    name = nfs_netns_name(prefix)
    if not (NETNS_DIR / name).exists():
        return None
    with contextlib.suppress(NetworkError, ValueError, KeyError, IndexError, TypeError):
        links = json.loads(_run("ip", "-n", name, "-j", "-4", "addr", "show", "dev", SERVER_IF))
        for info in links[0]["addr_info"]:
            server = IPv4Address(info["local"])
            if int(server) % 2 and server in LINK_RANGE:
                return str(server - 1)
    return None


def claim(prefix: str, port: int, clients: tuple[str, ...] = (str(SLOT_RANGE),)) -> NfsNet:
    """The NFS namespace of `prefix`'s node, made now (the link's /31 is held from here on):
    the /31 its leftover had when nobody else routes it, else the first free one of
    LINK_RANGE. The caller holds `prefix` (runtime/network.py `claim_prefix`): a leftover of
    that name is its own."""
    lock = _host_slot_lock()
    try:
        kept = leftover_address(prefix)
        with contextlib.suppress(NetworkError):
            NfsNet(prefix, str(LINK_RANGE.network_address), port)._remove()
        candidates = [IPv4Address(kept)] if kept is not None else []
        candidates += [LINK_RANGE.network_address + 2 * i
                       for i in range(LINK_RANGE.num_addresses // 2)]
        for host in candidates:
            net = NfsNet(prefix, str(host), port, clients)
            if _link_taken(net.link):
                continue
            net._build()
            return net
    finally:
        os.close(lock)
    raise NetworkError(f"no free /31 left in {LINK_RANGE} for the NFS server's link")


def remove_leftover(prefix: str) -> None:
    """Delete `prefix`'s NFS namespace an earlier run left (the rw-shared mode is off now)."""
    NfsNet(prefix, str(LINK_RANGE.network_address), 1)._remove()

