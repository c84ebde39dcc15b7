"""The sandbox proxy under hostile input and its limits (issue 18), streams that end when their
sandbox stops running, signed file URLs and host routing (issue 16).

A process-backend node of this module's own (short head and idle timeouts, a low connection
limit, a small body limit). With the process backend a sandbox port P is 127.0.0.1:P, so
`SandboxPort` listens on loopback as a sandbox's web server and records every request it gets.
Two canaries record any connection at all: one on 127.0.0.2 (no sandbox address can name it)
and one on a 127.0.0.1 port that no routing header ever names, only the hostile request text.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv.relay.server import target_problem
from tests.node.conftest import NodeProcess, environ_set, free_host_port

HEAD_TIMEOUT = 2
IDLE_TIMEOUT = 8
MAX_CONNECTIONS = 6
MAX_BODY = 1 << 20
BODY_TIMEOUT = 3
BODY_PER_CLIENT = 3  # under MAX_CONNECTIONS: one client cannot hold all of a sandbox's places


class _Recorder(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type) -> None:
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.connections = 0
        super().__init__(address, handler)


class _Canary(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.server.connections += 1  # type: ignore[attr-defined]


class _SandboxPortHandler(socketserver.StreamRequestHandler):
    """A tiny web server: `/stream` sends a chunk every 0.2 s for a minute, `/hang` never
    answers, anything else answers 200 "ok" with hop-by-hop headers of its own."""

    def handle(self) -> None:
        server: _Recorder = self.server  # type: ignore[assignment]
        server.connections += 1
        line = self.rfile.readline(65537).decode("latin-1").rstrip("\r\n")
        headers: dict[str, str] = {}
        while True:
            raw = self.rfile.readline(65537).decode("latin-1")
            if raw in ("\r\n", "\n", ""):
                break
            name, _, value = raw.partition(":")
            headers[name.strip().lower()] = value.strip()
        server.seen.append((line, headers))
        target = line.split(" ")[1] if line.count(" ") >= 2 else ""
        length = int(headers.get("content-length", "0") or 0)
        if length:
            self.rfile.read(length)
        elif headers.get("transfer-encoding") == "chunked":
            while size := int(self.rfile.readline(100).strip() or b"0", 16):
                self.rfile.read(size + 2)
            self.rfile.readline(100)
        with contextlib.suppress(OSError):
            if target.startswith("/stream"):
                self.wfile.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for _ in range(300):
                    self.wfile.write(b"5\r\ntick\n\r\n")
                    self.wfile.flush()
                    time.sleep(0.2)
            elif target.startswith("/hang"):
                time.sleep(IDLE_TIMEOUT + 10)
            else:
                self.wfile.write(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close, x-hop-secret\r\n"
                    b"x-hop-secret: 1\r\nkeep-alive: timeout=5\r\nx-end-to-end: 1\r\n\r\nok"
                )


def _serve(server: _Recorder) -> _Recorder:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def hard_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("proxy-node")
    node = NodeProcess(base / "state", base / "node.log")
    node.extra_args = ("--backend", "process", "--domain", f"localhost:{node.port}")
    node.extra_env = {
        "AENV_PROXY_HEAD_TIMEOUT": str(HEAD_TIMEOUT),
        "AENV_PROXY_IDLE_TIMEOUT": str(IDLE_TIMEOUT),
        "AENV_PROXY_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        "AENV_PROXY_MAX_BODY_BYTES": str(MAX_BODY),
        "AENV_BODY_TIMEOUT": str(BODY_TIMEOUT),
        "AENV_BODY_CONNECTIONS_PER_CLIENT": str(BODY_PER_CLIENT),
    }
    node.start()
    yield node
    node.cleanup()


@pytest.fixture(scope="module")
def listeners() -> Iterator[dict[str, _Recorder]]:
    made = {
        # the sandbox's port: a host port the node lets its process sandboxes reach
        "port": _serve(_Recorder(("127.0.0.1", free_host_port()), _SandboxPortHandler)),
        "other_host": _serve(_Recorder(("127.0.0.2", 0), _Canary)),
        "other_port": _serve(_Recorder(("127.0.0.1", 0), _Canary)),
    }
    yield made
    for server in made.values():
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def api(hard_node: NodeProcess) -> Iterator[httpx.Client]:
    with hard_node.client() as client:
        yield client


@pytest.fixture(scope="module")
def sandbox(api: httpx.Client) -> Iterator[dict[str, Any]]:
    created = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
    assert created.status_code == 201, created.text
    yield created.json()
    api.delete(f"/sandboxes/{created.json()['sandboxID']}")


def _one_request(request: bytes) -> bool:
    """Whether `request` is one head and nothing after it (no body, nothing pipelined)."""
    return request.endswith(b"\r\n\r\n") and request.count(b"\r\n\r\n") == 1


def _whole_response(answer: bytes) -> bool:
    """Whether `answer` holds a response's head and all the body its Content-Length gives."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(body) >= int(value.strip())
    return False


