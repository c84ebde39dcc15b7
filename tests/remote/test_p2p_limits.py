"""The P2P chunk server does not let peers hold blockd's threads and descriptors: an idle
connection is closed after the idle timeout, and connections over the cap are closed at once."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.blockd.remote.p2p import PeerServer
from agentenv.blockd.remote.store import RemoteConfig, RemoteStore

SECRET = "cluster-secret"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RemoteStore]:
    s = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=1 << 24, background_bw=0))
    yield s
    s.close()


def serving(store: RemoteStore, **limits: float) -> tuple[PeerServer, tuple[str, int]]:
    server = PeerServer(store, "127.0.0.1:0", SECRET, **limits)  # type: ignore[arg-type]
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


def blobs_answer(address: tuple[str, int]) -> bytes:
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(f"GET /blobs HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {SECRET}\r\n"
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
        assert blobs_answer(address).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()


def test_connections_over_the_cap_are_closed_at_once(store: RemoteStore) -> None:
    server, address = serving(store, max_connections=4, idle_timeout=120.0)
    held = [socket.create_connection(address, timeout=10) for _ in range(4)]
    try:
        for sock in held:  # each is being served (its thread waits for a request)
            sock.sendall(b"GET /blobs HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer "
                         + SECRET.encode() + b"\r\n\r\n")
            assert sock.recv(12) == b"HTTP/1.1 200"
        with socket.create_connection(address, timeout=10) as extra:
            assert closed_by_server(extra, within=30)
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 30
        while True:  # the held connections' threads notice the close and free their places
            answer = blobs_answer(address)
            if answer.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert answer.startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
        server.stop()
