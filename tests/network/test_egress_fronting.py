"""Attacks on name filtering, in the network lab (tests/network/lab.py): a name is let out only
to the addresses it resolves to on the node (the proxy's /etc/hosts is the lab's); the DNS
servers a policy opens are open on port 53 only; a connection whose name cannot be read
(TLS without SNI, HTTP without Host, QUIC) follows the unnamed rule; a slot has no IPv6; one
slot's idle connections leave capacity to the others and to the metadata service.
Needs root (namespaces, nftables)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import ssl
import struct
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from agentenv.network import dns
from agentenv.network.policy import EgressPolicy
from tests.network.lab import (
    INET_HOST,
    INET_OTHER,
    INET_SERVER,
    LAB_RESOLVER,
    Lab,
    http_get,
    in_netns,
    read_response,
    serve,
    socket_in,
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

DENY_NAME = {"denyOut": [DENIED]}
MAX_CONNECTIONS = 30  # 3 slots: a fair share of 10 each


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    tmp = tmp_path_factory.mktemp("fronting")
    args = ("--max-connections", str(MAX_CONNECTIONS), "--max-per-slot", "1000",
            "--dns-upstream", f"{INET_OTHER}:53",
            "--log-burst", "100000")  # the tests read the refusals' lines: every one written
    with Lab(tmp, slots=3, proxy_args=args) as lab:
        lab.servers.append(serve(lab.inet, INET_OTHER, 53))  # a "DNS server" speaking HTTP on TCP
        upstream = _dns_upstream(lab)
        try:
            yield lab
        finally:
            upstream.close()


def _dns_upstream(lab: Lab) -> socket.socket:
    """The upstream resolver, UDP on 198.18.0.4:53: every name is 198.18.0.2."""
    sock = socket_in(lab.inet, type_=socket.SOCK_DGRAM)
    sock.bind((INET_OTHER, 53))

    def answer() -> None:
        while True:
            try:
                query, peer = sock.recvfrom(4096)
            except OSError:
                return
            question = dns.parse_query(query)
            head = struct.pack("!HHHHHH", question.id, 0x8180, 1, 1, 0, 0)
            record = struct.pack("!HHHIH", 0xC00C, 1, 1, 60, 4) + socket.inet_aton(INET_SERVER)
            sock.sendto(head + query[12:question.end] + record, peer)

    threading.Thread(target=answer, daemon=True).start()
    return sock


def _query(name: str, qid: int = 0x1234) -> bytes:
    labels = b"".join(bytes([len(part)]) + part.encode() for part in name.split("."))
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", 1, 1)


def _ask_udp(lab: Lab, slot: Any, name: str) -> tuple[int, bytes]:
    """(RCODE, the answer) of one query to 169.254.169.254:53 from the slot."""
    sock = socket_in(lab.guest_ns(slot), type_=socket.SOCK_DGRAM)
    sock.settimeout(10)
    try:
        sock.connect(("169.254.169.254", 53))
        sock.send(_query(name))
        answer = sock.recv(4096)
    finally:
        sock.close()
    assert answer[:2] == b"\x12\x34"
    return answer[3] & 0xF, answer


def _ask_tcp(lab: Lab, slot: Any, name: str) -> int:
    with lab.connect(slot, "169.254.169.254", 53) as sock:
        query = _query(name)
        sock.sendall(struct.pack("!H", len(query)) + query)
        length = struct.unpack("!H", sock.recv(2))[0]
        answer = b""
        while len(answer) < length:
            answer += sock.recv(length - len(answer))
    return answer[3] & 0xF


def test_filtering_resolver_answers_only_allowed_names(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, ONLY_ALLOWED)
    rcode, answer = _ask_udp(lab, slot, ALLOWED)
    assert rcode == 0 and socket.inet_aton(INET_SERVER) in answer  # forwarded, answered
    assert _ask_udp(lab, slot, "tunnel-data-0123.attacker.test")[0] == dns.RCODE_REFUSED
    assert _ask_tcp(lab, slot, ALLOWED) == 0
    assert _ask_tcp(lab, slot, "tunnel-data-0123.attacker.test") == dns.RCODE_REFUSED
    lab.set_policy(slot, DENY_NAME)  # a deny-list: everything but the denied names
    assert _ask_udp(lab, slot, "anything.test")[0] == 0
    assert _ask_udp(lab, slot, DENIED)[0] == dns.RCODE_REFUSED
    refused = [line for line in lab.proxy_log() if line.get("event") == "dns_refused"]
    assert refused[-1]["qname"] == DENIED and refused[-1]["reason"] == "name not allowed by the policy"
    lab.set_policy(slot, {})


def denials(lab: Lab) -> list[dict[str, Any]]:
    return [line for line in lab.proxy_log() if line.get("event") == "denied"]


def no_sni_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def test_allowed_name_at_another_address_is_refused_tls(lab: Lab) -> None:
    """`curl --resolve allowed:443:ANY_IP`: the SNI is allowed, the address is not its own."""
    slot = lab.slots[0]
    lab.set_policy(slot, ONLY_ALLOWED)
    before = counters(lab).get("denied_name_address", 0)
    assert_reset(lambda: lab.tls(slot, ALLOWED, address=INET_OTHER))
    with lab.tls(slot, ALLOWED) as tls:  # the name's real address: allowed
        assert http_get(tls, ALLOWED, "/")[0] == 200
    assert counters(lab)["denied_name_address"] == before + 1
    line = denials(lab)[-1]
    assert line["dst"] == f"{INET_OTHER}:443" and line["host"] == ALLOWED
    assert line["answers"] == [INET_SERVER] and f"resolves here to {INET_SERVER}" in line["reason"]


def test_allowed_host_at_another_address_is_refused_http(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, ONLY_ALLOWED)
    with lab.connect(slot, INET_OTHER, 80) as sock:
        assert_reset(lambda: http_get(sock, ALLOWED, "/"))
    with lab.connect(slot, INET_SERVER, 80) as sock:
        assert http_get(sock, ALLOWED, "/")[0] == 200
    assert f"{ALLOWED} resolves here to {INET_SERVER}, not to {INET_OTHER}" \
        in denials(lab)[-1]["reason"]


def test_innocent_name_cannot_front_for_a_deny_list(lab: Lab) -> None:
    """With names in denyOut, a name not denied is still believed only where it points: an
    unresolvable or foreign name cannot carry the guest to any address."""
    slot = lab.slots[0]
    lab.set_policy(slot, DENY_NAME)
    assert_reset(lambda: lab.tls(slot, ALLOWED, address=INET_OTHER))
    with lab.connect(slot, INET_OTHER, 80) as sock:
        assert_reset(lambda: http_get(sock, "unknown-name.test", "/"))
    with lab.tls(slot, ALLOWED) as tls:
        assert http_get(tls, ALLOWED, "/")[0] == 200
    assert_reset(lambda: lab.tls(slot, DENIED))
    # An address as the Host is its own answer (as getaddrinfo has it): true, or refused.
    with lab.connect(slot, INET_OTHER, 80) as sock:
        assert http_get(sock, INET_OTHER, "/")[0] == 200
    with lab.connect(slot, INET_OTHER, 80) as sock:
        assert_reset(lambda: http_get(sock, INET_SERVER, "/"))


def test_dns_servers_are_open_on_port_53_only(lab: Lab) -> None:
    """The resolver a policy opens (here 198.18.0.4) is not a way out on 80/443 or any port."""
    slot = lab.slots[0]
    policy = {**ONLY_ALLOWED, "dnsServers": [INET_OTHER]}
    lab.set_policy(slot, policy)
    with lab.connect(slot, INET_OTHER, 80) as sock:
        assert_reset(lambda: http_get(sock, DENIED, "/"))
    assert_reset(lambda: lab.tls(slot, DENIED, address=INET_OTHER))
    lab.set_policy(slot, policy, mode="all")  # every TCP port through the proxy
    with lab.connect(slot, INET_OTHER, 53) as sock:  # port 53 stays open
        assert http_get(sock, "dns", "/")[0] == 200
    lab.set_policy(slot, {})


def test_tls_without_sni_follows_the_deny_list(lab: Lab) -> None:
    """No SNI cannot dodge a denied name: with names in denyOut, a connection whose name cannot
    be read is refused unless its address is allowed."""
    slot = lab.slots[0]
    lab.set_policy(slot, DENY_NAME)
    before = counters(lab).get("denied_unnamed", 0)

    def no_sni() -> None:
        raw = lab.connect(slot, INET_SERVER, 443)
        with no_sni_context().wrap_socket(raw) as tls:  # server_hostname None: no SNI
            http_get(tls, DENIED, "/")

    assert_reset(no_sni)
    with lab.connect(slot, INET_SERVER, 80) as sock:  # HTTP/1.0 without a Host
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert_reset(lambda: read_response(sock))
    assert counters(lab)["denied_unnamed"] == before + 2
    # An address in allowOut is allowed whatever its name.
    lab.set_policy(slot, {"denyOut": [DENIED], "allowOut": [INET_SERVER]})
    with no_sni_context().wrap_socket(lab.connect(slot, INET_SERVER, 443)) as tls:
        assert http_get(tls, ALLOWED, "/")[0] == 200
    lab.set_policy(slot, {})


def _udp_echo(lab: Lab, address: str, port: int) -> socket.socket:
    sock = socket_in(lab.inet, type_=socket.SOCK_DGRAM)
    sock.bind((address, port))

    def echo() -> None:
        while True:
            try:
                data, peer = sock.recvfrom(2048)
                sock.sendto(data, peer)
            except OSError:
                return

    threading.Thread(target=echo, daemon=True).start()
    return sock


def _udp_answered(lab: Lab, netns: str, address: str, port: int) -> bool | None:
    """One datagram out: its echo back (True), a refusal by the slot (ICMP admin-prohibited:
    False), or the port unreachable at the server (it got out, nothing listens: None)."""
    sock = socket_in(netns, type_=socket.SOCK_DGRAM)
    sock.settimeout(10)
    try:
        sock.connect((address, port))
        sock.send(b"quic?")
        return sock.recv(2048) == b"quic?"
    except ConnectionRefusedError:  # ICMP port unreachable
        return None
    except OSError as exc:
        if exc.errno == errno.EACCES or exc.errno == errno.EHOSTUNREACH:
            return False
        raise
    finally:
        sock.close()


@pytest.fixture
def guest(lab: Lab) -> str:
    """The third slot's guest namespace (Lab.wire_guest)."""
    return lab.guest_ns(lab.slots[2])