def raw_exchange(port: int, request: bytes, timeout: float = 5.0) -> tuple[int | None, bytes]:
    """Send raw bytes to the node; (status or None if it closed without one, whole answer).
    The answer is read until the node closes the connection, or, for a request of one head
    and nothing after it, until the response to it is whole: the node keeps a connection
    open after some answers (a 400 to a bad routing header), which left each of those
    exchanges waiting out `timeout` for nothing more to come."""
    single = _one_request(request)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(request)
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := conn.recv(65536):
                answer += chunk
                if single and _whole_response(answer):
                    break
    status = None
    if answer.startswith(b"HTTP/1.1 "):
        status = int(answer[9:12])
    return status, answer


def _addresses(listeners: dict[str, _Recorder]) -> dict[str, str]:
    host_p = listeners["other_host"].server_address[1]
    port_p = listeners["other_port"].server_address[1]
    return {"far": f"127.0.0.2:{host_p}", "near": f"127.0.0.1:{port_p}"}


def assert_canaries_untouched(listeners: dict[str, _Recorder]) -> None:
    assert listeners["other_host"].connections == 0
    assert listeners["other_port"].connections == 0


def hostile_cases(sid: str, port: int, far: str, near: str) -> list[tuple[bytes, set[int | None]]]:
    """(raw request, statuses allowed) pairs; each names the canaries in its text."""
    route = f"E2b-Sandbox-Id: {sid}\r\nE2b-Sandbox-Port: {port}\r\n"
    tail = f"{route}Connection: close\r\n\r\n"
    bad = {400}
    cases: list[tuple[str, set[int | None]]] = []
    for target in (
        f"@{far}/x",
        f"@{near}/v2/sandboxes",
        f"http://{far}/x",
        f"http://{near}/x",
        f"https://user@{far}/x",
        far,
        f"//{far}/x",
        "*",
        f"/x#@{far}",
        f"\\\\{far}/x",
        f"x@{far}/",
        f"/x%0d%0aHost:%20{far}\x7f",
    ):
        cases.append((f"GET {target} HTTP/1.1\r\nHost: a\r\n{tail}", bad))
    cases += [
        (f"CONNECT {far} HTTP/1.1\r\nHost: {far}\r\n{tail}", bad),
        (f"OPTIONS * HTTP/1.1\r\nHost: a\r\n{tail}", bad),
        # CR/LF injection: a second request line or header smuggled into the target
        (f"GET /x\r\nHost: {far}\r\n\r\nGET @{far}/ HTTP/1.1\r\nHost: a\r\n{tail}", {400, None}),
        (f"GET /x HTTP/1.1\rHost: {far}\r\n{tail}", {400, None}),
        (f"GET /x HTTP/1.1\r\nX-A: a\rE2b-Sandbox-Port: 1\r\n{tail}", {400, None}),
        (
            f"GET @{far}/x HTTP/1.1\nHost: a\n{route.replace(chr(13), '')}Connection: close\n\n",
            bad | {None},
        ),
        (f"GET /x HTTP/1.1\r\nHost: a\r\n {far}\r\n{tail}", {400, 200, None}),
        # routing headers that try to name another port or host
        (
            f"GET /x HTTP/1.1\r\nHost: a\r\nE2b-Sandbox-Id: {sid}\r\nE2b-Sandbox-Port: {port}@{far}\r\n\r\n",
            bad,
        ),
        (
            f"GET /x HTTP/1.1\r\nHost: a\r\nE2b-Sandbox-Id: {sid}\r\nE2b-Sandbox-Port: +{port}\r\n\r\n",
            bad,
        ),
        (
            f"GET /x HTTP/1.1\r\nHost: a\r\nE2b-Sandbox-Id: {sid}\r\nE2b-Sandbox-Port: 0x50\r\n\r\n",
            bad,
        ),
        (
            f"GET /x HTTP/1.1\r\nHost: a\r\n{route}E2b-Sandbox-Id: other\r\nConnection: close\r\n\r\n",
            bad,
        ),
        (
            f"GET /x HTTP/1.1\r\nHost: a\r\nE2b-Sandbox-Id: {sid}\r\nE2b-Sandbox-Port: 99999\r\n\r\n",
            bad,
        ),
        (
            f"GET /x HTTP/1.1\r\nHost: 1-{sid}.{far}\r\nHost: {far}\r\nConnection: close\r\n\r\n",
            {400, 401},
        ),
        # request smuggling: the body hides a second, hostile request
        (
            f"POST /x HTTP/1.1\r\nHost: a\r\n{route}Content-Length: 4\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET @{far}/ HTTP/1.1\r\nHost: a\r\n\r\n",
            {400, 200, None},
        ),
        # an upgrade to WebSocket with an absolute target
        (
            f"GET http://{far}/ws HTTP/1.1\r\nHost: a\r\n{route}Upgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n",
            {400, 403, None},
        ),
        # origin-form that merely mentions a host: relayed to the sandbox port, nowhere else
        (f"GET /x@{far} HTTP/1.1\r\nHost: a\r\n{tail}", {200}),
        (f"GET /x?u=http://{far}/@{near} HTTP/1.1\r\nHost: {far}\r\n{tail}", {200}),
        (f"GET /x%0d%0aHost:%20{far} HTTP/1.1\r\nHost: a\r\n{tail}", {200}),
    ]
    return [(raw.encode("latin-1"), allowed) for raw, allowed in cases]


