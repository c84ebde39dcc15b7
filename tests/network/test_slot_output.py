"""What leaves a slot by a path other than the guest's: a QEMU taken over runs in the slot's
namespace (as its own unprivileged uid) and can open sockets there. Those packets are the
namespace's own (the output hook), not forwarded from tap0, so the slot's egress rules never see
them; the slot's output guard drops them, and the host's forward chain holds the walls (and
refuses spoofed sources) for whatever a slot sends. A real slot (NetworkSlot) and host table
(setup_host), an "internet" namespace the test makes with listeners; root, under the VM lock."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from agentenv.network.policy import EgressPolicy
from agentenv.runtime import network as rtnet

from .lab import in_netns, run, socket_in

pytestmark = [pytest.mark.root]
PREFIX = "nso"
INET = f"{PREFIX}-inet"
INET_IF = f"{PREFIX}i0"
GATEWAY = "198.18.9.1"
SERVER = "198.18.9.2"  # outside the walls: only the policy keeps a guest from it
WALLED = "172.31.77.2"  # inside 172.16/12: a wall whatever the policy
PORT = 9999
VM_UID = 64999  # stands for a jailed QEMU's uid: no capabilities, no passwd entry


@pytest.fixture(autouse=True)
def _root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (nftables, network namespaces)")


@dataclass
class Listener:
    """A UDP and a TCP listener on one address of the internet namespace; what reached them."""

    address: str
    got: list[str] = field(default_factory=list)
    socks: list[socket.socket] = field(default_factory=list)

    def start(self) -> None:
        udp = socket_in(INET, socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((self.address, PORT))
        tcp = socket_in(INET)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((self.address, PORT))
        tcp.listen(16)
        self.socks = [udp, tcp]

        def serve_udp() -> None:
            with contextlib.suppress(OSError):
                while True:
                    data, _ = udp.recvfrom(2048)
                    self.got.append(data.decode(errors="replace"))

        def serve_tcp() -> None:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = tcp.accept()
                    conn.settimeout(10)
                    with contextlib.suppress(OSError):
                        self.got.append(conn.recv(2048).decode(errors="replace"))
                    conn.close()

        for target in (serve_udp, serve_tcp):
            threading.Thread(target=target, daemon=True).start()

    def wait_for(self, marker: str) -> None:
        deadline = time.monotonic() + 30
        while marker not in self.got:
            assert time.monotonic() < deadline, f"{marker!r} never reached {self.address}"
            time.sleep(0.02)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


@dataclass
class World:
    slot: rtnet.NetworkSlot
    server: Listener
    walled: Listener

    def marker(self, listener: Listener, text: str) -> None:
        """`text` sent to `listener` from the host itself (not through the slot): once it
        arrived, anything sent before it had its chance."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.sendto(text.encode(), (listener.address, PORT))
        listener.wait_for(text)


@pytest.fixture
def world() -> Iterator[World]:
    loop = asyncio.new_event_loop()
    slot = rtnet.NetworkSlot(1, prefix=PREFIX)
    listeners: list[Listener] = []
    try:
        loop.run_until_complete(rtnet.remove_leftovers(PREFIX))
        loop.run_until_complete(rtnet.setup_host(PREFIX, 15998))
        run("ip", "netns", "del", INET, check=False)
        run("ip", "link", "del", INET_IF, check=False)
        run("ip", "netns", "add", INET)
        run("ip", "link", "add", INET_IF, "type", "veth", "peer", "name", "eth0", "netns", INET)
        run("ip", "addr", "add", f"{GATEWAY}/24", "dev", INET_IF)
        run("ip", "link", "set", INET_IF, "up")
        run("ip", "route", "add", "172.31.77.0/24", "via", SERVER)
        run("ip", "-n", INET, "-batch", "-", stdin=(
            "link set lo up\n"
            f"addr add {SERVER}/24 dev eth0\n"
            f"addr add {WALLED}/32 dev eth0\n"
            "link set eth0 up\n"
            f"route add default via {GATEWAY}\n"))
        loop.run_until_complete(slot.create())
        # The policy denies everything: only the walls' own exceptions could leave.
        loop.run_until_complete(slot.set_policy(EgressPolicy(deny_nets=(rtnet.ALL_TRAFFIC,))))
        for address in (SERVER, WALLED):
            listener = Listener(address)
            listener.start()
            listeners.append(listener)
        yield World(slot, *listeners)
    finally:
        for listener in listeners:
            listener.close()
        with contextlib.suppress(Exception):
            loop.run_until_complete(slot.destroy())
        run("ip", "route", "del", "172.31.77.0/24", check=False)
        run("ip", "link", "del", INET_IF, check=False)
        run("ip", "netns", "del", INET, check=False)
        loop.run_until_complete(rtnet.teardown_host(PREFIX))
        loop.close()


