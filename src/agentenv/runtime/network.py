"""Network slots: one namespace per running VM, holding its TAP device, and the walls around it.

Layout of slot i (1..32767):

    host netns                         slot netns <prefix>-s<i>
    <prefix>h<i>  10.12.x.(2i)/31  <--veth-->  vpeer 10.12.x.(2i+1)/31
                                               tap0  169.254.0.22/30  <-> guest eth0 169.254.0.21

- The host reaches the guest at the slot's `guest_address` (vpeer's address): nftables in the
  namespace DNATs every port of it to 169.254.0.21 (so envd is guest_address:49983) and SNATs
  the guest's outbound traffic to it. Every restored VM keeps 169.254.0.21 (snapshot ABI).
  Only the host (the slot's `host_address`) may open connections to the guest.

Egress, decided in the slot's namespace for EVERY packet a guest sends in a connection it opened
(not only the first: a policy update bites on established connections at their next packet,
which is rejected with a TCP reset the guest sees; replies the guest receives still arrive, so
its ACK for them is what gets reset):
  1. a guest packet with a source other than 169.254.0.21 is dropped (no spoofing: the host
     knows a sandbox by its address);
  2. TCP to the metadata service 169.254.169.254:80 is accepted (the host redirects it), and
     so is TCP to 169.254.169.254:2049 (NFS_PORT) when the slot's sandbox mounts a shared
     volume (`set_nfs`; docs/volumes.md §7.1): the host DNATs it to the node's NFS server;
  3. walls, whatever the policy says: 10/8 (so 10.11/16 and 10.12/16: no sandbox reaches
     another), 172.16/12, 192.168/16, 100.64/10, 127/8, 169.254/16, 0/8, multicast 224/4,
     240/4 and broadcast; an operator may open named private ranges (`open_ranges`), which
     then go through the user policy like any other address;
  4. the user policy (agentenv.network.policy.EgressPolicy) as nftables SETS, whose elements
     are replaced in one `nft -f` transaction on update: `allow` (accepted), `dns` (port 53
     only), `proxied` (TCP ports accepted here because the host redirects them to the egress
     proxy, which decides by name: 80/443 or all), `deny` (rejected: TCP reset, else ICMP
     admin-prohibited); what none names is accepted. With a SOCKS5 `egressProxy` (`tunnelled`)
     every TCP connection goes through the tunnel and nothing else leaves but DNS (UDP 53).

What the slot's namespace sends itself (its output hook: QEMU runs there, and a QEMU taken over
can open sockets) is not forwarded from tap0, so none of the above sees it: the slot's `inet
aenv_guard` table drops all of it but the kernel's own answers (`_guard_ops`), and IPv6 forwarding.

On the host, one table per runtime (`<prefix>_host`, rules scoped to `<prefix>h*` interfaces):
  - prerouting (raw): a packet from a slot interface whose source is not routed back through
    that interface (another slot's address, any other) is dropped: the host and the egress
    proxy know a sandbox by its source address;
  - prerouting: TCP to 169.254.169.254:2049 from sources in set `nfs_src` -> `dnat` to the NFS
    server's address and port in its own network namespace (`nfs_address`, `nfs_port`;
    runtime/nfs_net.py), the guest's source address kept (postrouting: a source NAT to itself
    before any table's masquerade, as another runtime's table masquerades 10.12/16 leaving by
    any interface but its own slots'); forwarded to its link (`<prefix>nfs`) only when DNATed
    so, and from the link only the replies of those flows, nothing to the host itself
    (without `nfs_address`, a server in the host's namespace for tests: `redirect` to
    `nfs_port`);
    TCP to 169.254.169.254:80 from any slot, TCP 80/443 from sources in set `web`,
    all TCP from sources in set `all` -> `redirect` to the egress proxy's port;
  - input: nothing from a slot interface reaches the host (node API, blockd metrics, SSH,
    anything bound to 0.0.0.0) except the redirected proxy port; replies of connections the
    host opened pass; the proxy's port takes only redirected flows, from any interface
    (nothing reaches it directly: not the node's network, not a local process); the NFS
    server's port on the host is walled likewise (a server there takes only redirected TCP
    from slot interfaces);
  - forward: no slot-to-slot traffic, the walls again (minus the opened ranges) whatever the
    slot's own rules did, and a TCP flow of a `web_src`/`all_src` source
    that reaches forward was opened before names were filtered (or the SOCKS5 tunnel was set):
    it is reset, except a `web_src` flow the node marked KEEP_MARK because the new policy
    allows it whatever its name (keep_direct_flows: the kernel cannot know its name);
  - postrouting: masquerade of slot traffic leaving the host.
A foreign forward chain with policy drop (Docker's) gets accept rules for the slot interfaces
(tagged with a comment naming the prefix, removed by teardown_host).

Slots are pooled (`SlotPool`): building one costs a few `ip`/`nft` calls; a released slot is
reset (default policy, its connection tracking flushed) and reused.

Several runtimes on one host (a node, a benchmark, tests) share the host's network namespace:
- a prefix belongs to one live runtime per network namespace (a flock on a file named after
  it and the namespace, in the root-only LOCK_DIR, held for the runtime's life): a second runtime with the same prefix is refused
  with a message naming the holder, instead of deleting the first one's namespaces as
  leftovers and replacing its host table;
- slot addresses come from one range (10.12/16) whatever the prefix: a slot index whose /31
  the host already routes (another runtime's slot, or the host's own network: an address or a
  broadcast address inside it) is skipped (checked and created under a host-wide lock), so two
  runtimes never route a guest address to two VMs and a guest's replies never go to the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import io
import ipaddress
import json
import os
import shutil
import stat
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Network
from pathlib import Path

from agentenv.network.policy import ALL_TRAFFIC, QUIC_PORT, EgressPolicy
from agentenv.network.walls import WALL_NETS, extra_walls
from agentenv.runtime.errors import NetworkError

GUEST_IP = "169.254.0.21"
TAP_IP = "169.254.0.22"
TAP_MAC = "02:ae:00:00:00:fe"
ENVD_PORT = 49983
METADATA_IP = "169.254.169.254"
#: Where a guest reaches the node's NFS server (shared volumes, docs/volumes.md §7.1): the same
#: address and port in every slot, so a restored or forked guest finds it in any slot.
NFS_PORT = 2049
#: live connections one guest may hold to the node's NFS server
NFS_MAX_CONNECTIONS = 8
VETH_BASE = ipaddress.IPv4Address("10.12.0.0")
NETNS_DIR = Path("/run/netns")
#: Never opened, not even by the operator: the runtime's own ranges and the host.
INTERNAL_NETS = tuple(IPv4Network(n) for n in (
    "10.11.0.0/16", "10.12.0.0/16", "127.0.0.0/8", "169.254.0.0/16", "0.0.0.0/8",
    "224.0.0.0/4", "240.0.0.0/4"))
WEB_PORTS = "80, 443"
#: Host conntrack mark of a direct TCP 80/443 flow that a name-filtering policy still allows
#: whatever its name (see keep_direct_flows); "aenv" in ASCII, unlikely to be anyone else's.
KEEP_MARK = 0x61656E76
RULE_TAG = "aenv-slots:"  # comment on rules put in foreign tables (Docker's forward chain)


def nfs_netns_name(prefix: str) -> str:
    """The network namespace of the NFS server of `prefix`'s node (runtime/nfs_net.py)."""
    return f"{prefix}-nfs"