def test_hostile_requests_reach_only_the_sandbox_port(
    hard_node: NodeProcess, sandbox: dict[str, Any], listeners: dict[str, _Recorder]
) -> None:
    sid = sandbox["sandboxID"]
    port = listeners["port"].server_address[1]
    addresses = _addresses(listeners)
    before = len(listeners["port"].seen)
    for raw, allowed in hostile_cases(sid, port, addresses["far"], addresses["near"]):
        status, answer = raw_exchange(hard_node.port, raw)
        assert status in allowed, (raw, answer[:300])
        if status == 400 and answer.find(b"\r\n\r\n{") > 0:
            body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert body["code"] == 400 and body["message"], body
    assert_canaries_untouched(listeners)
    relayed = [line for line, _ in listeners["port"].seen[before:]]
    assert relayed, "the origin-form cases reach the sandbox port"
    assert all(line.split(" ")[1].startswith("/") for line in relayed), relayed
    assert httpx.get(hard_node.url + "/health", timeout=5).status_code == 200


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    target=st.one_of(
        st.binary(min_size=1, max_size=40),
        st.text(alphabet="/@:.?#%\\*-_~!$&'()+,;=[]{}|^`\"<>aZ09 \t\r\n", min_size=1, max_size=40),
        st.sampled_from(["@", "http://", "//", "/", "https://u:p@", ""]).flatmap(
            lambda prefix: st.sampled_from(["far", "near"]).map(lambda which: (prefix, which))
        ),
    )
)
def test_generated_targets_reach_only_the_sandbox_port(
    hard_node: NodeProcess,
    sandbox: dict[str, Any],
    listeners: dict[str, _Recorder],
    target: bytes | str | tuple[str, str],
) -> None:
    addresses = _addresses(listeners)
    if isinstance(target, tuple):
        prefix, which = target
        target = f"{prefix}{addresses[which]}/x"
    raw_target = target.encode("latin-1", "replace") if isinstance(target, str) else target
    port = listeners["port"].server_address[1]
    request = (
        b"GET "
        + raw_target
        + b" HTTP/1.1\r\nHost: a\r\nE2b-Sandbox-Id: "
        + sandbox["sandboxID"].encode()
        + b"\r\nE2b-Sandbox-Port: "
        + str(port).encode()
        + b"\r\nConnection: close\r\n\r\n"
    )
    before = len(listeners["port"].seen)
    status, answer = raw_exchange(hard_node.port, request)
    assert status in (200, 400, 401, 404, 405, None), answer[:300]
    if status == 200 or target_problem(raw_target) is None:
        # what reached the sandbox port is an origin-form target, and nothing else was reached
        for line, _ in listeners["port"].seen[before:]:
            assert target_problem(line.split(" ")[1].encode("latin-1")) is None, line
    assert_canaries_untouched(listeners)