SENDER = r'''
import errno, json, socket, sys
target, port, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "sent"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
def udp():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(f"udp-{tag}".encode(), (target, port))
def tcp():
    with socket.create_connection((target, port), timeout=5) as s:
        s.sendall(f"tcp-{tag}".encode())
def udp6():
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
        s.sendto(b"v6", ("::ffff:" + target, port))
def raw():
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP).close()
def packet():
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0).close()
def ping():
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP).close()
for name, fn in (("udp", udp), ("tcp", tcp), ("udp6", udp6), ("raw", raw),
                 ("packet", packet), ("ping", ping)):
    attempt(name, fn)
print(json.dumps(out))
'''


def send_from_slot(slot: rtnet.NetworkSlot, target: str, tag: str,
                   as_root: bool = False) -> dict[str, str]:
    """SENDER run inside the slot's namespace as VM_UID (a QEMU taken over), or as root."""
    who = [] if as_root else ["setpriv", f"--reuid={VM_UID}", f"--regid={VM_UID}",
                              "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
    out = subprocess.run(["ip", "netns", "exec", slot.netns_name, *who, sys.executable, "-c",
                          SENDER, target, str(PORT), tag],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_a_process_in_the_slot_namespace_sends_nothing_out(world: World) -> None:
    """As the VM's uid inside the slot: UDP and TCP to an address the policy denies, and to a
    walled one, are refused at the source (the output guard) and reach no listener; raw,
    packet and ICMP sockets cannot be opened; IPv6 goes nowhere."""
    for listener, tag in ((world.server, "policy"), (world.walled, "wall")):
        result = send_from_slot(world.slot, listener.address, tag)
        assert result["udp"] != "sent" and result["tcp"] != "sent", result
        assert result["udp6"] != "sent", result
        assert {result["raw"], result["packet"], result["ping"]} <= {"EPERM", "EACCES"}, result
        world.marker(listener, f"marker-{tag}")
        assert not [g for g in listener.got if tag in g and not g.startswith("marker")], \
            f"sent from the slot's namespace past the walls: {listener.got}"


def test_the_guard_is_asserted_by_every_policy_update(world: World) -> None:
    """The guard drops by default and lets the kernel's answers to the guest out (tap0); a
    policy update puts it back whole (a slot of an older runtime gets it at its next update)
    without duplicating its rules."""
    table = run("nsenter", f"--net={world.slot.netns_path}", "nft", "list", "table", "inet",
                "aenv_guard")
    assert "policy drop" in table and 'oifname "tap0"' in table
    run("nsenter", f"--net={world.slot.netns_path}", "nft", "delete", "table", "inet",
        "aenv_guard")
    asyncio.run(world.slot.set_policy(EgressPolicy()))
    again = run("nsenter", f"--net={world.slot.netns_path}", "nft", "list", "table", "inet",
                "aenv_guard")
    assert again.count("accept") == table.count("accept")


def test_the_host_holds_the_walls_and_refuses_spoofed_sources(world: World) -> None:
    """Root in the slot's namespace (its own rules gone) still cannot reach a walled range
    through the host, nor send with another slot's address as its source."""
    run("nsenter", f"--net={world.slot.netns_path}", "nft", "flush", "ruleset")
    result = send_from_slot(world.slot, WALLED, "rootwall", as_root=True)
    world.marker(world.walled, "marker-rootwall")
    assert not [g for g in world.walled.got if "rootwall" in g and not g.startswith("marker")], \
        f"a walled range reached through the host: {world.walled.got} ({result})"
    # The policy's own address is now reachable (its rules are gone; the host's walls are
    # not a policy): the path itself works, so the refusal above is the wall's.
    result = send_from_slot(world.slot, SERVER, "rootok", as_root=True)
    world.server.wait_for("udp-rootok")
    # Another slot's guest address as the source: the host drops it before anything (the
    # egress proxy knows a sandbox by its source address).
    other = rtnet.NetworkSlot(7, prefix=PREFIX).guest_address
    run("ip", "-n", world.slot.netns_name, "addr", "add", f"{other}/32", "dev", "vpeer")

    def spoof() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((other, 0))
            sock.sendto(b"spoofed", (SERVER, PORT))

    in_netns(world.slot.netns_name, spoof)
    world.marker(world.server, "marker-spoof")
    assert "spoofed" not in world.server.got, "a spoofed slot source passed the host"