def nfs_veth(prefix: str) -> str:
    """The host's end of the link to it (not matched by the slots' `<prefix>h*`)."""
    return f"{prefix}nfs"


async def _run(*argv: str, stdin: str | None = None) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    if proc.returncode != 0:
        raise NetworkError(f"{' '.join(argv[:4])} failed: {err.decode(errors='replace').strip()}")
    return out.decode()


def parse_open_ranges(raw: Iterable[str] | str | None) -> tuple[IPv4Network, ...]:
    """The operator's opened private ranges (AENV_NET_OPEN_RANGES: comma-separated CIDRs).
    Only parts of the private walls can be opened, never the runtime's own ranges."""
    if raw is None:
        return ()
    items = [x.strip() for x in (raw.split(",") if isinstance(raw, str) else raw) if x.strip()]
    out: list[IPv4Network] = []
    for item in items:
        try:
            net = IPv4Network(item, strict=False)
        except ValueError:
            raise NetworkError(f"open range {item!r} is not an IPv4 CIDR") from None
        if any(net.overlaps(internal) for internal in INTERNAL_NETS):
            raise NetworkError(f"open range {item!r} overlaps a range the runtime uses itself "
                               "(10.11/16, 10.12/16, 127/8, 169.254/16, 0/8, 224/4, 240/4)")
        if not any(net.subnet_of(wall) for wall in WALL_NETS):
            raise NetworkError(f"open range {item!r} is not inside a private range "
                               "(only 10/8, 172.16/12, 192.168/16 and 100.64/10 can be opened)")
        out.append(net)
    return tuple(out)


def walls(open_ranges: Iterable[IPv4Network] = ()) -> list[IPv4Network]:
    """WALL_NETS and the node's own networks (network/walls.py) minus the opened ranges, as
    disjoint CIDRs."""
    nets = [*WALL_NETS, *extra_walls()]
    for hole in open_ranges:
        next_nets: list[IPv4Network] = []
        for net in nets:
            if hole.subnet_of(net):
                next_nets.extend(net.address_exclude(hole))
            elif not net.subnet_of(hole):
                next_nets.append(net)
        nets = next_nets
    return sorted(ipaddress.collapse_addresses(nets))


def _elements(items: Iterable[object]) -> str:
    return ", ".join(str(x) for x in items)


def _set_ops(table: str, name: str, items: list[str]) -> str:
    ops = f"flush set ip {table} {name}\n"
    if items:
        ops += f"add element ip {table} {name} {{ {_elements(items)} }}\n"
    return ops


def _nets(nets: Iterable[IPv4Network]) -> list[str]:
    return [str(n) for n in ipaddress.collapse_addresses(nets)]


def proxied_ports(policy: EgressPolicy) -> list[str]:
    return {"none": [], "web": ["80", "443"], "all": ["0-65535"]}[policy.proxied_ports]