def test_quic_follows_the_deny_list(lab: Lab, guest: str) -> None:
    slot = lab.slots[2]
    echo = _udp_echo(lab, INET_SERVER, 443)
    try:
        assert _udp_answered(lab, guest, INET_SERVER, 443) is True  # default policy: passes
        lab.loop.run_until_complete(slot.set_policy(EgressPolicy.from_wire(DENY_NAME)))
        assert _udp_answered(lab, guest, INET_SERVER, 443) is False  # refused by the slot
        assert _udp_answered(lab, guest, INET_SERVER, 443 + 1) is None  # other ports: by address
        lab.loop.run_until_complete(slot.set_policy(EgressPolicy.from_wire(
            {"denyOut": [DENIED], "allowOut": [INET_SERVER]})))
        assert _udp_answered(lab, guest, INET_SERVER, 443) is True  # allowed by address
    finally:
        lab.loop.run_until_complete(slot.set_policy(EgressPolicy()))
        echo.close()


def _ping(netns: str, address: str) -> int:
    """The ICMP type of the first answer to one echo request (0: a reply; 3: unreachable)."""
    body = struct.pack("!BBHHH", 8, 0, 0, 0x4145, 1) + b"aenv"
    total = sum(struct.unpack(f"!{len(body) // 2}H", body))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    packet = body[:2] + struct.pack("!H", ~total & 0xFFFF) + body[4:]
    sock = in_netns(netns, lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW,
                                                 socket.IPPROTO_ICMP))
    sock.settimeout(10)
    try:
        sock.sendto(packet, (address, 0))
        while True:
            reply = sock.recv(2048)
            icmp = reply[(reply[0] & 0xF) * 4:]
            if icmp[0] != 8:  # our own request, seen on the way out
                return icmp[0]
    finally:
        sock.close()


