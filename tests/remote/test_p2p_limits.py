"""The P2P chunk server does not let peers hold blockd's threads and descriptors: an idle
connection is closed after the idle timeout, a request head must arrive whole within it,
connections over the cap are closed at once, and connections without a credential cannot
take the places of keyed peers (a static peer's signed credential here)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.blockd.remote.p2p import PeerServer
from agentenv.blockd.remote.store import RemoteConfig, RemoteStore
from tests.remote.peerids import ASKER_TRUST, asker


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RemoteStore]:
    s = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=1 << 24, background_bw=0))
    yield s
    s.close()


def serving(store: RemoteStore, **limits: float) -> tuple[PeerServer, tuple[str, int]]:
    server = PeerServer(store, "127.0.0.1:0", node_id="server", trust=ASKER_TRUST,
                        **limits)  # type: ignore[arg-type]
    server.start()
    return server, ("127.0.0.1", int(server.address.rpartition(":")[2]))


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """The server ended the connection (EOF or reset) within `within` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def keyed_answer(address: tuple[str, int]) -> bytes:
    """The answer to a keyed request (for a path that is not a blob's: 404, a whole answer)."""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(f"GET /blobs HTTP/1.1\r\nHost: p\r\nAuthorization: {asker('/blobs')}\r\n"
                     "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_idle_peer_connection_is_closed(store: RemoteStore) -> None:
    server, address = serving(store, idle_timeout=1.0)
    try:
        with socket.create_connection(address, timeout=10) as idle:
            started = time.monotonic()
            assert closed_by_server(idle, within=30)
            assert time.monotonic() - started >= 0.5
        with socket.create_connection(address, timeout=10) as half:
            half.sendall(b"GET /blobs HTTP/1.1\r\n")  # a head that never ends
            assert closed_by_server(half, within=30)
        assert keyed_answer(address).startswith(b"HTTP/1.1 404")
    finally:
        server.stop()


def test_connections_over_the_cap_are_closed_at_once(store: RemoteStore) -> None:
    server, address = serving(store, max_connections=4, idle_timeout=120.0)
    held = [socket.create_connection(address, timeout=10) for _ in range(4)]
    try:
        for sock in held:  # each is being served (its thread waits for a request)
            sock.sendall(b"GET /blobs HTTP/1.1\r\nHost: p\r\nAuthorization: "
                         + asker("/blobs").encode() + b"\r\n\r\n")
            assert sock.recv(12) == b"HTTP/1.1 404"
        with socket.create_connection(address, timeout=10) as extra:
            assert closed_by_server(extra, within=30)
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 30
        while True:  # the held connections' threads notice the close and free their places
            answer = keyed_answer(address)
            if answer.startswith(b"HTTP/1.1 404") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert answer.startswith(b"HTTP/1.1 404")
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_strangers_holding_sockets_do_not_keep_a_keyed_peer_out(store: RemoteStore) -> None:
    server, address = serving(store, max_connections=2, max_unkeyed=2, idle_timeout=120.0)
    strangers = [socket.create_connection(address, timeout=10) for _ in range(5)]
    try:
        for sock in strangers:  # no key, not even a whole request line
            sock.sendall(b"G")
        # The peer's connection comes after them (the listen queue is in order): it closes
        # the oldest key-less one, and its head, sent at once, presents the key.
        assert keyed_answer(address).startswith(b"HTTP/1.1 404")
        for sock in strangers[:4]:  # closed for newer ones (the last of them for the peer)
            assert closed_by_server(sock, within=30)
        with socket.create_connection(address, timeout=10) as keyless:
            keyless.sendall(b"GET /blobs HTTP/1.1\r\nHost: p\r\n\r\n")
            keyless.settimeout(10)
            answer = b""
            while chunk := keyless.recv(65536):  # 401, then the server closes it
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 401")
    finally:
        for sock in strangers:
            sock.close()
        server.stop()


def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_deadline(store: RemoteStore) -> None:
    server, address = serving(store, idle_timeout=1.0)
    try:
        with socket.create_connection(address, timeout=10) as drip:
            closed = False
            for byte in b"GET /blobs HTTP/1.1\r\nX-Pad: " + b"a" * 200:
                # Each byte well within the idle timeout of the one before: only a deadline for
                # the whole head ends this.
                try:
                    drip.sendall(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                if closed_by_server(drip, within=0.1):
                    closed = True
                    break
            assert closed, "a head sent a byte at a time held its thread past the deadline"
        assert keyed_answer(address).startswith(b"HTTP/1.1 404")
    finally:
        server.stop()