@dataclass
class NetworkSlot:
    index: int
    prefix: str = "aenv"
    outbound: bool = True
    open_ranges: tuple[IPv4Network, ...] = ()
    policy: EgressPolicy = field(default_factory=EgressPolicy)
    #: bandwidth each way in Mbit/s (0: not shaped): a token bucket on each end of the veth
    rate_mbit: int = 0
    #: the guest's live flows (conntrack entries) at most (0: no limit)
    max_flows: int = 0
    #: whether the guest may reach the node's NFS server (set_nfs; only a sandbox that mounts
    #: a shared volume)
    nfs: bool = False

    def __post_init__(self) -> None:
        if not self.outbound and self.policy.is_default:
            self.policy = EgressPolicy(deny_nets=(ALL_TRAFFIC,))

    @property
    def netns_name(self) -> str:
        return f"{self.prefix}-s{self.index}"

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns_name)

    @property
    def host_veth(self) -> str:
        return f"{self.prefix}h{self.index}"

    @property
    def host_address(self) -> str:
        return str(VETH_BASE + 2 * self.index)

    @property
    def guest_address(self) -> str:
        """Where the host reaches the guest (every port is forwarded to 169.254.0.21); also
        the source of every connection the guest opens, as the host sees it."""
        return str(VETH_BASE + 2 * self.index + 1)

    @property
    def envd_url(self) -> str:
        return f"http://{self.guest_address}:{ENVD_PORT}"

    def _ruleset(self) -> str:
        walls_text = _elements(walls(self.open_ranges))
        return (
            "table ip aenv {\n"
            f"    set walls {{ type ipv4_addr; flags interval; elements = {{ {walls_text} }} }}\n"
            "    set allow { type ipv4_addr; flags interval; }\n"
            "    set deny { type ipv4_addr; flags interval; }\n"
            "    set dns { type ipv4_addr; }\n"
            "    set proxied { type inet_service; flags interval; }\n"
            "    set unnamed_udp { type inet_service; }\n"
            "    set tunnelled { type ipv4_addr; flags interval; }\n"
            "    set nfs { type inet_service; }\n"
            "    chain slot_pre {\n"
            "        type nat hook prerouting priority dstnat;\n"
            f'        iifname "vpeer" ip daddr {self.guest_address} dnat to {GUEST_IP}\n'
            "    }\n"
            "    chain slot_post {\n"
            "        type nat hook postrouting priority srcnat;\n"
            f'        oifname "vpeer" ip saddr {GUEST_IP} snat to {self.guest_address}\n'
            "    }\n"
            "    chain slot_input {\n"
            "        type filter hook input priority filter; policy accept;\n"
            '        iifname "tap0" ct state new drop\n'
            "    }\n"
            "    chain slot_forward {\n"
            "        type filter hook forward priority filter; policy drop;\n"
            f'        iifname "tap0" ip saddr != {GUEST_IP} drop\n'
            "        ct direction reply accept\n"
            "        ct state related accept\n"
            f'        iifname "vpeer" oifname "tap0" ip saddr {self.host_address} ct status dnat accept\n'
            # Each flow is an entry of the host's one conntrack table: a guest opening flows
            # as fast as it can would fill it for every slot and the node (new flows dropped
            # host-wide). Its live flows are counted here, past max_flows new ones are refused.
            + (f'        iifname "tap0" ct state new ct count over {self.max_flows} '
               "reject with icmp type admin-prohibited\n" if self.max_flows else "")
            + '        iifname "tap0" oifname "vpeer" goto egress\n'
            "    }\n"
            "    chain egress {\n"
            f"        ip daddr {METADATA_IP} tcp dport 80 accept\n"
            # The node's filtering resolver (network/dns.py), when it runs.
            f"        ip daddr {METADATA_IP} meta l4proto {{ tcp, udp }} th dport 53 accept\n"
            # The node's NFS server, for a slot whose sandbox mounts a shared volume: the set
            # holds NFS_PORT then (set_nfs), else nothing; the host redirects it to ganesha.
            # A kernel client holds one connection; a guest opening thousands would take the
            # one server's connections and descriptors from every sandbox's mounts.
            f"        ip daddr {METADATA_IP} tcp dport @nfs ct state new "
            f"ct count over {NFS_MAX_CONNECTIONS} reject with tcp reset\n"
            f"        ip daddr {METADATA_IP} tcp dport @nfs accept\n"
            "        ip daddr @walls meta l4proto tcp reject with tcp reset\n"
            "        ip daddr @walls reject with icmp type admin-prohibited\n"
            # A SOCKS5 egressProxy carries every TCP connection (the host redirects them to the
            # egress proxy); other protocols would leave beside the tunnel: only DNS may, and
            # then by the rules below.
            "        ip daddr @tunnelled udp dport != 53 reject with icmp type admin-prohibited\n"
            "        ip daddr @tunnelled meta l4proto != { tcp, udp } "
            "reject with icmp type admin-prohibited\n"
            "        ip daddr @allow accept\n"
            "        ip daddr @dns udp dport 53 accept\n"
            "        ip daddr @dns tcp dport 53 accept\n"
            "        tcp dport @proxied accept\n"
            # QUIC carries a name no one reads here: with names in denyOut it is refused
            # (EgressPolicy.filters_quic), as TLS without SNI is by the egress proxy.
            "        udp dport @unnamed_udp reject with icmp type admin-prohibited\n"
            "        ip daddr @deny meta l4proto tcp reject with tcp reset\n"
            "        ip daddr @deny reject with icmp type admin-prohibited\n"
            "        accept\n"
            "    }\n"
            "}\n"
            + self._policy_ops(self.policy)
            + _set_ops("aenv", "nfs", [str(NFS_PORT)] if self.nfs else [])
        )

    @staticmethod
    def _guard_ops() -> str:
        """The slot's `inet aenv_guard` table, asserted whole in any transaction (flush then
        add: idempotent, so every policy update also puts it on a slot made by an older
        runtime). Output: nothing the namespace itself sends leaves it (QEMU runs here and
        needs no IP socket: its TAP is an fd, QMP and NBD are unix sockets), except the
        kernel's own answers: resets and ICMP errors of the walls to the guest (tap0), ICMP
        errors about the host's traffic (ct related) to the host. Forward: no IPv6."""
        table = "inet aenv_guard"
        return (f"add table {table}\n"
                f"add chain {table} output {{ type filter hook output priority filter; "
                "policy drop; }\n"
                f"add chain {table} forward {{ type filter hook forward priority filter; "
                "policy accept; }\n"
                f"flush chain {table} output\n"
                f"flush chain {table} forward\n"
                f'add rule {table} output oifname "lo" accept\n'
                f'add rule {table} output oifname "tap0" meta nfproto ipv4 accept\n'
                f'add rule {table} output oifname "vpeer" meta l4proto icmp ct state related '
                "accept\n"
                f"add rule {table} forward meta nfproto ipv6 drop\n")

    @classmethod
    def _policy_ops(cls, policy: EgressPolicy) -> str:
        """One transaction's worth of set updates: the policy's elements replace the old (and
        the output guard is asserted, `_guard_ops`)."""
        return (cls._guard_ops()
                + _set_ops("aenv", "allow", _nets(policy.allow_nets))
                + _set_ops("aenv", "deny", _nets(policy.deny_nets))
                + _set_ops("aenv", "dns", [str(a) for a in policy.dns_allowed()])
                + _set_ops("aenv", "proxied", proxied_ports(policy))
                + _set_ops("aenv", "unnamed_udp", [str(QUIC_PORT)] if policy.filters_quic else [])
                + _set_ops("aenv", "tunnelled",
                           [str(ALL_TRAFFIC)] if policy.egress_proxy is not None else []))

    async def _nft(self, text: str) -> None:
        # nsenter enters only the network namespace (`ip netns exec` also remounts /sys): a
        # policy update costs one short process.
        await _run("nsenter", f"--net={self.netns_path}", "nft", "-f", "-", stdin=text)

    async def create(self) -> None:
        ns = self.netns_name
        await _run("ip", "netns", "add", ns)
        try:
            await _run(
                "ip", "-batch", "-",
                stdin=(
                    f"link add {self.host_veth} type veth peer name vpeer netns {ns}\n"
                    f"addr add {self.host_address}/31 dev {self.host_veth}\n"
                    f"link set {self.host_veth} up\n"
                ),
            )
            await _run(
                "ip", "-n", ns, "-batch", "-",
                stdin=(
                    "link set lo up\n"
                    f"addr add {self.guest_address}/31 dev vpeer\n"
                    "link set vpeer up\n"
                    "tuntap add dev tap0 mode tap\n"
                    # A fixed MAC: a restored guest's ARP entry for its gateway stays valid.
                    f"link set tap0 address {TAP_MAC}\n"
                    f"addr add {TAP_IP}/30 dev tap0\n"
                    "link set tap0 up\n"
                    f"route add default via {self.host_address}\n"
                ),
            )
            # No IPv6 in the slot: the rules are IPv4 only, so a route that appeared later
            # (a router advertisement, a link-local path) must find no address to use.
            no_ipv6 = [f"net.ipv6.conf.{dev}.disable_ipv6=1"
                       for dev in ("all", "default", "lo", "vpeer", "tap0")] \
                if os.path.exists("/proc/sys/net/ipv6") else []  # (a kernel without IPv6)
            await _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1",
                       *no_ipv6)
            await self._nft(self._ruleset())
            if self.rate_mbit:
                await self._shape()
            if not self.policy.is_default:
                await _host_sources(self.prefix, self.guest_address, self.policy.proxied_ports)
        except BaseException:
            with contextlib.suppress(NetworkError):
                await self.destroy()
            raise

    def _token_bucket(self) -> str:
        # a burst of 10 ms at the rate (at least 64 KiB, what one TSO segment may carry), and
        # packets wait at most 50 ms for tokens before they are dropped (TCP backs off)
        burst = max(64 << 10, self.rate_mbit * 1_000_000 // 8 // 100)
        return f"tbf rate {self.rate_mbit}mbit burst {burst} latency 50ms"

    async def _shape(self) -> None:
        """To the guest: the host end's egress; from it: the slot end's (vpeer)."""
        bucket = self._token_bucket()
        await _run("tc", "qdisc", "replace", "dev", self.host_veth, "root", *bucket.split())
        await _run("nsenter", f"--net={self.netns_path}", "tc", "qdisc", "replace", "dev",
                   "vpeer", "root", *bucket.split())

    async def set_policy(self, policy: EgressPolicy) -> None:
        """Replace the slot's egress policy. Safe in every order of events: the host first
        redirects the union of the old and new proxied ports (the proxy decides by the new
        policy), then the slot's sets change in one transaction, then the host narrows."""
        old, new = self.policy.proxied_ports, policy.proxied_ports
        if new == "web":  # before the host redirects: direct flows it allows are kept
            await keep_direct_flows(self.guest_address, policy)
        if new != old and new != "none":
            await _host_sources(self.prefix, self.guest_address, new, also=old)
        try:
            await self._nft(self._policy_ops(policy))
        except NetworkError:
            # A slot made by an older runtime (no sets) or damaged: rebuild its table whole.
            await self._nft("add table ip aenv\ndelete table ip aenv\n"
                            + self._ruleset_for(policy))
        self.policy = policy
        self.outbound = ALL_TRAFFIC not in policy.deny_nets
        if new != old:
            await _host_sources(self.prefix, self.guest_address, new)

    def _ruleset_for(self, policy: EgressPolicy) -> str:
        saved, self.policy = self.policy, policy
        try:
            return self._ruleset()
        finally:
            self.policy = saved

    async def set_outbound(self, allowed: bool) -> None:
        """Allow or block guest-initiated traffic leaving the host (the walls stay either way)."""
        await self.set_policy(EgressPolicy() if allowed else EgressPolicy(deny_nets=(ALL_TRAFFIC,)))

    async def set_nfs(self, enabled: bool) -> None:
        """Open (or close) the hole to the node's NFS server (docs/volumes.md §7.1): the
        slot's `nfs` set holds NFS_PORT, so its egress accepts TCP to METADATA_IP:NFS_PORT
        before the walls, and the host's `nfs_src` set holds the guest's address, so the host
        redirects that to ganesha's port. Opening: the host first (a flow the slot lets out
        always finds the redirect); closing: the slot first."""
        ops = _set_ops("aenv", "nfs", [str(NFS_PORT)] if enabled else [])
        if enabled:
            await _host_nfs_source(self.prefix, self.guest_address, True)
        try:
            await self._nft(ops)
        except NetworkError:
            # A slot made by an older runtime (no `nfs` set): rebuild its table whole.
            saved, self.nfs = self.nfs, enabled
            try:
                await self._nft("add table ip aenv\ndelete table ip aenv\n" + self._ruleset())
            except BaseException:
                self.nfs = saved
                raise
        self.nfs = enabled
        if not enabled:
            await _host_nfs_source(self.prefix, self.guest_address, False)
            await flush_nfs_flows(self)

    async def reset(self) -> None:
        """Before the slot serves another VM: default policy, no NFS, no tracked connections
        left of the last guest (here and on the host, where its masqueraded flows live)."""
        if not self.policy.is_default:
            await self.set_policy(EgressPolicy())
        if self.nfs:
            await self.set_nfs(False)
        await flush_conntrack(self)

    async def destroy(self) -> None:
        # Deleting the namespace deletes vpeer, and with it the host end of the veth.
        with contextlib.suppress(NetworkError):
            await _host_sources(self.prefix, self.guest_address, "none")
        with contextlib.suppress(NetworkError):
            await _host_nfs_source(self.prefix, self.guest_address, False)
        self.nfs = False
        if shutil.which("conntrack") is not None:  # the last guest's masqueraded flows
            with contextlib.suppress(NetworkError):
                await _run("conntrack", "-D", "-s", self.guest_address)
        await _run("ip", "netns", "del", self.netns_name)
        with contextlib.suppress(NetworkError):
            await _run("ip", "link", "del", self.host_veth)


async def flush_conntrack(slot: NetworkSlot) -> None:
    """Forget the slot's tracked connections (its namespace's table, and the host's entries
    of flows from its address). Best effort: without `conntrack` nothing is flushed."""
    if shutil.which("conntrack") is None:
        return
    with contextlib.suppress(NetworkError):
        await _run("ip", "netns", "exec", slot.netns_name, "conntrack", "-F")
    with contextlib.suppress(NetworkError):
        await _run("conntrack", "-D", "-s", slot.guest_address)


async def flush_nfs_flows(slot: NetworkSlot) -> None:
    """Forget the slot's tracked flows to the NFS address (a closed hole must not stay open
    for a connection made before). Best effort, as flush_conntrack."""
    if shutil.which("conntrack") is None:
        return
    with contextlib.suppress(NetworkError):
        await _run("ip", "netns", "exec", slot.netns_name, "conntrack", "-D", "-p", "tcp",
                   "-d", METADATA_IP, "--dport", str(NFS_PORT))
    with contextlib.suppress(NetworkError):
        await _run("conntrack", "-D", "-p", "tcp", "-s", slot.guest_address, "-d",
                   METADATA_IP, "--dport", str(NFS_PORT))


def _conntrack_flows(listing: str) -> Iterable[dict[str, str]]:
    """`conntrack -L` lines as dicts: the original direction's src/dst/sport/dport, the
    reply's as r_src/r_dst/..., and mark."""
    for line in listing.splitlines():
        flow: dict[str, str] = {}
        for word in line.split():
            key, sep, value = word.partition("=")
            if sep:
                flow["r_" + key if key in flow and key != "mark" else key] = value
        if "dport" in flow:
            yield flow


async def keep_direct_flows(address: str, policy: EgressPolicy) -> int:
    """Before a slot's TCP 80/443 goes (or stays) under name filtering: its direct flows to
    those ports (opened when names were not filtered, never seen by the egress proxy) get
    KEEP_MARK when `policy` allows them whatever their name (EgressPolicy.allows_every_name),
    and lose it otherwise. The host's forward chain resets the unmarked ones at their next
    packet: a flow the new policy allows is not cut, one it might deny is. Returns how many
    are kept. Without the `conntrack` tool none is kept (all are reset: fail closed)."""
    if shutil.which("conntrack") is None:
        return 0
    try:
        listing = await _run("conntrack", "-L", "-p", "tcp", "-s", address)
    except NetworkError:
        return 0
    kept = 0
    for flow in _conntrack_flows(listing):
        if flow["dport"] not in ("80", "443") or flow.get("r_src") != flow.get("dst"):
            continue  # other ports, or redirected to the proxy (it decides those itself)
        keep = policy.allows_every_name(flow["dst"], int(flow["dport"]))
        want = KEEP_MARK if keep else 0
        kept += keep
        if int(flow.get("mark", "0")) != want:
            with contextlib.suppress(NetworkError):  # the flow ended meanwhile
                await _run("conntrack", "-U", "-p", "tcp", "-s", flow["src"], "-d", flow["dst"],
                           "--sport", flow["sport"], "--dport", flow["dport"],
                           "-m", str(want))
    return kept


async def _host_sources(prefix: str, address: str, mode: str, also: str = "none") -> None:
    """Put `address` in the host's `web`/`all` redirect set for `mode` (and `also`), out of
    the other: one transaction."""
    table = f"{prefix}_host"
    keep = {mode, also} - {"none"}
    ops = ""
    for name in ("web", "all"):
        # add-then-delete makes the delete succeed whether or not the element was there.
        ops += f"add element ip {table} {name}_src {{ {address} }}\n"
        if name not in keep:
            ops += f"delete element ip {table} {name}_src {{ {address} }}\n"
    await _run("nft", "-f", "-", stdin=ops)


async def _host_nfs_source(prefix: str, address: str, enabled: bool) -> None:
    """Put `address` in the host's `nfs_src` set (its TCP to METADATA_IP:NFS_PORT is
    redirected to the NFS server), or take it out."""
    table = f"{prefix}_host"
    ops = f"add element ip {table} nfs_src {{ {address} }}\n"
    if not enabled:
        ops += f"delete element ip {table} nfs_src {{ {address} }}\n"
    await _run("nft", "-f", "-", stdin=ops)


HOST_RULES = """table ip {table} {{
    set web_src {{ type ipv4_addr; }}
    set all_src {{ type ipv4_addr; }}
    set nfs_src {{ type ipv4_addr; }}
    set walls {{ type ipv4_addr; flags interval; elements = {{ {walls} }} }}
    chain slots_spoof {{
        type filter hook prerouting priority raw; policy accept;
        iifname "{prefix}h*" fib saddr . iif oif missing drop
    }}
    chain slots_pre {{
        type nat hook prerouting priority dstnat;
{nfs_redirect}{redirects}    }}
    chain slots_input {{
        type filter hook input priority filter; policy accept;
        iifname "{prefix}h*" ct state established,related accept
{nfs_accept}{proxy_accept}        iifname "{prefix}h*" meta l4proto tcp reject with tcp reset
        iifname "{prefix}h*" reject with icmp type admin-prohibited
    }}
    chain slots_forward {{
        type filter hook forward priority filter; policy accept;
{nfs_forward}        iifname "{prefix}h*" oifname "{prefix}h*" drop
        iifname "{prefix}h*" ip daddr @walls drop
        iifname "{prefix}h*" ip saddr @all_src meta l4proto tcp ct status != dnat reject with tcp reset
        iifname "{prefix}h*" ip saddr @web_src tcp dport {{ {web} }} ct status != dnat ct mark != {keep_mark:#x} reject with tcp reset
    }}
    chain slots_post {{
        type nat hook postrouting priority srcnat;
        ip saddr 10.12.0.0/16 oifname != "{prefix}h*" masquerade
    }}
{nfs_post}}}
"""


def host_ruleset(prefix: str, proxy_port: int | None,
                 open_ranges: Iterable[IPv4Network] = (), nfs_port: int | None = None,
                 nfs_address: str | None = None) -> str:
    redirects, proxy_accept, nfs_redirect, nfs_accept = "", "", "", ""
    nfs_forward, nfs_post = "", ""
    if nfs_port is not None and nfs_address is not None:
        # The NFS server in a network namespace of its own (runtime/nfs_net.py): a DNAT to its
        # address, which keeps the guest's source address (what the exports' client lists
        # name; masqueraded by no table: `nfs_post`); forwarded to its link only when DNATed
        # so, before the walls (10.11/16 is in them). From the link: packets of those flows
        # only, and nothing to the host itself. The port stays walled on the host
        # (`walled_ports`: no other node picks it), though nothing of the host listens there.
        ipaddress.IPv4Address(nfs_address)
        link = nfs_veth(prefix)
        nfs_redirect = (f'        iifname "{prefix}h*" ip saddr @nfs_src ip daddr {METADATA_IP} '
                        f"tcp dport {NFS_PORT} dnat to {nfs_address}:{nfs_port}\n")
        nfs_accept = (f'        iifname "{link}" drop\n'
                      f"        tcp dport {nfs_port} ct status & dnat == 0 reject with tcp reset\n"
                      f"        udp dport {nfs_port} ct status & dnat == 0 drop\n")
        nfs_forward = (f'        iifname "{prefix}h*" oifname "{link}" ip daddr {nfs_address} '
                       f"tcp dport {nfs_port} ct status dnat accept\n"
                       f'        iifname "{prefix}h*" oifname "{link}" drop\n'
                       f'        iifname "{link}" oifname "{prefix}h*" ct direction reply accept\n'
                       f'        iifname "{link}" drop\n'
                       f'        oifname "{link}" drop\n')
        # The guest's source is kept by a source NAT to itself, before any table's masquerade
        # (`srcnat - 10`): an `accept` here would not stop the others. Every runtime of the host
        # has a table like this one whose postrouting masquerades 10.12/16 leaving through any
        # interface but its own slots' (`slots_post`), our link too: the session's other nodes
        # and test runtimes did, ganesha's namespace saw the host's end of the link as the
        # source and dropped the SYN (not 10.12/16), and the guests' mounts timed out. A NAT
        # binding made by an earlier chain, identity or not, ends the postrouting NAT chains
        # for the flow (the kernel's nf_nat_inet_fn), whatever table comes after.
        nfs_post = ("    chain nfs_post {\n"
                    "        type nat hook postrouting priority srcnat - 10;\n"
                    f'        oifname "{link}" ip saddr 10.12.0.0/16 snat to ip saddr\n'
                    "    }\n")
    elif nfs_port is not None:
        # Before the proxy's redirects (an `all_src` slot's TCP would go to the proxy). Only
        # what this redirect sent reaches ganesha's port, as for the proxy's port: ganesha
        # listens on every address (a redirect goes to the receiving slot interface's), and
        # neither the node's network nor a local process may reach it directly.
        nfs_redirect = (f'        iifname "{prefix}h*" ip saddr @nfs_src ip daddr {METADATA_IP} '
                        f"tcp dport {NFS_PORT} redirect to :{nfs_port}\n")
        nfs_accept = (f"        tcp dport {nfs_port} ct status & dnat == 0 reject with tcp reset\n"
                      f"        udp dport {nfs_port} ct status & dnat == 0 drop\n"
                      f'        iifname "{prefix}h*" tcp dport {nfs_port} ct status dnat accept\n')
    if proxy_port is not None:
        to = f"redirect to :{proxy_port}"
        redirects = (
            f'        iifname "{prefix}h*" ip daddr {METADATA_IP} tcp dport 80 {to}\n'
            f'        iifname "{prefix}h*" ip daddr {METADATA_IP} meta l4proto {{ tcp, udp }} '
            f'th dport 53 {to}\n'
            f'        iifname "{prefix}h*" ip saddr @all_src meta l4proto tcp {to}\n'
            f'        iifname "{prefix}h*" ip saddr @web_src tcp dport {{ {WEB_PORTS} }} {to}\n')
        # Only what a redirect above sent reaches the proxy's port, from whatever interface:
        # it listens on every address (a redirect goes to the receiving interface's), and a
        # stranger on the node's network or a local process must not reach it directly (the
        # red team's finding 6). `& dnat == 0`, a bit test: nft's `ct status != dnat`
        # compares the whole status word.
        not_redirected = f"th dport {proxy_port} ct status & dnat == 0"
        proxy_accept = (f"        meta l4proto tcp {not_redirected} reject with tcp reset\n"
                        f"        meta l4proto udp {not_redirected} drop\n"
                        f'        iifname "{prefix}h*" meta l4proto {{ tcp, udp }} '
                        f"th dport {proxy_port} ct status dnat accept\n")
    return HOST_RULES.format(table=f"{prefix}_host", prefix=prefix, redirects=redirects,
                             proxy_accept=proxy_accept, nfs_redirect=nfs_redirect,
                             nfs_accept=nfs_accept, nfs_forward=nfs_forward,
                             nfs_post=nfs_post, web=WEB_PORTS, keep_mark=KEEP_MARK,
                             walls=_elements(walls(open_ranges)))


def require_tools() -> None:
    """The node cannot isolate guests without nftables: say so at start, not at first use."""
    for tool, package in (("nft", "nftables"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            raise NetworkError(f"`{tool}` is not installed: the VM backend needs it for the "
                               f"guests' network walls (apt-get install {package})")


async def _foreign_forward_drops(table: str) -> list[dict[str, str]]:
    """Base forward chains of other tables whose policy drops what no rule accepts."""
    ruleset = json.loads(await _run("nft", "-j", "list", "chains"))
    found = []
    for item in ruleset.get("nftables", []):
        chain = item.get("chain")
        if not chain or chain.get("hook") != "forward" or chain.get("policy") != "drop":
            continue
        if chain.get("family") not in ("ip", "inet") or chain.get("table") == table:
            continue
        found.append({"family": chain["family"], "table": chain["table"], "name": chain["name"]})
    return found


async def _legacy_forward_drop() -> bool:
    if shutil.which("iptables-legacy") is None:
        return False
    try:
        rules = await _run("iptables-legacy", "-w", "-S", "FORWARD")
    except NetworkError:
        return False
    return "-P FORWARD DROP" in rules


async def open_foreign_forward(prefix: str) -> list[str]:
    """Accept slot traffic in forward chains other software set to drop (Docker does);
    returns the chains changed. Fails with what to change when it cannot."""
    if await _legacy_forward_drop():
        raise NetworkError(
            "the host's legacy iptables FORWARD policy is DROP (Docker?): guest traffic would "
            f"be dropped. Allow it, e.g. `iptables-legacy -I FORWARD -i {prefix}h+ -j ACCEPT` "
            f"and `iptables-legacy -I FORWARD -o {prefix}h+ -m conntrack --ctstate "
            "ESTABLISHED,RELATED -j ACCEPT` (or Docker's DOCKER-USER chain), then start again")
    changed = []
    tag = f'comment "{RULE_TAG}{prefix}"'
    for chain in await _foreign_forward_drops(f"{prefix}_host"):
        where = f"{chain['family']} {chain['table']} {chain['name']}"
        try:
            await _run("nft", "-f", "-", stdin=(
                f'insert rule {where} oifname "{prefix}h*" ct state established,related accept {tag}\n'
                f'insert rule {where} iifname "{prefix}h*" oifname != "{prefix}h*" accept {tag}\n'))
        except NetworkError as exc:
            raise NetworkError(
                f"the host's forward chain {where} drops by default (Docker?) and accept rules "
                f"for the slot interfaces {prefix}h* could not be added ({exc}); add them, e.g. "
                f'`nft insert rule {where} iifname "{prefix}h*" accept` and `nft insert rule '
                f'{where} oifname "{prefix}h*" ct state established,related accept`') from exc
        changed.append(where)
    return changed


async def close_foreign_forward(prefix: str) -> None:
    """Remove the rules open_foreign_forward put in other tables."""
    try:
        ruleset = json.loads(await _run("nft", "-j", "-a", "list", "ruleset"))
    except (NetworkError, ValueError):
        return
    for item in ruleset.get("nftables", []):
        rule = item.get("rule")
        if rule and rule.get("comment") == f"{RULE_TAG}{prefix}":
            with contextlib.suppress(NetworkError):
                await _run("nft", "delete", "rule", rule["family"], rule["table"], rule["chain"],
                           "handle", str(rule["handle"]))


async def _host_set_elements(table: str, name: str) -> list[str]:
    """The addresses in one of the host table's redirect sets (none if there is no table)."""
    try:
        out = await _run("nft", "-j", "list", "set", "ip", table, name)
    except NetworkError:
        return []
    for item in json.loads(out).get("nftables", []):
        if "set" in item:
            return [e for e in item["set"].get("elem", []) if isinstance(e, str)]
    return []


async def setup_host(prefix: str = "aenv", proxy_port: int | None = None,
                     keep_sources: Iterable[str] = (),
                     open_ranges: Iterable[IPv4Network] = (),
                     nfs_port: int | None = None, nfs_address: str | None = None) -> None:
    """Host side, once per runtime: forwarding on, the redirects to the egress proxy (when
    `proxy_port` is given) and to the NFS server (`nfs_port`, for the `nfs_src` slots: a DNAT
    to `nfs_address:nfs_port`, its own namespace's address, when given; else a redirect to the
    host's `nfs_port`), the input wall, masquerade, no slot-to-slot traffic.

    The table is replaced in one transaction (no moment without the input wall), and the
    redirect-set entries of `keep_sources` (slots of VMs adopted from a previous run) are
    carried over: a name-filtered sandbox's new TCP 80/443 must not leave directly, unfiltered,
    until the node has applied its policy again."""
    require_tools()
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    table = f"{prefix}_host"
    keep = set(keep_sources)
    carried = ""
    for name in ("web_src", "all_src", "nfs_src"):
        kept = [a for a in await _host_set_elements(table, name) if a in keep] if keep else []
        if kept:
            carried += f"add element ip {table} {name} {{ {', '.join(kept)} }}\n"
    await close_foreign_forward(prefix)
    await _run("nft", "-f", "-", stdin=f"add table ip {table}\ndelete table ip {table}\n"
               + host_ruleset(prefix, proxy_port, open_ranges, nfs_port, nfs_address)
               + carried)
    await open_foreign_forward(prefix)


async def teardown_host(prefix: str = "aenv") -> None:
    with contextlib.suppress(NetworkError):
        await _run("nft", "delete", "table", "ip", f"{prefix}_host")
    await close_foreign_forward(prefix)


async def remove_leftovers(prefix: str = "aenv") -> None:
    """Remove the host table and every slot namespace of `prefix`: what a runtime that was
    killed before closing (a crashed node, an aborted test or bench) left behind."""
    await teardown_host(prefix)
    for line in (await _run("ip", "netns", "list")).splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"{prefix}-s"):
            with contextlib.suppress(NetworkError):
                await _run("ip", "netns", "del", name)


#: The runtimes' host-wide locks (the prefix claims, the slot lock): a directory only root may
#: write. Not /run/lock or /tmp, which every local user may write: there a stranger made the slot
#: lock's file first and held it (no slot was ever made again), planted it as a symlink (root
#: created the file it named), or bound the prefix's abstract socket first (the VM backend
#: refused to start) (red team of 2026-12-07, tests/redteam/test_stranger_locks.py).
LOCK_DIR = Path("/run/aenv/locks")


def _lock_dir() -> Path:
    """LOCK_DIR (a directory of this user's under /tmp when not root), made if missing;
    NetworkError unless it is a directory of this user's that no one else may write."""
    uid = os.geteuid()
    directory = LOCK_DIR if uid == 0 else Path("/tmp") / f"aenv-locks-{uid}"
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
        raise NetworkError(f"{directory} is not a directory of uid {uid} that only it may "
                           "write: the runtime's locks cannot be kept there (remove it)")
    return directory


def _open_lock(name: str) -> int:
    return os.open(_lock_dir() / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                   0o600)


def _netns_inode() -> int:
    return os.stat("/proc/self/ns/net").st_ino


def _holder_of(fd: int) -> str:
    """Best effort: 'pid N (cmdline)' of the process that wrote its pid into lock file `fd`."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode().strip())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        return f"pid {pid} ({argv.decode(errors='replace').strip()[:160]})"
    return "another process"


def claim_prefix(prefix: str) -> io.FileIO:
    """Hold `prefix` for this process (in this network namespace) until the returned file is
    closed or the process ends (a flock on a file in the runtimes' root-only lock directory);
    NetworkError naming the holder when another runtime has it."""
    fd = _open_lock(f"prefix-{_netns_inode()}-{prefix}.lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_of(fd)
        os.close(fd)
        raise NetworkError(
            f"network prefix {prefix!r} is in use by another runtime on this host "
            f"({holder}): its slot namespaces ({prefix}-s*) and host table would be "
            f"taken over. Stop it, or give this one another prefix (AENV_VM_NETWORK_PREFIX, "
            f"RuntimeConfig.network_prefix)") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return io.FileIO(fd, "r+")


def _host_slot_lock() -> int:
    """Serialises slot address checks and creation between the runtimes of one network
    namespace (keyed by its inode: namespaces made for tests do not wait on each other).
    Returns the locked fd; closing it unlocks."""
    fd = _open_lock(f"slots-{_netns_inode()}.lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def _range_taken(slot: NetworkSlot) -> bool:
    """Whether any routing table holds a route inside the slot's /31: another runtime's slot,
    or a local or broadcast address of a host network that overlaps it (the local table wins
    over the slot's route: the guest's replies would go to the host, or nowhere)."""
    out = await _run("ip", "-4", "-o", "route", "show", "table", "all", "to", "root",
                     f"{slot.host_address}/31")
    return bool(out.strip())


class SlotPool:
    """Pre-built slots, refilled in the background between low and high watermarks."""

    def __init__(self, prefix: str = "aenv", low: int = 2, high: int = 8,
                 first_index: int = 1, max_slots: int = 32767, reuse_delay: float = 0.0,
                 open_ranges: tuple[IPv4Network, ...] = (), rate_mbit: int = 0,
                 max_flows: int = 0) -> None:
        """`reuse_delay` > 0: a freed slot is destroyed and its index (its addresses) serves no
        VM for that many seconds, so connections a proxy still pools to the dead VM expire
        instead of reaching the next guest at the same address. `rate_mbit`: each slot's
        bandwidth each way (0: not shaped); `max_flows`: its guest's live flows."""
        self.prefix = prefix
        self.open_ranges = open_ranges
        self.rate_mbit = rate_mbit
        self.max_flows = max_flows
        self.low, self.high = low, high
        self._free: list[NetworkSlot] = []
        self._next = first_index
        self._max = max_slots
        self._released: list[int] = []
        self.reuse_delay = reuse_delay
        self._cooling: deque[tuple[float, int]] = deque()  # (usable again at, index)
        self._in_use: dict[int, NetworkSlot] = {}
        self._refill_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._prefix_claim: io.FileIO | None = None
        self.skipped: set[int] = set()  # indices whose addresses the host routes already

    def acquire_prefix(self) -> None:
        """Hold the prefix (idempotent); NetworkError when another runtime holds it."""
        if self._prefix_claim is None:
            self._prefix_claim = claim_prefix(self.prefix)

    def _new_index(self) -> int:
        if self._cooling and self._cooling[0][0] <= time.monotonic():
            return self._cooling.popleft()[1]
        if self._released:
            return self._released.pop()
        if self._next > self._max:
            raise NetworkError("no network slot index left")
        index = self._next
        self._next += 1
        return index

    async def _build(self) -> NetworkSlot:
        self.acquire_prefix()
        while True:
            slot = NetworkSlot(self._new_index(), self.prefix, open_ranges=self.open_ranges,
                               rate_mbit=self.rate_mbit, max_flows=self.max_flows)
            with contextlib.suppress(NetworkError):  # leftovers of a crashed run of ours
                if Path(slot.netns_path).exists():
                    await slot.destroy()
            # A thread: the lock may be held by another runtime for a few `ip` calls.
            lock = await asyncio.to_thread(_host_slot_lock)
            try:
                if await _range_taken(slot):
                    self.skipped.add(slot.index)  # not ours to route: never used
                    continue
                try:
                    await slot.create()
                except BaseException:
                    self._released.append(slot.index)
                    raise
                return slot
            finally:
                os.close(lock)

    async def take(self) -> NetworkSlot:
        slot = self._free.pop() if self._free else await self._build()
        self._in_use[slot.index] = slot
        self.kick()
        return slot

    def claim(self, index: int, outbound: bool = True) -> NetworkSlot:
        """Take over slot `index`, which already exists and serves a VM that outlived an
        earlier runtime (runtime/adopt.py). Call it before the pool builds slots: the indices
        below it that nobody claims are reused later (their leftovers are rebuilt)."""
        self.acquire_prefix()
        slot = NetworkSlot(index, self.prefix, outbound, open_ranges=self.open_ranges,
                           rate_mbit=self.rate_mbit, max_flows=self.max_flows)
        # Whether its NFS hole is open is not known here: assumed open, so that the reset
        # after its VM closes it (the node opens it again for a sandbox that mounts one).
        slot.nfs = True
        self._in_use[index] = slot
        if index >= self._next:
            self._released.extend(range(self._next, index))
            self._next = index + 1
        elif index in self._released:
            self._released.remove(index)
        return slot

    def in_use_addresses(self) -> list[str]:
        """Guest addresses of the slots serving VMs (adopted ones included)."""
        return [slot.guest_address for slot in self._in_use.values()]

    async def give_back(self, slot: NetworkSlot) -> None:
        """Return a slot whose VM is gone; it is reset and reused (or rests, see reuse_delay)."""
        self._in_use.pop(slot.index, None)
        if self.reuse_delay > 0:
            with contextlib.suppress(NetworkError):
                await slot.destroy()
            self._cooling.append((time.monotonic() + self.reuse_delay, slot.index))
            return
        try:
            await slot.reset()
        except NetworkError:
            await self._discard(slot)
            return
        if len(self._free) < self.high:
            self._free.append(slot)
        else:
            await self._discard(slot)

    async def _discard(self, slot: NetworkSlot) -> None:
        with contextlib.suppress(NetworkError):
            await slot.destroy()
        self._released.append(slot.index)

    def kick(self) -> None:
        if len(self._free) < self.low and (self._refill_task is None or self._refill_task.done()):
            self._refill_task = asyncio.create_task(self.fill(self.low))

    async def fill(self, target: int) -> None:
        async with self._lock:
            while len(self._free) < target:
                self._free.append(await self._build())

    async def close(self) -> None:
        if self._refill_task is not None:
            self._refill_task.cancel()
            with contextlib.suppress(BaseException):
                await self._refill_task
        for slot in [*self._free, *self._in_use.values()]:
            with contextlib.suppress(NetworkError):
                await slot.destroy()
        self._free.clear()
        self._in_use.clear()
        if self._prefix_claim is not None:
            self._prefix_claim.close()
            self._prefix_claim = None

    @property
    def free_count(self) -> int:
        return len(self._free)


def netns_exists(name: str) -> bool:
    return os.path.exists(NETNS_DIR / name)
