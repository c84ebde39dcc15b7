"""Bounds on open connections (relay/connections.py) on a real uvicorn with the node's and the
gateway's hardened settings: a client's idle connections past its bound are closed oldest
first, connections serving a request are never taken, the server-wide bound takes the oldest
idle connection anywhere and refuses (503 naming the setting) only when none is idle, and a
trusted proxy has no per-client bound. Clients are told apart by their loopback address
(127.0.0.2, 127.0.0.3: Linux answers the whole 127/8 on lo)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
import uvicorn

from agentenv.relay.connections import ConnectionLimits, client_key
from agentenv.relay.server import hardened_config
from tests.control.helpers import wait_for
from tests.node.conftest import free_port
from tests.node.test_concurrency_cap import Held

pytestmark = pytest.mark.timeout(120)


Serve = Callable[..., tuple[int, Held, ConnectionLimits]]


@pytest.fixture
def serve() -> Iterator[Serve]:
    stops: list[tuple[uvicorn.Server, threading.Thread, Held]] = []

    def start(idle_per_client: int, total: int,
              trusted: list[str] | None = None) -> tuple[int, Held, ConnectionLimits]:
        app = Held()
        limits = ConnectionLimits(idle_per_client, total, trusted)
        port = free_port()
        server = uvicorn.Server(hardened_config(app, "127.0.0.1", port, 64 << 10, 30, 1,
                                                connections=limits))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        stops.append((server, thread, app))
        wait_for("the server", lambda: server.started, timeout=30)
        return port, app, limits

    yield start
    for server, thread, app in stops:
        app.release.set()
        server.should_exit = True
        thread.join(30)


class Client:
    """Raw HTTP/1.1 connections from one loopback address."""

    def __init__(self, port: int, address: str) -> None:
        self.port = port
        self.address = address
        self.open: list[socket.socket] = []

    def connect(self) -> socket.socket:
        sock = socket.socket()
        sock.bind((self.address, 0))
        sock.settimeout(30)
        sock.connect(("127.0.0.1", self.port))
        self.open.append(sock)
        return sock

    def get(self, sock: socket.socket, path: str = "/") -> bytes:
        """Send a request; return the response head's status line (keep-alive)."""
        sock.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        return _read_response(sock)

    def close(self) -> None:
        for sock in self.open:
            sock.close()


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")[1:]
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return data


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (EOF waiting), without blocking long."""
    sock.settimeout(0.05)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.settimeout(30)


@pytest.fixture
def clients() -> Iterator[Callable[[int, str], Client]]:
    made: list[Client] = []

    def make(port: int, address: str) -> Client:
        made.append(Client(port, address))
        return made[-1]

    yield make
    for client in made:
        client.close()


def test_a_clients_idle_connections_past_its_bound_close_oldest_first(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    port, _, limits = serve(idle_per_client=3, total=0)
    one, other = clients(port, "127.0.0.2"), clients(port, "127.0.0.3")
    silent = one.connect()  # sent nothing yet: idle
    kept = one.connect()
    assert one.get(kept).startswith(b"HTTP/1.1 200")  # kept alive after a request: idle
    third = one.connect()
    theirs = [other.connect() for _ in range(3)]  # another client's do not count
    wait_for("six connections tracked", lambda: len(limits) == 6, timeout=10)

    fourth = one.connect()
    wait_for("the oldest idle connection closed", lambda: _closed_by_server(silent), timeout=10)
    assert not any(_closed_by_server(s) for s in (kept, third, fourth, *theirs))
    # `kept` serves a request after `third` opened: `third` is now the least recently active
    assert one.get(kept).startswith(b"HTTP/1.1 200")
    assert one.get(fourth).startswith(b"HTTP/1.1 200")
    one.connect()
    wait_for("the next oldest closed", lambda: _closed_by_server(third), timeout=10)
    assert one.get(kept).startswith(b"HTTP/1.1 200")
    assert limits.reclaimed.count == 2


def test_connections_serving_a_request_are_never_taken(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    port, app, limits = serve(idle_per_client=2, total=0)
    one = clients(port, "127.0.0.2")
    busy = [one.connect() for _ in range(4)]
    for sock in busy:
        sock.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
    wait_for("four requests held", lambda: app.waiting == 4, timeout=10)
    idle = [one.connect() for _ in range(3)]  # past the bound of 2 idle: the first goes
    wait_for("one idle connection closed", lambda: _closed_by_server(idle[0]), timeout=10)
    assert not any(_closed_by_server(s) for s in busy + idle[1:])
    assert limits.reclaimed.count == 1
    app.release.set()
    for sock in busy:
        assert _read_response(sock).startswith(b"HTTP/1.1 200")


def test_the_server_bound_takes_the_oldest_idle_anywhere_then_refuses(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    port, app, limits = serve(idle_per_client=0, total=3)
    one, other = clients(port, "127.0.0.2"), clients(port, "127.0.0.3")
    idle = one.connect()
    busy = [other.connect() for _ in range(2)]
    for sock in busy:
        sock.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
    wait_for("two requests held", lambda: app.waiting == 2, timeout=10)

    newest = other.connect()  # the fourth: takes the only idle one's place
    wait_for("the idle connection closed", lambda: _closed_by_server(idle), timeout=10)
    newest.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
    wait_for("three requests held", lambda: app.waiting == 3, timeout=10)

    refused = one.connect()  # none idle: refused with a reason
    answer = _read_response(refused)
    assert answer.startswith(b"HTTP/1.1 503")
    message = json.loads(answer.partition(b"\r\n\r\n")[2])["message"]
    assert "AENV_MAX_CONNECTIONS" in message and "3 open connections" in message
    assert limits.refused.count == 1
    app.release.set()
    for sock in [*busy, newest]:
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
    served = one.connect()  # room again once they are idle: the oldest idle goes
    assert one.get(served).startswith(b"HTTP/1.1 200")


def test_a_trusted_proxy_has_no_per_client_bound(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    port, _, limits = serve(idle_per_client=2, total=0, trusted=["127.0.0.2"])
    proxy, stranger = clients(port, "127.0.0.2"), clients(port, "127.0.0.3")
    kept = [proxy.connect() for _ in range(5)]
    mine = [stranger.connect() for _ in range(3)]
    wait_for("the stranger's oldest closed", lambda: _closed_by_server(mine[0]), timeout=10)
    assert len(limits) == 7
    assert not any(_closed_by_server(s) for s in kept + mine[1:])


def test_the_bounds_come_from_the_environment() -> None:
    limits = ConnectionLimits.from_env(env={"AENV_IDLE_CONNECTIONS_PER_CLIENT": "8",
                                            "AENV_MAX_CONNECTIONS": "100"})
    assert (limits.idle_per_client, limits.total) == (8, 100)
    default = ConnectionLimits.from_env(env={})
    assert default.idle_per_client == 256 and 0 < default.total <= 16384
    with pytest.raises(ValueError, match="AENV_MAX_CONNECTIONS='many' is not a whole number"):
        ConnectionLimits.from_env(env={"AENV_MAX_CONNECTIONS": "many"})


def test_an_ipv6_client_is_bounded_by_its_64() -> None:
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::9")
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:192.0.2.7") == "192.0.2.7"
