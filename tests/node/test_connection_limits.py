"""Bounds on open connections (relay/connections.py) on a real uvicorn with the node's and the
gateway's hardened settings: a client's idle connections past its bound are closed oldest
first, connections serving a request are never taken, the server-wide bound takes an idle
connection of the client holding the most, else the longest stalled one (its writes paused: a
client that does not read what it asked for), and refuses (503 naming the setting) only when
every connection is serving a request; a stalled connection that takes nothing for the send
timeout is cut, and a client holds a bounded number of stalled ones; over TLS a connection is
counted from its TCP accept (a handshake never finished is bounded like an idle connection)
and the handshake has a deadline; a trusted proxy has no per-client bound; a body relayed by a
trusted proxy or by a node's gateway (its node key) counts against the client X-Forwarded-For
names, and that header from anyone else counts for nothing. Clients are told apart by their
loopback address (127.0.0.2, 127.0.0.3: Linux answers the whole 127/8 on lo)."""

from __future__ import annotations

import gc
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from agentenv.node.server import connection_limits as node_connection_limits
from agentenv.relay.connections import ConnectionLimits, client_key
from agentenv.relay.server import hardened_config
from tests.control.helpers import wait_for
from tests.control.pki import Authority
from tests.node.conftest import free_port
from tests.node.test_concurrency_cap import Held

pytestmark = pytest.mark.timeout(120)


Serve = Callable[..., tuple[int, Held, ConnectionLimits]]


@pytest.fixture
def serve() -> Iterator[Serve]:
    stops: list[tuple[uvicorn.Server, threading.Thread, Held]] = []

    def start(idle_per_client: int = 0, total: int = 0, trusted: list[str] | None = None,
              tls_files: tuple[Path, Path] | None = None, head_timeout: float = 30,
              connections: ConnectionLimits | None = None,
              **bounds: Any) -> tuple[int, Held, ConnectionLimits]:
        app = Held()
        limits = connections if connections is not None else ConnectionLimits(
            idle_per_client, total, trusted, **bounds)
        port = free_port()
        server = uvicorn.Server(hardened_config(app, "127.0.0.1", port, 64 << 10, head_timeout,
                                                1, connections=limits, tls_files=tls_files))
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

    def connect(self, small_window: bool = False) -> socket.socket:
        sock = socket.socket()
        if small_window:  # a client that does not read fills its buffers sooner
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
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


