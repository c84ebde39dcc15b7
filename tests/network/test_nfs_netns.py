"""The node's NFS server in a network namespace of its own (runtime/nfs_net.py; red team of
2026-12-07, tests/redteam/test_nfs_server_escape.py), in real namespaces: a slot with its NFS
hole open reaches the server through the host's DNAT and the server sees the guest's address;
nothing else reaches the server (not the host, not a slot dialling its address); the server's
namespace reaches nothing (the host's end of its link, a loopback service, a sandbox's envd at
its guest address). A plain TCP server in the namespace stands for ganesha. Root."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest

from agentenv.runtime import network as rtnet
from agentenv.runtime import nfs_net
from tests.network.lab import Lab, socket_in
from tests.network.test_nfs_hole import PeerServer, _greeting

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)")

PREFIX = "epnfsn"
NFS_PORT = 15093  # the server's port in its namespace (and walled on the host)
GUEST_SERVICE = 15095  # an envd stand-in in a guest


class NsServer(PeerServer):
    """PeerServer listening in a network namespace, on one address."""

    def __init__(self, netns: str, address: str, port: int) -> None:
        self.sock = socket_in(netns)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, nfs_net.NfsNet]]:
    net = nfs_net.claim(PREFIX, NFS_PORT)
    try:
        server = NsServer(net.name, net.server_address, NFS_PORT)
        try:
            with Lab(tmp_path_factory.mktemp("nfsnetns"), slots=2, prefix=PREFIX, port=15094,
                     tls=False, nfs_port=NFS_PORT, nfs_address=net.server_address,
                     proxy=False) as lab:
                yield lab, net
        finally:
            server.close()
    finally:
        net.remove()


def test_a_slot_with_the_hole_reaches_the_server_in_its_namespace(
        lab: tuple[Lab, nfs_net.NfsNet]) -> None:
    lb, net = lab
    a, b = lb.slots
    assert net.link.subnet_of(nfs_net.LINK_RANGE)
    lb.loop.run_until_complete(a.set_nfs(True))
    try:
        with lb.connect(a, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5) as sock:
            # DNATed, not masqueraded: the server sees the guest's address (the export's
            # CLIENT lists name it)
            assert _greeting(sock) == a.guest_address
            sock.sendall(b"ping")
            assert sock.recv(4) == b"ping"
        with pytest.raises(ConnectionRefusedError):  # no hole: the slot's walls
            lb.connect(b, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5)
        # The slot's guest may not dial the server's address directly (10.11/16: walled).
        with pytest.raises(ConnectionRefusedError):
            lb.connect(a, net.server_address, NFS_PORT, timeout=5)
    finally:
        lb.loop.run_until_complete(a.set_nfs(False))


OTHER_PREFIX = "epnfso"  # another runtime of the host


def test_another_runtimes_masquerade_leaves_the_guests_address(
        lab: tuple[Lab, nfs_net.NfsNet]) -> None:
    """Every runtime of the host has a host table whose postrouting masquerades 10.12/16
    leaving by any interface but its own slots' (a test session's other nodes and runtimes:
    the full suite's). The server must still see the guest's address, whichever table came
    first: masqueraded to the host's end of the link, the SYN was dropped in the server's
    namespace (not from 10.12/16) and the guests' NFS mounts timed out."""
    lb, net = lab
    a = lb.slots[0]
    loop = lb.loop

    def own_table() -> None:  # made again: now after the other table at the same priority
        loop.run_until_complete(rtnet.setup_host(lb.prefix, lb.port, nfs_port=NFS_PORT,
                                                 nfs_address=net.server_address))

    try:
        for order in ("other table after", "other table before"):
            loop.run_until_complete(rtnet.setup_host(OTHER_PREFIX, None))
            if order == "other table before":
                own_table()
            loop.run_until_complete(a.set_nfs(True))
            try:
                with lb.connect(a, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5) as sock:
                    assert _greeting(sock) == a.guest_address, order
            finally:
                loop.run_until_complete(a.set_nfs(False))
    finally:
        loop.run_until_complete(rtnet.teardown_host(OTHER_PREFIX))
        own_table()


def test_the_host_does_not_reach_the_server(lab: tuple[Lab, nfs_net.NfsNet]) -> None:
    """Its namespace takes new TCP from the guests' range only (a local process of the host
    comes from the host's end of the link)."""
    _, net = lab
    with pytest.raises(OSError):
        socket.create_connection((net.server_address, NFS_PORT), timeout=2).close()


def test_the_server_namespace_reaches_nothing(lab: tuple[Lab, nfs_net.NfsNet]) -> None:
    """A ganesha taken over, from its namespace: not the host at its end of the link (a
    service on every address), not a loopback service, not a sandbox's envd at its guest
    address (which the host reaches: the probe works)."""
    lb, net = lab
    a = lb.slots[0]
    host_service = socket.create_server(("0.0.0.0", 0))
    envd = socket_in(lb.guest_ns(a))
    envd.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    envd.bind(("0.0.0.0", GUEST_SERVICE))
    envd.listen(4)
    try:
        with socket.create_connection((a.guest_address, GUEST_SERVICE), timeout=5):
            pass  # the host reaches the guest's service
        with socket.create_connection(("127.0.0.1", host_service.getsockname()[1]), timeout=5):
            pass
        targets = {"the host's end of its link": (net.host_address,
                                                  host_service.getsockname()[1]),
                   "a loopback service": ("127.0.0.1", host_service.getsockname()[1]),
                   "a sandbox's envd": (a.guest_address, GUEST_SERVICE)}
        reached = {}
        for what, target in targets.items():
            sock = socket_in(net.name)
            sock.settimeout(3)
            try:
                sock.connect(target)
                reached[what] = "connected"
            except OSError as exc:
                reached[what] = type(exc).__name__
            finally:
                sock.close()
        # refused at once (its output chain resets), not left waiting
        assert reached == {what: "ConnectionRefusedError" for what in targets}, reached
    finally:
        envd.close()
        host_service.close()
