"""Network slots: one namespace per running VM, holding its TAP device.

Layout of slot i (1..32767):

    host netns                         slot netns aenv-s<i>
    aenvh<i>  10.12.x.(2i)/31  <--veth-->  vpeer 10.12.x.(2i+1)/31
                                           tap0  169.254.0.22/30  <-> guest eth0 169.254.0.21

- The host reaches the guest at the slot's `guest_address` (vpeer's address): nftables in the
  namespace DNATs every port of it to 169.254.0.21 (so envd is guest_address:49983) and SNATs
  the guest's outbound traffic to it. Every restored VM keeps 169.254.0.21 (snapshot ABI).
- Forwarding in the namespace is default-drop: replies and host-initiated connections pass;
  guest-initiated traffic goes through the `egress` chain, which always rejects the internal
  ranges (10.11/16, 10.12/16, 169.254/16: no sandbox reaches another) and, when outbound is
  off, everything else.
- On the host, `ip_forward` is enabled and one `aenv` nftables table masquerades traffic
  leaving from the slots towards other interfaces and drops slot-to-slot forwarding.

Slots are pooled (`SlotPool`): building one costs a few `ip`/`nft` calls; a released slot is
reset (outbound policy back to the default) and reused.

Several runtimes on one host (a node, a benchmark, tests) share the host's network namespace:
- a prefix belongs to one live runtime per network namespace (an abstract unix socket named
  after it is held for the runtime's life): a second runtime with the same prefix is refused
  with a message naming the holder, instead of deleting the first one's namespaces as
  leftovers and replacing its host table;
- slot addresses come from one range (10.12/16) whatever the prefix: a slot index whose host
  address another runtime's interface already has is skipped (checked and created under a
  host-wide lock), so two runtimes never route a guest address to two VMs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from agentenv.runtime.errors import NetworkError

GUEST_IP = "169.254.0.21"
TAP_IP = "169.254.0.22"
TAP_MAC = "02:ae:00:00:00:fe"
ENVD_PORT = 49983
VETH_BASE = ipaddress.IPv4Address("10.12.0.0")
NETNS_DIR = Path("/run/netns")
INTERNAL_CIDRS = "10.11.0.0/16, 10.12.0.0/16, 169.254.0.0/16"


async def _run(*argv: str, stdin: str | None = None) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    if proc.returncode != 0:
        raise NetworkError(f"{' '.join(argv[:4])} failed: {err.decode(errors='replace').strip()}")
    return out.decode()


@dataclass
class NetworkSlot:
    index: int
    prefix: str = "aenv"
    outbound: bool = True

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
        """Where the host reaches the guest (every port is forwarded to 169.254.0.21)."""
        return str(VETH_BASE + 2 * self.index + 1)

    @property
    def envd_url(self) -> str:
        return f"http://{self.guest_address}:{ENVD_PORT}"

    def _ruleset(self, outbound: bool) -> str:
        deny_all = "" if outbound else "        reject with icmp type admin-prohibited\n"
        return (
            "table ip aenv {\n"
            "    chain slot_pre {\n"
            "        type nat hook prerouting priority dstnat;\n"
            f'        iifname "vpeer" ip daddr {self.guest_address} dnat to {GUEST_IP}\n'
            "    }\n"
            "    chain slot_post {\n"
            "        type nat hook postrouting priority srcnat;\n"
            f'        oifname "vpeer" ip saddr {GUEST_IP} snat to {self.guest_address}\n'
            "    }\n"
            "    chain slot_forward {\n"
            "        type filter hook forward priority filter; policy drop;\n"
            "        ct state established,related accept\n"
            '        iifname "vpeer" oifname "tap0" ct status dnat accept\n'
            '        iifname "tap0" oifname "vpeer" jump egress\n'
            "    }\n"
            "    chain egress {\n"
            f"        ip daddr {{ {INTERNAL_CIDRS} }} reject with icmp type admin-prohibited\n"
            f"{deny_all}"
            "        accept\n"
            "    }\n"
            "}\n"
        )

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
            await _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            await _run("ip", "netns", "exec", ns, "nft", "-f", "-", stdin=self._ruleset(True))
        except BaseException:
            with contextlib.suppress(NetworkError):
                await self.destroy()
            raise

    async def set_outbound(self, allowed: bool) -> None:
        """Allow or block guest-initiated traffic leaving the host (internal ranges stay
        blocked either way)."""
        rules = "flush table ip aenv\n" + self._ruleset(allowed)
        await _run("ip", "netns", "exec", self.netns_name, "nft", "-f", "-", stdin=rules)
        self.outbound = allowed

    async def destroy(self) -> None:
        # Deleting the namespace deletes vpeer, and with it the host end of the veth.
        await _run("ip", "netns", "del", self.netns_name)
        with contextlib.suppress(NetworkError):
            await _run("ip", "link", "del", self.host_veth)


HOST_RULES = """table ip {table} {{
    chain slots_forward {{
        type filter hook forward priority filter; policy accept;
        iifname "{prefix}h*" oifname "{prefix}h*" drop
    }}
    chain slots_post {{
        type nat hook postrouting priority srcnat;
        ip saddr 10.12.0.0/16 oifname != "{prefix}h*" masquerade
    }}
}}
"""


async def setup_host(prefix: str = "aenv") -> None:
    """Host side, once per runtime: forwarding on, masquerade, no slot-to-slot traffic."""
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    table = f"{prefix}_host"
    with contextlib.suppress(NetworkError):
        await _run("nft", "delete", "table", "ip", table)
    await _run("nft", "-f", "-", stdin=HOST_RULES.format(table=table, prefix=prefix))


async def teardown_host(prefix: str = "aenv") -> None:
    with contextlib.suppress(NetworkError):
        await _run("nft", "delete", "table", "ip", f"{prefix}_host")


async def remove_leftovers(prefix: str = "aenv") -> None:
    """Remove the host table and every slot namespace of `prefix`: what a runtime that was
    killed before closing (a crashed node, an aborted test or bench) left behind."""
    await teardown_host(prefix)
    for line in (await _run("ip", "netns", "list")).splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"{prefix}-s"):
            with contextlib.suppress(NetworkError):
                await _run("ip", "netns", "del", name)


def _holder_of(name: str) -> str:
    """Best effort: 'pid N (cmdline)' of the process holding abstract socket `name`."""
    inode = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == "@" + name:
                inode = fields[6]
                break
    if inode is None:
        return "another process"
    needle = f"socket:[{inode}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == needle:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    return f"pid {pid} ({argv.decode(errors='replace').strip()[:160]})"
    return "another process"


def claim_prefix(prefix: str) -> socket.socket:
    """Hold `prefix` for this process (in this network namespace) until the socket is closed
    or the process ends; NetworkError naming the holder when another runtime has it."""
    name = f"agentenv-runtime-{prefix}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind("\0" + name)
    except OSError:
        sock.close()
        raise NetworkError(
            f"network prefix {prefix!r} is in use by another runtime on this host "
            f"({_holder_of(name)}): its slot namespaces ({prefix}-s*) and host table would be "
            f"taken over. Stop it, or give this one another prefix (AENV_VM_NETWORK_PREFIX, "
            f"RuntimeConfig.network_prefix)") from None
    return sock


def _host_slot_lock() -> int:
    """Serialises slot address checks and creation between the runtimes of one network
    namespace (keyed by its inode: namespaces made for tests do not wait on each other).
    Returns the locked fd; closing it unlocks."""
    netns = os.stat("/proc/self/ns/net").st_ino
    lock_dir = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")
    fd = os.open(lock_dir / f"agentenv-slots-{netns}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def _address_in_use(address: str) -> bool:
    return bool((await _run("ip", "-o", "-4", "addr", "show", "to", f"{address}/32")).strip())


class SlotPool:
    """Pre-built slots, refilled in the background between low and high watermarks."""

    def __init__(self, prefix: str = "aenv", low: int = 2, high: int = 8,
                 first_index: int = 1, max_slots: int = 32767, reuse_delay: float = 0.0) -> None:
        """`reuse_delay` > 0: a freed slot is destroyed and its index (its addresses) serves no
        VM for that many seconds, so connections a proxy still pools to the dead VM expire
        instead of reaching the next guest at the same address."""
        self.prefix = prefix
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
        self._prefix_claim: socket.socket | None = None
        self.skipped: set[int] = set()  # indices whose addresses another runtime has

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
            slot = NetworkSlot(self._new_index(), self.prefix)
            with contextlib.suppress(NetworkError):  # leftovers of a crashed run of ours
                if Path(slot.netns_path).exists():
                    await slot.destroy()
            # A thread: the lock may be held by another runtime for a few `ip` calls.
            lock = await asyncio.to_thread(_host_slot_lock)
            try:
                if await _address_in_use(slot.host_address):
                    self.skipped.add(slot.index)  # another runtime's slot: never ours
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
        slot = NetworkSlot(index, self.prefix, outbound)
        self._in_use[index] = slot
        if index >= self._next:
            self._released.extend(range(self._next, index))
            self._next = index + 1
        elif index in self._released:
            self._released.remove(index)
        return slot

    async def give_back(self, slot: NetworkSlot) -> None:
        """Return a slot whose VM is gone; it is reset and reused (or rests, see reuse_delay)."""
        self._in_use.pop(slot.index, None)
        if self.reuse_delay > 0:
            with contextlib.suppress(NetworkError):
                await slot.destroy()
            self._cooling.append((time.monotonic() + self.reuse_delay, slot.index))
            return
        if not slot.outbound:
            try:
                await slot.set_outbound(True)
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
