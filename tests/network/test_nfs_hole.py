"""The hole a shared volume's sandbox gets to the node's NFS server (runtime/network.py
`NetworkSlot.set_nfs`, docs/volumes.md §7.1), in real namespaces: a slot with its hole open
reaches 169.254.169.254:2049, which the host redirects to the server's port, and the server sees
the slot's guest address (what the export's client list names); a slot without it is refused
by its walls; the server's port takes nothing that was not redirected (not a local process,
not a slot dialling it directly); closing the hole (and a slot going back to the pool) cuts
the guest's open connection. A plain TCP server stands for ganesha. Root."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from agentenv.runtime import network as rtnet
from tests.network.lab import Lab

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)")

NFS_PORT = 15091  # where the stand-in for ganesha listens on the host (every address)


class PeerServer:
    """Answers every connection with the address it came from, then echoes what it gets."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, (addr, _) = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn, addr), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket, addr: str) -> None:
        with conn:
            conn.sendall(addr.encode() + b"\n")
            try:
                while data := conn.recv(4096):
                    conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    server = PeerServer(NFS_PORT)
    try:
        with Lab(tmp_path_factory.mktemp("nfshole"), slots=3, prefix="epnfs", port=15092,
                 tls=False, nfs_port=NFS_PORT, proxy=False) as lab:
            yield lab
    finally:
        server.close()


def _greeting(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(100)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def _host_nfs_sources(lab: Lab) -> list[str]:
    return lab.loop.run_until_complete(rtnet._host_set_elements(f"{lab.prefix}_host", "nfs_src"))


def test_only_a_slot_with_the_hole_reaches_the_nfs_server(lab: Lab) -> None:
    a, b, c = lab.slots
    lab.loop.run_until_complete(a.set_nfs(True))
    try:
        with lab.connect(a, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5) as sock:
            # The server sees the slot's guest address: what an export's CLIENT list names.
            assert _greeting(sock) == a.guest_address
            sock.sendall(b"ping")
            assert sock.recv(4) == b"ping"
        assert _host_nfs_sources(lab) == [a.guest_address]
        # A slot without the hole: its walls refuse 169.254/16.
        with pytest.raises(ConnectionRefusedError):
            lab.connect(b, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5)
        # The host's set alone opens nothing (the slot's walls still refuse) ...
        lab.loop.run_until_complete(rtnet._host_nfs_source(lab.prefix, c.guest_address, True))
        with pytest.raises(ConnectionRefusedError):
            lab.connect(c, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5)
        lab.loop.run_until_complete(rtnet._host_nfs_source(lab.prefix, c.guest_address, False))
        # ... nor does the slot's set alone: nothing redirects it, and the host's walls
        # drop what it forwards to 169.254/16 (no answer at all).
        lab.loop.run_until_complete(c._nft(f"add element ip aenv nfs {{ {rtnet.NFS_PORT} }}\n"))
        with pytest.raises((TimeoutError, OSError)):
            lab.connect(c, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=2).close()
        lab.loop.run_until_complete(c._nft("flush set ip aenv nfs\n"))
        # The slot's guest may not dial the server's port on the host either.
        with pytest.raises(ConnectionRefusedError):
            lab.connect(a, a.host_address, NFS_PORT, timeout=5)
    finally:
        lab.loop.run_until_complete(a.set_nfs(False))


def test_the_server_port_takes_only_redirected_flows(lab: Lab) -> None:
    """ganesha listens on every address: a local process, or anyone on the node's network,
    must not reach it without the redirect (their address would be nobody's export client,
    but they would speak to the server)."""
    for address in ("127.0.0.1", lab.slots[0].host_address):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, NFS_PORT), timeout=5).close()


def test_closing_the_hole_cuts_an_open_connection_and_the_pool_closes_it(lab: Lab) -> None:
    a = lab.slots[0]
    lab.loop.run_until_complete(a.set_nfs(True))
    sock = lab.connect(a, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5)
    try:
        assert _greeting(sock) == a.guest_address
        lab.loop.run_until_complete(a.set_nfs(False))
        assert _host_nfs_sources(lab) == []
        # Its next packet meets the walls: reset.
        with pytest.raises(OSError):
            sock.sendall(b"after")
            if not sock.recv(5):
                raise ConnectionResetError("closed")
    finally:
        sock.close()
    with pytest.raises(ConnectionRefusedError):
        lab.connect(a, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5)
    # A slot given back to the pool with its hole open is reset with it closed.
    lab.loop.run_until_complete(a.set_nfs(True))
    lab.loop.run_until_complete(a.reset())
    assert not a.nfs and _host_nfs_sources(lab) == []
    with pytest.raises(ConnectionRefusedError):
        lab.connect(a, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5)


def test_a_guest_holds_few_connections_to_the_nfs_server(lab: Lab) -> None:
    """One guest cannot take the one server's connections from every other sandbox's mounts:
    past NFS_MAX_CONNECTIONS live ones, a new connection is reset; another slot still gets in,
    and so does the first once one closes."""
    a, b = lab.slots[0], lab.slots[1]
    lab.loop.run_until_complete(a.set_nfs(True))
    lab.loop.run_until_complete(b.set_nfs(True))
    held: list[socket.socket] = []
    try:
        for _ in range(rtnet.NFS_MAX_CONNECTIONS):
            sock = lab.connect(a, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5)
            held.append(sock)
            assert _greeting(sock) == a.guest_address
        with pytest.raises(ConnectionRefusedError):
            lab.connect(a, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5).close()
        with lab.connect(b, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5) as other:
            assert _greeting(other) == b.guest_address
        held.pop().close()
        deadline = time.monotonic() + 10  # the closed flow leaves the count once it is gone
        while True:
            try:
                sock = lab.connect(a, rtnet.METADATA_IP, rtnet.NFS_PORT, timeout=5)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the guest's closed connection still counts"
                time.sleep(0.2)
        held.append(sock)
        assert _greeting(sock) == a.guest_address
    finally:
        for sock in held:
            sock.close()
        lab.loop.run_until_complete(a.set_nfs(False))
        lab.loop.run_until_complete(b.set_nfs(False))