def test_huge_head_gets_431_and_a_slow_head_408(hard_node: NodeProcess) -> None:
    huge = b"GET /health HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * (200 << 10) + b"\r\n\r\n"
    status, answer = raw_exchange(hard_node.port, huge)
    assert status == 431, answer[:200]
    many = b"GET /health HTTP/1.1\r\n" + b"X-H: 1\r\n" * 20000 + b"\r\n"
    assert raw_exchange(hard_node.port, many)[0] == 431
    # slowloris: one byte every 0.1 s, never finishing the head
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", hard_node.port), timeout=10) as conn:

        def drip() -> None:
            with contextlib.suppress(OSError):
                for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"z" * 100:
                    conn.sendall(bytes([byte]))
                    time.sleep(0.1)

        threading.Thread(target=drip, daemon=True).start()
        answer = conn.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - began < HEAD_TIMEOUT + 3
    # a connection that sends nothing is closed too
    with socket.create_connection(("127.0.0.1", hard_node.port), timeout=HEAD_TIMEOUT + 5) as idle:
        assert idle.recv(4096).startswith(b"HTTP/1.1 408")
    assert httpx.get(hard_node.url + "/health", timeout=5).status_code == 200


def test_hop_by_hop_headers_are_dropped_both_ways(
    hard_node: NodeProcess, sandbox: dict[str, Any], listeners: dict[str, _Recorder]
) -> None:
    port = listeners["port"].server_address[1]
    headers = {
        "E2b-Sandbox-Id": sandbox["sandboxID"],
        "E2b-Sandbox-Port": str(port),
        "Connection": "keep-alive, X-Named-Hop",
        "X-Named-Hop": "1",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Proxy-Authorization": "Basic eDp5",
        "X-API-KEY": hard_node.api_key,
        "X-End-To-End": "kept",
    }
    before = len(listeners["port"].seen)
    answer = httpx.get(f"{hard_node.url}/hop", headers=headers, timeout=10)
    assert answer.status_code == 200 and answer.text == "ok"
    _, seen = listeners["port"].seen[before]
    for dropped in (
        "x-named-hop",
        "keep-alive",
        "te",
        "proxy-authorization",
        "x-api-key",
        "e2b-sandbox-id",
        "e2b-sandbox-port",
    ):
        assert dropped not in seen, (dropped, seen)
    assert seen["x-end-to-end"] == "kept"
    assert "x-hop-secret" not in answer.headers and "keep-alive" not in answer.headers
    assert answer.headers["x-end-to-end"] == "1"


