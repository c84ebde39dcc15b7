"""The egress proxy under awkward clients: uploads through the HTTP framer, half-closes,
garbage, silent clients (peek timeout), idle connections, many connections at once. A lab of
its own with short timeouts. Needs root; run it under scripts/isolated.sh."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from agentenv.network import egress
from tests.network.lab import (
    INET_OTHER,
    INET_SERVER,
    OTHER_PORT,
    Lab,
    blob,
    http_get,
    in_netns,
    read_response,
)
from tests.network.test_egress_proxy import (
    ALLOWED,
    DENIED,
    ONLY_ALLOWED,
    assert_reset,
    counters,
    wait_for,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)")

IDLE, PEEK = 2.0, 1.0
DENY_NAME = {"denyOut": [DENIED]}  # names matter: 80/443 redirected, everything else allowed
ADDRESS_ALLOWED = {"denyOut": [DENIED], "allowOut": [INET_SERVER]}  # whatever the name


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    tmp = tmp_path_factory.mktemp("egress-robust")
    args = ("--idle-timeout", str(IDLE), "--peek-timeout", str(PEEK))
    with Lab(tmp, slots=2, prefix="eprobust", port=15011, proxy_args=args) as lab:
        yield lab


def post(sock: socket.socket, host: str, body: bytes, chunked: bool = False,
         step: int = 1 << 20) -> dict[str, object]:
    if chunked:
        head = f"POST /up HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head.encode())
        for i in range(0, len(body), step):
            part = body[i:i + step]
            sock.sendall(f"{len(part):x};x=1\r\n".encode() + part + b"\r\n")
        sock.sendall(b"0\r\nX-Trailer: 1\r\n\r\n")
    else:
        sock.sendall(f"POST /up HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)
    status, _, answer = read_response(sock)
    assert status == 200
    return json.loads(answer)  # type: ignore[no-any-return]


def test_uploads_pass_the_http_framer_unchanged(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, ONLY_ALLOWED)
    body = blob(6 << 20)[::-1]
    digest = hashlib.sha256(body).hexdigest()
    with lab.connect(slot, INET_SERVER, 80) as sock:
        for chunked in (False, True, False):  # one kept-alive connection, framed each time
            seen = post(sock, ALLOWED, body, chunked=chunked, step=100_003)
            assert (seen["length"], seen["sha256"]) == (len(body), digest)
        # The framer found every request's end: the next head is still read and decided.
        assert_reset(lambda: http_get(sock, DENIED, "/"))


def test_half_close_is_passed_on(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, DENY_NAME)
    with lab.connect(slot, INET_SERVER, 80) as sock:
        sock.sendall(f"GET /blob?size=3000000 HTTP/1.1\r\nHost: {ALLOWED}\r\n"
                     "Connection: close\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)  # the server still answers in full, then closes
        status, _, body = read_response(sock)
        assert status == 200 and body == blob(3_000_000)
        assert sock.recv(1) == b""
    wait_for(lambda: counters(lab)["connections"] == 0)


def test_garbage_on_web_ports_is_decided_as_unnamed(lab: Lab) -> None:
    """Bytes that carry no name pass only where every name would (policy.allows_unnamed)."""
    slot = lab.slots[0]
    junk = bytes(range(256)) * 4
    lab.set_policy(slot, ADDRESS_ALLOWED)  # the address allowed: opaque bytes pass
    with lab.connect(slot, INET_SERVER, 80) as sock:
        sock.sendall(junk)
        answer = sock.recv(4096)
        assert b"400" in answer  # the real server's verdict on the junk: it got there
    for policy in (DENY_NAME, ONLY_ALLOWED):  # a name could be denied / the address is: reset
        lab.set_policy(slot, policy)
        with lab.connect(slot, INET_SERVER, 80) as sock:
            sock.sendall(junk)
            assert_reset(lambda: sock.recv(1024) or (_ for _ in ()).throw(ConnectionError("eof")))
    lab.set_policy(slot, ONLY_ALLOWED)
    with lab.connect(slot, INET_SERVER, 80) as sock:
        sock.sendall(junk)
        assert_reset(lambda: sock.recv(1024) or (_ for _ in ()).throw(ConnectionError("eof")))
    # A TLS record that is not a valid ClientHello is refused, whatever the policy.
    lab.set_policy(slot, DENY_NAME)
    with lab.connect(slot, INET_SERVER, 443) as sock:
        sock.sendall(b"\x16\x03\x01\x00\x10" + b"\x02" * 16)
        assert_reset(lambda: sock.recv(1024) or (_ for _ in ()).throw(ConnectionError("eof")))


def test_silent_client_is_decided_as_unnamed_after_the_peek_timeout(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, ADDRESS_ALLOWED)
    with lab.connect(slot, INET_SERVER, 80) as sock:
        time.sleep(PEEK + 0.5)  # nothing sent: no name, the address allowed, then spliced
        assert http_get(sock, ALLOWED, "/late")[0] == 200
    lab.set_policy(slot, ONLY_ALLOWED)
    with lab.connect(slot, INET_SERVER, 80) as sock:
        started = time.monotonic()
        sock.sendall(b"GET / HTTP/1.1\r\nHost: exam")  # a head that never ends
        assert_reset(lambda: sock.recv(1024))
        assert PEEK - 0.2 < time.monotonic() - started < PEEK + 3


def test_idle_connections_are_closed(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, {}, mode="all")
    before = counters(lab)["idle_closed"]
    with lab.connect(slot, INET_SERVER, OTHER_PORT) as busy, \
            lab.connect(slot, INET_SERVER, OTHER_PORT) as idle:
        assert http_get(idle, ALLOWED, "/")[0] == 200
        deadline = time.monotonic() + IDLE * 2.5
        while time.monotonic() < deadline:  # one keeps talking, the other says nothing
            assert http_get(busy, ALLOWED, "/")[0] == 200
            time.sleep(0.2)
        assert_reset(lambda: http_get(idle, ALLOWED, "/"))
    assert counters(lab)["idle_closed"] == before + 1
    lab.set_policy(slot, {})


def test_many_connections_at_once(lab: Lab) -> None:
    slots = lab.slots
    for slot in slots:
        lab.set_policy(slot, DENY_NAME)
    errors: list[BaseException] = []

    def client(slot: object, n: int) -> None:
        try:
            with lab.tls(slot, ALLOWED) as tls:  # type: ignore[arg-type]
                status, _, body = http_get(tls, ALLOWED, f"/blob?size={n * 1000}")
                assert status == 200 and body == blob(n * 1000)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(slots[i % 2], i)) for i in range(120)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[:3]
    wait_for(lambda: counters(lab)["connections"] == 0)


def _refused_with_long_names(count: int) -> None:
    host = ("a" * 60 + ".") * 4 + "evil.test"  # 253 characters, in each refusal's line
    request = f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    for _ in range(count):
        try:
            with socket.create_connection((INET_OTHER, 80), timeout=10) as sock:
                sock.sendall(request)
                sock.recv(1)
        except OSError:
            pass  # reset: refused


def test_a_flood_of_refusals_is_logged_within_limits(lab: Lab) -> None:
    slot = lab.slots[1]
    lab.set_policy(slot, ONLY_ALLOWED)
    log_path = lab.tmp / "egress.log"
    start, denied = log_path.stat().st_size, counters(lab)["denied"]
    in_netns(lab.guest_ns(slot), lambda: _refused_with_long_names(1000))
    wait_for(lambda: counters(lab)["denied"] == denied + 1000, timeout=60)  # each counted
    with log_path.open("rb") as f:
        f.seek(start)
        lines = [json.loads(line) for line in f.read().splitlines()]
    # Only the slot's first lines of the window are written whole (the rest go into a
    # summary when the window is over): not a line per refusal.
    assert len([line for line in lines if line.get("source") == slot.guest_address]) \
        <= egress.LOG_BURST
    lab.set_policy(slot, {})


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_descriptor_exhaustion_pauses_accepting_and_recovers(lab: Lab) -> None:
    assert lab.proxy is not None and lab.proxy.pid is not None
    pid = lab.proxy.pid
    slot = lab.slots[1]
    lab.set_policy(slot, {})
    wait_for(lambda: counters(lab)["connections"] == 0)
    client = lab.client()  # connected before: a new control connection would need a descriptor

    def connections() -> int:
        return int(lab.loop.run_until_complete(client.ping())["connections"])

    assert connections() == 0
    with open(f"/proc/{pid}/limits") as f:
        soft = next(line.split()[3] for line in f if line.startswith("Max open files"))
    limit = len(os.listdir(f"/proc/{pid}/fd")) + 10
    subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={limit}:"], check=True)  # soft only
    socks = []
    try:
        socks = [lab.connect(slot, "169.254.169.254", 80) for _ in range(30)]
        wait_for(lambda: connections() >= 9)
        before = _cpu_seconds(pid)
        time.sleep(1.0)
        assert _cpu_seconds(pid) - before < 0.3  # waiting for descriptors, not spinning
        for sock in socks[:25]:
            sock.close()
        # The queued connections get their turn as descriptors come back.
        for sock in socks[25:]:
            assert http_get(sock, "169.254.169.254", "/v1/identity/sandboxId")[0] == 200
    finally:
        for sock in socks:
            sock.close()
        subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={soft}:"], check=True)
        lab.loop.run_until_complete(client.close())
    with lab.connect(slot, "169.254.169.254", 80) as sock:
        assert http_get(sock, "169.254.169.254", "/")[0] == 200
    assert any(line.get("event") == "accept_failed" for line in lab.proxy_log())