def test_nothing_leaves_beside_a_socks5_tunnel(lab: Lab, guest: str) -> None:
    """With an egressProxy every TCP connection goes through the tunnel; UDP (but DNS) and
    ICMP must not leave beside it, directly."""
    slot = lab.slots[2]
    echo = _udp_echo(lab, INET_SERVER, 4433)
    tunnel = {"egressProxy": {"address": "198.18.0.3:1080"}}
    try:
        assert _udp_answered(lab, guest, INET_SERVER, 4433) is True  # default policy: passes
        lab.loop.run_until_complete(slot.set_policy(EgressPolicy.from_wire(tunnel)))
        assert _udp_answered(lab, guest, INET_SERVER, 4433) is False  # refused by the slot
        assert _udp_answered(lab, guest, INET_SERVER, 53) is None  # DNS: by the policy
        assert _ping(guest, INET_SERVER) == 3  # ICMP: destination unreachable, not a reply
    finally:
        lab.loop.run_until_complete(slot.set_policy(EgressPolicy()))
        echo.close()


def test_slot_has_no_ipv6(lab: Lab) -> None:
    ns = lab.slots[0].netns_name
    for dev in ("all", "default", "lo", "vpeer", "tap0"):
        out = subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-n",
                              f"net.ipv6.conf.{dev}.disable_ipv6"],
                             capture_output=True, text=True, check=True).stdout
        assert out.strip() == "1", dev
    addresses = subprocess.run(["ip", "-n", ns, "-6", "addr", "show"], capture_output=True,
                               text=True, check=True).stdout
    assert addresses.strip() == ""  # not even link-local
    assert not asyncio.run(asyncio.to_thread(
        lambda: _ipv6_socket_works(ns)))