def test_a_stranger_cannot_hold_a_secure_sandboxs_envd_connections(
    hard_node: NodeProcess, sandbox: dict[str, Any]
) -> None:
    """Requests to a secure sandbox's envd without its access token are refused by the node
    before they take one of the sandbox's proxied connections: a stranger who knew only the id
    held them all with bodies that never end and locked the owner out (429 for the owner)."""
    sid, token = sandbox["sandboxID"], sandbox["envdAccessToken"]
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS + 2):
            conn = socket.create_connection(("127.0.0.1", hard_node.port), timeout=30)
            held.append(conn)
            conn.sendall(f"POST /files?path=/tmp/x HTTP/1.1\r\nHost: localhost\r\n"
                         f"E2b-Sandbox-Id: {sid}\r\nE2b-Sandbox-Port: 49983\r\n"
                         "Content-Length: 100000000\r\n\r\nx".encode())
            answer = conn.recv(4096)
            assert answer.startswith(b"HTTP/1.1 401"), answer
        with httpx.Client(base_url=hard_node.url, timeout=30, headers={
                "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}) as client:
            assert client.get("/envs", headers={"X-Access-Token": token}).status_code == 200
            assert client.get("/envs").status_code == 401
            assert client.get("/health").status_code < 300  # a body-less probe needs no token
    finally:
        for conn in held:
            conn.close()


def test_body_idle_and_connection_limits(
    hard_node: NodeProcess, sandbox: dict[str, Any], listeners: dict[str, _Recorder]
) -> None:
    port = listeners["port"].server_address[1]
    route = {"E2b-Sandbox-Id": sandbox["sandboxID"], "E2b-Sandbox-Port": str(port)}
    with httpx.Client(base_url=hard_node.url, headers=route, timeout=30) as client:
        too_big = client.post("/upload", content=b"x" * (MAX_BODY + 1))
        assert too_big.status_code == 413 and "AENV_PROXY_MAX_BODY_BYTES" in too_big.text
        chunked = client.post("/upload", content=iter([b"x" * (64 << 10)] * 20))
        assert chunked.status_code == 413
        assert client.post("/upload", content=b"x" * 1000).status_code == 200
        began = time.monotonic()
        hung = client.get("/hang")
        assert hung.status_code == 504 and "AENV_PROXY_IDLE_TIMEOUT" in hung.text
        assert IDLE_TIMEOUT - 1 < time.monotonic() - began < IDLE_TIMEOUT + 5

    streams: list[Any] = []
    clients = [httpx.Client(base_url=hard_node.url, headers=route, timeout=30) for _ in range(8)]
    try:
        for client in clients[:MAX_CONNECTIONS]:
            stream = client.stream("GET", "/stream")
            streams.append(stream)
            assert stream.__enter__().status_code == 200
        refused = clients[MAX_CONNECTIONS].get("/x")
        assert refused.status_code == 429, refused.text
        assert "AENV_PROXY_MAX_CONNECTIONS" in refused.json()["message"]
    finally:
        for stream in streams:
            with contextlib.suppress(Exception):
                stream.__exit__(None, None, None)
        for client in clients:
            client.close()
    deadline = time.monotonic() + 10
    with httpx.Client(base_url=hard_node.url, headers=route, timeout=30) as client:
        while client.get("/x").status_code != 200:
            assert time.monotonic() < deadline, "the connection limit was not released"
            time.sleep(0.2)


def test_a_stranger_sending_bodies_slowly_holds_few_places_briefly(
    hard_node: NodeProcess, sandbox: dict[str, Any], listeners: dict[str, _Recorder]
) -> None:
    """Bodies sent slowly on purpose to a public sandbox port: one client holds at most
    AENV_BODY_CONNECTIONS_PER_CLIENT of them (429 past it, before its body is read), so others
    still reach the sandbox; each is cut with 408 once no byte came for AENV_BODY_TIMEOUT."""
    port = listeners["port"].server_address[1]
    head = (f"POST /upload HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {sandbox['sandboxID']}\r\n"
            f"E2b-Sandbox-Port: {port}\r\ncontent-length: 1000\r\n\r\n").encode()

    def slow_post() -> socket.socket:
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))  # the stranger: another client than the test's own
        sock.settimeout(BODY_TIMEOUT + 30)
        sock.connect(("127.0.0.1", hard_node.port))
        sock.sendall(head + b"x")  # one byte of 1000, then nothing
        return sock

    def answer(sock: socket.socket) -> bytes:
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                data += chunk
        sock.close()
        return data

    seen = len(listeners["port"].seen)
    slow = [slow_post() for _ in range(BODY_PER_CLIENT)]
    deadline = time.monotonic() + 30
    while len(listeners["port"].seen) < seen + BODY_PER_CLIENT:  # relayed, bodies pending
        assert time.monotonic() < deadline, "the slow requests did not reach the sandbox"
        time.sleep(0.05)
    refused = answer(slow_post())
    assert refused.startswith(b"HTTP/1.1 429"), refused
    assert b"AENV_BODY_CONNECTIONS_PER_CLIENT" in refused
    route = {"E2b-Sandbox-Id": sandbox["sandboxID"], "E2b-Sandbox-Port": str(port)}
    with httpx.Client(base_url=hard_node.url, headers=route, timeout=30) as client:
        assert client.post("/upload", content=b"x" * 1000).status_code == 200
    for sock in slow:
        cut = answer(sock)
        assert cut.startswith(b"HTTP/1.1 408"), cut
        assert b"AENV_BODY_TIMEOUT" in cut


