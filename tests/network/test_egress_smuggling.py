"""Requests smuggled past the egress proxy's decision by name on plain HTTP, in the network lab
(tests/network/lab.py): a pipelined second request for a denied host, a declined Upgrade
followed by a request the proxy would have passed raw, a CONNECT whose target is not its Host;
and a real Upgrade (the server answers 101) to an allowed host still works. Root."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import pytest

from tests.network.lab import INET_SERVER, Lab, http_get, read_response
from tests.network.test_egress_proxy import assert_reset

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)")

ALLOWED, DENIED = "example-allowed.test", "example-denied.test"
ONLY_ALLOWED = {"denyOut": ["0.0.0.0/0"], "allowOut": [ALLOWED]}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with Lab(tmp_path_factory.mktemp("smuggling"), slots=1, prefix="epsm", port=15003,
             tls=False) as lab:
        lab.set_policy(lab.slots[0], ONLY_ALLOWED)
        yield lab


def _hosts_seen(body: bytes) -> list[str]:
    return [v for k, v in json.loads(body)["headers"] if k.lower() == "host"]


def _rest_of_connection(sock: socket.socket) -> bytes:
    """What the server sends until the connection ends (a reset raises)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_pipelined_request_for_a_denied_host_is_refused(lab: Lab) -> None:
    with lab.connect(lab.slots[0], INET_SERVER, 80) as sock:
        sock.sendall(f"GET /1 HTTP/1.1\r\nHost: {ALLOWED}\r\n\r\n"
                     f"GET /2 HTTP/1.1\r\nHost: {DENIED}\r\n\r\n".encode())
        assert_reset(lambda: _rest_of_connection(sock))


def test_a_declined_upgrade_does_not_open_a_raw_path(lab: Lab) -> None:
    """An Upgrade the server declines (200), then a request line the proxy cannot parse but
    the server can (tabs between its words): before, the proxy took those bytes for the new
    protocol and passed them, and the server answered a request for the denied host."""
    with lab.connect(lab.slots[0], INET_SERVER, 80) as sock:
        status, _, body = http_get(sock, ALLOWED, "/ws", {"Upgrade": "websocket",
                                                          "Connection": "Upgrade"})
        assert status == 200 and _hosts_seen(body) == [ALLOWED]  # declined

        def smuggle() -> None:
            sock.sendall(f"GET\t/x\tHTTP/1.1\r\nHost: {DENIED}\r\n\r\n".encode())
            _, _, answer = read_response(sock)
            raise AssertionError(f"the server answered a smuggled request: {answer[:200]!r}")

        assert_reset(smuggle)


def test_bytes_sent_before_the_servers_answer_wait_for_it(lab: Lab) -> None:
    """The client does not wait for the answer to its Upgrade: its next bytes are held until
    the server declines, then read as a request (and decided): a denied host is refused."""
    with lab.connect(lab.slots[0], INET_SERVER, 80) as sock:
        sock.sendall(f"GET /ws HTTP/1.1\r\nHost: {ALLOWED}\r\nUpgrade: x\r\n\r\n"
                     f"GET /2 HTTP/1.1\r\nHost: {DENIED}\r\n\r\n".encode())
        assert_reset(lambda: _rest_of_connection(sock))
    with lab.connect(lab.slots[0], INET_SERVER, 80) as sock:
        sock.sendall(f"GET /ws HTTP/1.1\r\nHost: {ALLOWED}\r\nUpgrade: x\r\n\r\n"
                     f"GET /2 HTTP/1.1\r\nHost: {ALLOWED}\r\nConnection: close\r\n\r\n"
                     .encode())
        answers = _rest_of_connection(sock)
        assert answers.count(b"HTTP/1.1 200 ") == 2, answers
        assert b'"path": "/ws"' in answers and b'"path": "/2"' in answers


def test_connect_to_another_target_than_its_host_is_refused(lab: Lab) -> None:
    with lab.connect(lab.slots[0], INET_SERVER, 80) as sock:
        sock.sendall(f"CONNECT {DENIED}:443 HTTP/1.1\r\nHost: {ALLOWED}\r\n\r\n".encode())
        assert_reset(lambda: _rest_of_connection(sock))


def test_an_upgrade_the_server_accepts_still_works(lab: Lab) -> None:
    with lab.connect(lab.slots[0], INET_SERVER, 80) as sock:
        sock.sendall(f"GET /echo HTTP/1.1\r\nHost: {ALLOWED}\r\nUpgrade: echo\r\n"
                     "Connection: Upgrade\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
        # The new protocol: bytes that are no HTTP, then some that look like it, echoed.
        for payload in (b"\x81\x85\x37\xfa\x21\x3d\x7f", f"GET / HTTP/1.1\r\nHost: {DENIED}\r\n\r\n"
                        .encode()):
            sock.sendall(payload)
            got = b""
            while len(got) < len(payload):
                chunk = sock.recv(65536)
                assert chunk, "closed"
                got += chunk
            assert got == payload


def test_an_upgrade_to_h2c_is_taken_out(lab: Lab) -> None:
    """After a switch to HTTP/2 in clear text the client could ask for any host in frames the
    proxy does not read: the offer is removed, the server answers in HTTP/1.1."""
    with lab.connect(lab.slots[0], INET_SERVER, 80) as sock:
        status, _, body = http_get(sock, ALLOWED, "/", {
            "Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c",
            "HTTP2-Settings": "AAMAAABkAARAAAAAAAIAAAAA"})
        assert status == 200
        seen = {k.lower() for k, _ in json.loads(body)["headers"]}
        assert "upgrade" not in seen and "http2-settings" not in seen, seen
        assert http_get(sock, ALLOWED, "/again")[0] == 200  # still HTTP/1.1, still read