def _ipv6_socket_works(ns: str) -> bool:
    try:
        sock = socket_in(ns, socket.AF_INET6, socket.SOCK_DGRAM)
    except OSError:
        return False
    try:
        sock.connect(("fe80::1%vpeer", 9))
        return True
    except OSError:
        return False
    finally:
        sock.close()


def test_idle_connections_of_one_slot_leave_room_for_the_others(lab: Lab) -> None:
    """Slot A holds every egress connection it can and leaves them idle: it gets its share
    (max_connections / slots), slot B still goes out, and A's metadata still answers."""
    hog, other = lab.slots[1], lab.slots[0]
    for slot in lab.slots:
        lab.set_policy(slot, {}, mode="all")
    wait_for(lambda: counters(lab)["connections"] == 0)
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS + 5):
            try:
                sock = lab.connect(hog, INET_SERVER, 80)
                http_get(sock, ALLOWED, "/")  # connected through: counted by the proxy
            except (ConnectionError, OSError):
                break
            held.append(sock)
        assert len(held) < MAX_CONNECTIONS
        with lab.connect(other, INET_SERVER, 80) as sock:
            assert http_get(sock, ALLOWED, "/")[0] == 200
        with lab.connect(hog, "169.254.169.254", 80) as sock:
            assert http_get(sock, "169.254.169.254", "/")[0] == 200
        assert len(held) == counters(lab)["slot_share"] == MAX_CONNECTIONS // len(lab.slots)
    finally:
        for sock in held:
            sock.close()
        for slot in lab.slots:
            lab.set_policy(slot, {})


def _client_hello(name: str) -> bytes:
    """The first flight of a TLS client for `name` (a ClientHello with that SNI)."""
    out = ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(ssl.MemoryBIO(), out, server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


def test_a_slot_spraying_names_cannot_stall_the_others_lookups(lab: Lab) -> None:
    """With a resolver that never answers, a slot sending a new SNI per connection gets a few
    lookups in flight and the rest refused at once; another slot's names still resolve."""
    spraying, other = lab.slots[0], lab.slots[1]
    lab.set_policy(spraying, DENY_NAME)  # every name not denied is looked up (bound)
    lab.set_policy(other, DENY_NAME)
    black_hole = socket_in(lab.inet, type_=socket.SOCK_DGRAM)
    black_hole.bind((LAB_RESOLVER, 53))  # receives the lookups, answers none
    held: list[socket.socket] = []
    try:
        before = counters(lab)["over_capacity"]
        for i in range(30):
            sock = lab.connect(spraying, INET_SERVER, 443)
            sock.sendall(_client_hello(f"spray-{i}.example-sprayed.test"))
            held.append(sock)
        wait_for(lambda: counters(lab)["over_capacity"] >= before + 10, timeout=30)
        with lab.tls(other, ALLOWED) as tls:  # in the hosts file: answered at once
            assert http_get(tls, ALLOWED, "/")[0] == 200
        assert "too many name lookups in flight for this sandbox" in \
            [line["reason"] for line in denials(lab)]
    finally:
        for sock in held:
            sock.close()
        black_hole.close()
        lab.set_policy(spraying, {})
        lab.set_policy(other, {})


def test_a_stranger_gets_no_dns_answer_from_the_proxy_port(lab: Lab) -> None:
    """Found by the red team (finding 6): the resolver's UDP side listens on every address, so
    anyone on the node's network got an answer (a REFUSED one: a reflector for spoofed
    sources). The host table drops what no redirect sent to the proxy's port."""
    sock = socket_in(lab.inet, type_=socket.SOCK_DGRAM)
    sock.settimeout(2)
    try:
        sock.sendto(_query(ALLOWED), (INET_HOST, lab.port))
        with pytest.raises(TimeoutError):
            sock.recv(4096)
    finally:
        sock.close()
    lab.set_policy(lab.slots[0], ONLY_ALLOWED)  # a guest's redirected query is answered
    assert _ask_udp(lab, lab.slots[0], ALLOWED)[0] == 0