def test_requests_to_a_closed_port_are_logged_within_limits(
    hard_node: NodeProcess, sandbox: dict[str, Any]
) -> None:
    """Anyone with a sandbox's URL can ask for a port nothing listens on as fast as the node
    answers: the node's log gets the first lines of the window, not one per request."""
    sid = sandbox["sandboxID"]
    route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(free_host_port())}
    start = hard_node.log_path.stat().st_size
    with httpx.Client(base_url=hard_node.url, headers=route, timeout=30) as client:
        for _ in range(200):
            assert client.get("/").status_code == 502
    with hard_node.log_path.open("rb") as f:
        f.seek(start)
        lines = [json.loads(line) for line in f.read().splitlines() if line.startswith(b"{")]
    about = [line for line in lines if line.get("sandbox_id") == sid
             and line["msg"] in ("sandbox port not answering", "proxy port refused")]
    assert 0 < len(about) <= 20, len(about)


def test_every_unauthenticated_route_is_health_metrics_or_openapi(
    hard_node: NodeProcess, tmp_path: Path
) -> None:
    """Enumerate the routes of the app the node serves; without a key, each answers 401,
    except /health, /metrics and /openapi.json (and the template file uploads, which check
    a signature of their own)."""
    from starlette.routing import Route

    from agentenv.node.server import ServeOptions, build_app

    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process"))
    routes = [r for r in app.api.routes if isinstance(r, Route)]
    assert len(routes) > 30
    open_paths = []
    with httpx.Client(base_url=hard_node.url, timeout=30, trust_env=False) as client:
        for route in routes:
            path = re.sub(r"\{[^}]+\}", "x1", route.path)
            for method in sorted(route.methods or {"GET"}):
                if method == "HEAD":
                    continue
                answer = client.request(method, path)
                if answer.status_code != 401:
                    open_paths.append((method, route.path, answer.status_code))
    public = {"/health", "/openapi.json"}
    unexpected = [
        (m, p, s)
        for m, p, s in open_paths
        if p not in public and not (p.startswith("/template-files/") and s in (401, 403))
    ]
    assert not unexpected, unexpected
    assert {p for _, p, _ in open_paths} >= public