def _read_response(sock: socket.socket, pace: float = 0.0) -> bytes:
    """One response, exactly (pipelined ones stay for the next call); with `pace`, a slow
    reader: that many seconds between reads of the body."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        chunk = sock.recv(1)
        assert chunk, f"connection closed before a response: {head!r}"
        head += chunk
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")[1:]
                  if line.lower().startswith(b"content-length:"))
    body = b""
    while len(body) < length:
        chunk = sock.recv(min(64 << 10, length - len(body)))
        assert chunk, f"connection closed after {len(body)} of {length} bytes"
        body += chunk
        time.sleep(pace)
    return head + body


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


def _cut_by_server(sock: socket.socket) -> bool:
    """Whether the server closed or reset `sock`, reading what it holds (within 30 s)."""
    sock.settimeout(1)
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            try:
                if not sock.recv(1 << 20):
                    return True
            except TimeoutError:
                continue
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.settimeout(30)


def _ask_and_never_read(sock: socket.socket, requests: int = 16) -> None:
    """Pipeline `requests` GETs of a large answer on `sock`, to be left unread."""
    sock.sendall(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n" * requests)


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
    busy: list[socket.socket] = []
    for n in range(4):  # each busy before the next opens: else three idle at once
        busy.append(one.connect())
        busy[-1].sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        wait_for(f"{n + 1} requests held", lambda n=n: app.waiting == n + 1, timeout=10)
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
                                            "AENV_MAX_CONNECTIONS": "100",
                                            "AENV_BODY_TIMEOUT": "5",
                                            "AENV_BODY_CONNECTIONS_PER_CLIENT": "3"})
    assert (limits.idle_per_client, limits.total) == (8, 100)
    assert (limits.body_timeout, limits.body_per_client) == (5, 3)
    default = ConnectionLimits.from_env(env={})
    assert default.idle_per_client == 256 and 0 < default.total <= 16384
    assert (default.body_timeout, default.body_per_client) == (60, 256)
    with pytest.raises(ValueError, match="AENV_MAX_CONNECTIONS='many' is not a whole number"):
        ConnectionLimits.from_env(env={"AENV_MAX_CONNECTIONS": "many"})


def test_an_ipv6_client_is_bounded_by_its_64() -> None:
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::9")
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:192.0.2.7") == "192.0.2.7"


def test_the_server_bound_takes_from_the_client_holding_the_most_idle(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    port, _, limits = serve(idle_per_client=0, total=4)
    victim, flood = clients(port, "127.0.0.2"), clients(port, "127.0.0.3")
    kept = victim.connect()  # the oldest idle connection of all
    wait_for("the first connection tracked", lambda: len(limits) == 1, timeout=10)
    flooded = [flood.connect() for _ in range(3)]
    wait_for("four connections tracked", lambda: len(limits) == 4, timeout=10)
    clients(port, "127.0.0.4").connect()  # a fifth: the flood's own oldest makes room
    wait_for("the flood's oldest closed", lambda: _closed_by_server(flooded[0]), timeout=10)
    assert not any(_closed_by_server(s) for s in (kept, *flooded[1:]))
    assert victim.get(kept).startswith(b"HTTP/1.1 200")


def test_connections_that_never_read_do_not_fill_the_server(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    """The red team's pipelining client: every connection of the server serving a request
    whose answer it never takes. A new client is still served: the longest stalled makes room."""
    port, _, limits = serve(idle_per_client=0, total=3)
    attacker, other = clients(port, "127.0.0.2"), clients(port, "127.0.0.3")
    stalled = [attacker.connect(small_window=True) for _ in range(3)]
    for sock in stalled:
        _ask_and_never_read(sock)
    wait_for("all three stalled", lambda: limits.stalled == 3, timeout=30)
    assert other.get(other.connect()).startswith(b"HTTP/1.1 200")
    assert (limits.aborted.count, limits.stalled, len(limits)) == (1, 2, 3)


def test_a_stalled_connection_is_cut_after_the_send_timeout(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    port, _, limits = serve(idle_per_client=0, total=0, send_timeout=2)
    one = clients(port, "127.0.0.2")
    stalled = one.connect(small_window=True)
    _ask_and_never_read(stalled)
    wait_for("one stalled", lambda: limits.stalled == 1, timeout=30)
    # one that reads, slowly, once its writes are paused: each send timeout finds it took
    # something since the last, so it is never cut
    slow = one.connect(small_window=True)
    _ask_and_never_read(slow, 6)  # more than the kernel's buffers take
    wait_for("both stalled", lambda: limits.stalled == 2, timeout=30)
    # its window (a few KiB) per 20 ms: 1 MiB takes seconds, some periods of the timeout
    assert _read_response(slow, pace=0.02).startswith(b"HTTP/1.1 200")
    for _ in range(5):
        assert _read_response(slow).startswith(b"HTTP/1.1 200")
    wait_for("the stalled connection cut", lambda: limits.send_timeouts.count == 1, timeout=30)
    assert _cut_by_server(stalled)
    assert limits.stalled == 0 and len(limits) == 1


def test_a_client_holds_a_bounded_number_of_stalled_connections(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    port, app, limits = serve(idle_per_client=0, total=0, stalled_per_client=2, send_timeout=0)
    one, other = clients(port, "127.0.0.2"), clients(port, "127.0.0.3")
    held = one.connect()  # serving a request, its answer not due: busy, never stalled
    held.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
    theirs = other.connect(small_window=True)  # another client's stalled one does not count
    _ask_and_never_read(theirs)
    wait_for("one stalled", lambda: limits.stalled == 1, timeout=30)
    mine = []
    for n in range(4):
        mine.append(one.connect(small_window=True))
        _ask_and_never_read(mine[-1])
        wait_for(f"{n + 1} stalled", lambda n=n: (limits.stalled, limits.aborted.count)
                 == (1 + min(n + 1, 2), max(0, n - 1)), timeout=30)
    assert _cut_by_server(mine[0]) and _cut_by_server(mine[1])  # the longest stalled first
    assert len(limits) == 4 and app.waiting == 1
    app.release.set()
    assert _read_response(held).startswith(b"HTTP/1.1 200")


def _post_head(length: int, path: str = "/upload") -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {length}\r\n\r\n".encode()


def _json_message(answer: bytes) -> str:
    return str(json.loads(answer.partition(b"\r\n\r\n")[2])["message"])


def test_a_body_that_stops_coming_is_answered_408(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    port, _, limits = serve(idle_per_client=0, total=0, body_timeout=2)
    sock = clients(port, "127.0.0.2").connect()
    sock.sendall(_post_head(1000) + b"x" * 10)  # and nothing more
    answer = _read_response(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert "AENV_BODY_TIMEOUT" in _json_message(answer)
    assert _cut_by_server(sock)
    assert limits.body_timeouts.count == 1
    wait_for("its place released", lambda: len(limits) == 0 and limits.receiving == 0,
             timeout=10)


def test_a_slow_but_steady_body_is_not_cut(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    port, _, limits = serve(idle_per_client=0, total=0, body_timeout=2)
    sock = clients(port, "127.0.0.2").connect()
    sock.sendall(_post_head(16))
    for _ in range(16):  # 4 s in all, twice the timeout: a byte well within each period
        time.sleep(0.25)
        sock.sendall(b"x")
    answer = _read_response(sock)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\n16"), answer
    assert limits.body_timeouts.count == 0 and limits.receiving == 0


def test_a_body_the_server_does_not_read_yet_is_never_late(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    """The server stopped reading (the app has not taken what came): the client cannot send,
    so the body's period does not run; once the app reads, the rest comes and is served."""
    port, app, limits = serve(idle_per_client=0, total=0, body_timeout=1)
    sock = clients(port, "127.0.0.2").connect()
    size = 4 << 20
    sock.sendall(_post_head(size, "/hold"))
    sender = threading.Thread(target=sock.sendall, args=(b"x" * size,), daemon=True)
    sender.start()
    wait_for("the request held", lambda: app.waiting == 1, timeout=10)
    time.sleep(3)  # three periods with the server's reading paused
    assert limits.body_timeouts.count == 0
    app.release.set()
    answer = _read_response(sock)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\n%d" % size)
    sender.join(30)