def test_kill_ends_every_stream_at_once(
    api: httpx.Client, hard_node: NodeProcess, listeners: dict[str, _Recorder]
) -> None:
    """A stream from a port the sandbox's death does not close (the test's own listener): the
    proxy must cut it, and the next request gets E2B's 502."""
    sid = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
    port = listeners["port"].server_address[1]
    route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)}
    with httpx.Client(base_url=hard_node.url, headers=route, timeout=30) as client:
        with client.stream("GET", "/stream") as stream:
            chunks = stream.iter_raw()
            assert next(chunks)
            began = time.monotonic()
            assert api.delete(f"/sandboxes/{sid}").status_code == 204
            with pytest.raises(httpx.HTTPError):
                for _ in chunks:
                    assert time.monotonic() - began < 5
            assert time.monotonic() - began < 5
        after = client.get("/x")
    assert after.status_code == 502
    assert after.json() == {"sandboxId": sid, "message": "The sandbox was not found", "code": 502}


@contextlib.contextmanager
def sdk_env(node: NodeProcess) -> Iterator[None]:
    with environ_set(
        {"E2B_API_URL": node.url, "E2B_SANDBOX_URL": node.url, "E2B_API_KEY": node.api_key}
    ):
        yield


@pytest.mark.parametrize("how", ["kill", "pause"])
def test_background_command_ends_when_its_sandbox_stops(hard_node: NodeProcess, how: str) -> None:
    from e2b import Sandbox
    from e2b.exceptions import SandboxNotRunningException

    with sdk_env(hard_node):
        sbx = Sandbox.create(timeout=120)
        try:
            handle = sbx.commands.run("sleep 100", background=True)
            stopped_at: list[float] = []

            def stop() -> None:
                stopped_at.append(time.monotonic())  # the 5 s count from the kill or pause
                sbx.kill() if how == "kill" else sbx.pause()

            threading.Timer(1.0, stop).start()
            with pytest.raises(SandboxNotRunningException) as raised:
                handle.wait()
            assert time.monotonic() - stopped_at[0] < 5
            assert "was killed or reached its end of life" in str(raised.value) or (
                "was not found" in str(raised.value)
            )
            with pytest.raises(SandboxNotRunningException):
                sbx.commands.run("true")
        finally:
            with contextlib.suppress(Exception):
                sbx.kill()


def test_signed_urls_through_the_sdk(hard_node: NodeProcess) -> None:
    from e2b import Sandbox

    with sdk_env(hard_node):
        sbx = Sandbox.create(timeout=120)
    try:
        assert sbx.sandbox_domain == f"localhost:{hard_node.port}"
        assert sbx.get_host(8080) == f"8080-{sbx.sandbox_id}.localhost:{hard_node.port}"
        sbx.files.write("/tmp/signed.txt", "signed content")
        with httpx.Client(timeout=30, trust_env=False) as client:
            for expiration in (None, 60):
                url = sbx.download_url("/tmp/signed.txt", use_signature_expiration=expiration)
                assert url.startswith(hard_node.url + "/files?")
                assert "signature=" in url and sbx.sandbox_id not in url
                got = client.get(url)
                assert got.status_code == 200, got.text
                assert got.text == "signed content"
                # the same URL by host, as E2B serves it ({port}-{id}.{domain})
                by_host = client.get(url, headers={"Host": sbx.get_host(49983)})
                assert by_host.text == "signed content"
                upload = sbx.upload_url(
                    f"/tmp/up{expiration}.txt", use_signature_expiration=expiration
                )
                sent = client.post(upload, files={"file": ("x", b"uploaded bytes")})
                assert sent.status_code == 200, sent.text
                assert sbx.files.read(f"/tmp/up{expiration}.txt") == "uploaded bytes"
            expired = client.get(sbx.download_url("/tmp/signed.txt", use_signature_expiration=-10))
            assert expired.status_code == 401
            assert expired.json() == {"code": 401, "message": "signature is already expired"}
            url = sbx.download_url("/tmp/signed.txt")
            forged = client.get(url.replace("signature=v1_", "signature=v1_A"))
            assert forged.json() == {"code": 401, "message": "invalid signature"}
            read_only = sbx.download_url("/tmp/signed.txt")  # a read signature opens no write
            assert client.post(read_only, files={"file": ("x", b"no")}).status_code == 401
            forged_host = client.get(
                url.replace("signature=v1_", "signature=v1_A"),
                headers={"Host": sbx.get_host(49983)},
            )
            assert forged_host.json()["message"] == "invalid signature"
    finally:
        sbx.kill()


def test_auto_resume_by_host_route_needs_the_token(
    api: httpx.Client, hard_node: NodeProcess, listeners: dict[str, _Recorder]
) -> None:
    from e2b import Sandbox

    port = listeners["port"].server_address[1]
    created = api.post(
        "/v2/sandboxes",
        json={
            "templateID": "base",
            "timeout": 120,
            "autoPause": True,
            "autoResume": {"enabled": True},
            "network": {"allowPublicTraffic": False},
        },
    ).json()
    sid, traffic = created["sandboxID"], created["trafficAccessToken"]
    domain = created["domain"]
    assert domain == f"localhost:{hard_node.port}"

    def state() -> str:
        return str(api.get(f"/sandboxes/{sid}").json()["state"])

    try:
        with httpx.Client(base_url=hard_node.url, timeout=60, trust_env=False) as client:
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
            user_port = {"Host": f"{port}-{sid}.{domain}"}
            assert client.get("/page", headers=user_port).status_code == 403
            envd_port = {"Host": f"49983-{sid}.{domain}"}
            assert client.get("/health", headers=envd_port).status_code == 401
            assert state() == "paused"
            resumed = client.get(
                "/page", headers={**user_port, "e2b-traffic-access-token": traffic}
            )
            assert resumed.status_code == 200 and resumed.text == "ok"
            assert state() == "running"
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
            token = {"X-Access-Token": created["envdAccessToken"]}
            assert client.get("/health", headers={**envd_port, **token}).status_code == 204
            assert state() == "running"
        with sdk_env(hard_node):
            sbx = Sandbox.connect(sid)
            assert sbx.commands.run("echo back").stdout == "back\n"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_limits_from_the_environment() -> None:
    from agentenv.errors import AgentEnvError
    from agentenv.node.proxy import ProxyLimits

    limits = ProxyLimits.from_env(
        {"AENV_PROXY_MAX_CONNECTIONS": "7", "AENV_PROXY_IDLE_TIMEOUT": "2.5"}
    )
    assert limits.max_connections == 7 and limits.idle_timeout == 2.5
    with pytest.raises(AgentEnvError, match="AENV_PROXY_MAX_BODY_BYTES"):
        ProxyLimits.from_env({"AENV_PROXY_MAX_BODY_BYTES": "lots"})
    with pytest.raises(AgentEnvError, match="must be positive"):
        ProxyLimits.from_env({"AENV_PROXY_MAX_CONNECTIONS": "0"})


def test_serve_domain_is_checked(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from agentenv.cli.main import cli

    for bad in ("http://sandbox.test/", "a b", "host:port"):
        result = CliRunner().invoke(cli, ["serve", "--state-dir", str(tmp_path), "--domain", bad])
        assert result.exit_code == 2 and "host name with an optional port" in result.output
    env = {"AENV_DOMAIN": "bad/domain"}
    result = CliRunner().invoke(cli, ["serve", "--state-dir", str(tmp_path)], env=env)
    assert result.exit_code == 2 and "bad/domain" in result.output