def test_a_client_holds_a_bounded_number_of_bodies_arriving(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    """Connections whose request body is still arriving are busy, never taken for room: a
    client past its bound of them is answered 429 before its body is read. Another client
    and a trusted proxy are not bounded by it; a finished body gives its place back."""
    port, _, limits = serve(idle_per_client=0, total=0, body_per_client=2,
                            trusted=["127.0.0.4"])
    one, other, proxy = (clients(port, a) for a in ("127.0.0.2", "127.0.0.3", "127.0.0.4"))
    slow = [one.connect() for _ in range(2)]
    for sock in slow:
        sock.sendall(_post_head(100) + b"x")
    wait_for("two bodies arriving", lambda: limits.receiving == 2, timeout=10)

    refused = one.connect()
    refused.sendall(_post_head(100) + b"x")
    answer = _read_response(refused)
    assert answer.startswith(b"HTTP/1.1 429"), answer
    assert "AENV_BODY_CONNECTIONS_PER_CLIENT" in _json_message(answer)
    assert _cut_by_server(refused)
    assert limits.body_refused.count == 1
    assert one.get(one.connect()).startswith(b"HTTP/1.1 200")  # requests without a body pass

    theirs = other.connect()
    theirs.sendall(_post_head(100) + b"x")
    proxied = [proxy.connect() for _ in range(3)]
    for sock in proxied:
        sock.sendall(_post_head(100) + b"x")
    wait_for("six bodies arriving", lambda: limits.receiving == 6, timeout=10)

    slow[0].sendall(b"x" * 99)
    assert _read_response(slow[0]).endswith(b"\r\n\r\n100")
    again = one.connect()
    again.sendall(_post_head(3) + b"abc")
    assert _read_response(again).endswith(b"\r\n\r\n3")
    for sock in [slow[1], theirs, *proxied]:
        sock.sendall(b"x" * 99)
        assert _read_response(sock).endswith(b"\r\n\r\n100")
    assert limits.receiving == 0 and limits.body_refused.count == 1


#: the key a node of a cluster is given (its gateway sends it with every request), a stranger
#: through that gateway, another team's client, and a test's "gateway" (its peer address)
NODE_KEY = "k" * 43
STRANGER, OTHER_TEAM, GATEWAY = "198.51.100.7", "203.0.113.9", "127.0.0.5"


def _via_gateway(length: int, client: str | None, key: str | None = NODE_KEY) -> bytes:
    """A POST head as a gateway sends it to a node: the node's key (`key`) and the address of
    the client it relays for (`client`, X-Forwarded-For)."""
    lines = ["POST /upload HTTP/1.1", "host: x", f"content-length: {length}"]
    if key is not None:
        lines.append(f"x-agentenv-node-key: {key}")
    if client is not None:
        lines.append(f"x-forwarded-for: {client}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _slow_bodies(sock_of: Callable[[], socket.socket], heads: list[bytes]) -> list[socket.socket]:
    """Start a body on a new connection per head, one byte of it sent."""
    started = []
    for head in heads:
        sock = sock_of()
        sock.sendall(head + b"x")
        started.append(sock)
    return started


def _refused_body(sock: socket.socket, head: bytes) -> bool:
    sock.sendall(head + b"x")
    answer = _read_response(sock)
    return answer.startswith(b"HTTP/1.1 429") and "AENV_BODY_CONNECTIONS_PER_CLIENT" in \
        _json_message(answer)


def _finish(socks: list[socket.socket], length: int = 100) -> None:
    for sock in socks:
        sock.sendall(b"x" * (length - 1))
        assert _read_response(sock).endswith(b"\r\n\r\n%d" % length)


def test_bodies_relayed_by_the_gateway_count_against_the_client_it_names(
        serve: Serve, clients: Callable[[int, str], Client],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The red team's finding: every request reaches a node of a cluster from its gateway, so a
    stranger's slow bodies through the gateway used up the gateway's bound at the node and
    every team's creates and commands on that node got 429. A request carrying the node's key
    is its gateway's: its body counts against the client the gateway names (X-Forwarded-For,
    which the gateway always writes itself), the gateway's own requests against the gateway."""
    monkeypatch.setenv("AENV_BODY_CONNECTIONS_PER_CLIENT", "2")
    port, _, limits = serve(connections=node_connection_limits(NODE_KEY))
    gateway = clients(port, GATEWAY)
    slow = _slow_bodies(gateway.connect, [_via_gateway(100, STRANGER)] * 2)
    wait_for("the stranger's two bodies arriving", lambda: limits.receiving == 2, timeout=10)
    assert _refused_body(gateway.connect(), _via_gateway(100, STRANGER))  # its own bound

    theirs = gateway.connect()  # another team's command, through the same gateway
    theirs.sendall(_via_gateway(3, OTHER_TEAM) + b"abc")
    answer = _read_response(theirs)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\n3"), answer
    own = _slow_bodies(gateway.connect, [_via_gateway(100, None)] * 2)  # the gateway's own
    wait_for("four bodies arriving", lambda: limits.receiving == 4, timeout=10)
    assert _refused_body(gateway.connect(), _via_gateway(100, None))
    _finish(slow + own)
    assert limits.receiving == 0 and limits.body_refused.count == 2


def test_a_forwarded_address_from_anyone_else_is_ignored(
        serve: Serve, clients: Callable[[int, str], Client],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that is neither a trusted proxy nor carries the node's key cannot pick its own
    bound by naming a client: its bodies count against its own address, whatever it writes."""
    monkeypatch.setenv("AENV_BODY_CONNECTIONS_PER_CLIENT", "2")
    monkeypatch.setenv("AENV_TRUSTED_PROXIES", "127.0.0.4")
    port, _, limits = serve(connections=node_connection_limits(NODE_KEY))
    stranger = clients(port, "127.0.0.3")
    slow = _slow_bodies(stranger.connect, [_via_gateway(100, "192.0.2.1", key=None),
                                           _via_gateway(100, "192.0.2.2", key="k" * 42 + "x")])
    wait_for("two bodies arriving", lambda: limits.receiving == 2, timeout=10)
    assert _refused_body(stranger.connect(), _via_gateway(100, "192.0.2.3", key=None))
    assert _refused_body(stranger.connect(), _via_gateway(100, "192.0.2.4", key="wrong"))
    assert _refused_body(stranger.connect(), _via_gateway(100, "127.0.0.4, 192.0.2.5",
                                                          key=NODE_KEY[:-1]))
    _finish(slow)
    assert limits.body_refused.count == 3


def test_bodies_through_a_trusted_proxy_count_against_the_client_it_names(
        serve: Serve, clients: Callable[[int, str], Client]) -> None:
    """A proxy in AENV_TRUSTED_PROXIES (a load balancer before the gateway, the gateway before
    a node) has no bound of its own, but what it relays for a client counts against that
    client: the right-most address of X-Forwarded-For no trusted proxy added, as uvicorn's
    proxy-headers middleware names the client to the app."""
    port, _, limits = serve(body_per_client=2, trusted=["127.0.0.4", "10.1.0.0/16"])
    proxy = clients(port, "127.0.0.4")
    slow = _slow_bodies(proxy.connect, [_via_gateway(100, STRANGER, key=None),
                                        _via_gateway(100, f"192.0.2.1, {STRANGER}, 10.1.2.3",
                                                     key=None)])
    wait_for("two bodies arriving", lambda: limits.receiving == 2, timeout=10)
    assert _refused_body(proxy.connect(), _via_gateway(100, f"{STRANGER}:4711", key=None))
    theirs = _slow_bodies(proxy.connect, [_via_gateway(100, OTHER_TEAM, key=None)] * 2)
    own = _slow_bodies(proxy.connect, [_via_gateway(100, None, key=None)] * 3)  # unbounded
    wait_for("seven bodies arriving", lambda: limits.receiving == 7, timeout=10)
    _finish(slow + theirs + own)
    assert limits.receiving == 0 and limits.body_refused.count == 1


def test_the_forwarded_client_is_the_one_uvicorn_names() -> None:
    limits = ConnectionLimits(0, 0, ["10.0.0.0/8"])

    def named(*values: str) -> str | None:
        return limits.forwarded_client([(b"x-forwarded-for", v.encode()) for v in values])

    assert named("192.0.2.1") == "192.0.2.1"
    assert named("192.0.2.1, 192.0.2.2") == "192.0.2.2"
    assert named("192.0.2.1", "192.0.2.2, 10.0.0.1") == "192.0.2.2"
    assert named("10.0.0.2, 10.0.0.1") == "10.0.0.2"  # all trusted: the first
    assert named("192.0.2.1:8080") == "192.0.2.1"
    assert named("[2001:db8::1]:8080") == "2001:db8::1"
    assert named("2001:db8::1") == "2001:db8::1"
    assert named("192.0.2.1, ") is None and named() is None


class Chatty:
    """An app whose WebSockets are sent 256 KiB messages until their client goes."""

    def __init__(self) -> None:
        self.sending = 0
        self.ended = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await Held()(scope, receive, send)
            return
        assert scope["type"] == "websocket"
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        self.sending += 1
        try:
            while True:
                await send({"type": "websocket.send", "bytes": b"x" * (256 << 10)})
        except Exception:  # the client is gone (uvicorn raises ClientDisconnected)
            self.ended += 1


def test_a_websocket_that_never_reads_is_cut_after_the_send_timeout(
        clients: Callable[[int, str], Client]) -> None:
    app = Chatty()
    port = free_port()
    limits = ConnectionLimits(0, 0, send_timeout=2)
    server = uvicorn.Server(hardened_config(app, "127.0.0.1", port, 64 << 10, 30, 1,
                                            connections=limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for("the server", lambda: server.started, timeout=30)
        sock = clients(port, "127.0.0.2").connect(small_window=True)
        sock.sendall(b"GET /ws HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\n"
                     b"connection: upgrade\r\nsec-websocket-version: 13\r\n"
                     b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        wait_for("the WebSocket open", lambda: app.sending == 1, timeout=30)
        # never read: its session ends (and its place in the request cap with it)
        wait_for("the sender told the client is gone", lambda: app.ended == 1, timeout=60)
        assert _cut_by_server(sock)
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ca = Authority(tmp_path_factory.mktemp("connpki"), "conn")
    cert, key = ca.issue("server", "IP:127.0.0.1")
    return {"ca": ca.cert, "cert": cert, "key": key}


def _tls_get(client: Client, ca: Path) -> bytes:
    context = ssl.create_default_context(cafile=str(ca))
    sock = context.wrap_socket(client.connect(), server_hostname="127.0.0.1")
    client.open.append(sock)
    return client.get(sock)  # type: ignore[arg-type]


def test_connections_that_never_finish_tls_are_bounded(
        serve: Serve, clients: Callable[[int, str], Client], pki: dict[str, Path]) -> None:
    port, _, limits = serve(idle_per_client=2, total=3, tls_files=(pki["cert"], pki["key"]))
    one, other = clients(port, "127.0.0.2"), clients(port, "127.0.0.3")
    silent = [one.connect() for _ in range(3)]  # TCP only: never a ClientHello
    wait_for("the oldest closed", lambda: _closed_by_server(silent[0]), timeout=20)
    assert not any(_closed_by_server(s) for s in silent[1:])
    assert _tls_get(other, pki["ca"]).startswith(b"HTTP/1.1 200")
    assert _tls_get(other, pki["ca"]).startswith(b"HTTP/1.1 200")  # the third: one makes room
    wait_for("a silent one closed for room", lambda: _closed_by_server(silent[1]), timeout=20)
    assert limits.reclaimed.count == 2


def test_a_tls_handshake_has_a_deadline(
        serve: Serve, clients: Callable[[int, str], Client], pki: dict[str, Path]) -> None:
    port, _, limits = serve(idle_per_client=0, total=0, tls_files=(pki["cert"], pki["key"]),
                            handshake_timeout=1)
    one = clients(port, "127.0.0.2")
    silent = one.connect()
    assert _tls_get(one, pki["ca"]).startswith(b"HTTP/1.1 200")
    wait_for("the silent one closed", lambda: _closed_by_server(silent), timeout=20)
    assert limits.handshake_failures.count == 1 and len(limits) == 1


def test_a_tls_connection_past_the_bound_is_closed_before_its_handshake(
        serve: Serve, clients: Callable[[int, str], Client], pki: dict[str, Path]) -> None:
    port, app, limits = serve(idle_per_client=0, total=1, tls_files=(pki["cert"], pki["key"]))
    one = clients(port, "127.0.0.2")
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    held = context.wrap_socket(one.connect(), server_hostname="127.0.0.1")
    one.open.append(held)  # type: ignore[arg-type]
    held.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
    wait_for("the request held", lambda: app.waiting == 1, timeout=30)
    refused = one.connect()  # all busy: closed at once, nothing said before TLS
    wait_for("the newcomer closed", lambda: _closed_by_server(refused), timeout=10)
    assert limits.refused.count == 1 and len(limits) == 1
    app.release.set()
    assert _read_response(held).startswith(b"HTTP/1.1 200")  # type: ignore[arg-type]


def test_tls_handshakes_ended_any_way_leave_nothing(
        serve: Serve, clients: Callable[[int, str], Client], pki: dict[str, Path],
        caplog: pytest.LogCaptureFixture) -> None:
    """Closed by the client, or cut by the head deadline (asyncio then ends the handshake's
    wait as if it were done, with no transport): no connection left counted, no task failed."""
    port, _, limits = serve(idle_per_client=0, total=0, tls_files=(pki["cert"], pki["key"]),
                            head_timeout=1, handshake_timeout=0)
    one = clients(port, "127.0.0.2")
    for _ in range(3):
        one.connect().close()
    silent = one.connect()
    wait_for("the silent one cut at the head deadline", lambda: _closed_by_server(silent),
             timeout=30)
    wait_for("every connection gone", lambda: len(limits) == 0, timeout=30)
    assert limits.handshake_failures.count == 4
    gc.collect()  # a task that failed says so when it is collected
    assert not [r for r in caplog.records if r.exc_info]
