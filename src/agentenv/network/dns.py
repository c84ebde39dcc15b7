"""The node-side filtering resolver: DNS at 169.254.169.254:53 (UDP and TCP) that answers only
the names a sandbox's policy lets it reach (EgressPolicy.resolves), forwarding those queries
to the node's upstream resolver and refusing the rest (RCODE REFUSED).

Why: opening a DNS server to a guest (`dnsServers`, or the default 8.8.8.8 when `allowOut`
names a domain) opens a channel through that resolver to every authoritative server on the
internet (DNS tunnelling). A guest whose resolver is this one (the node's `guest_dns` set to
169.254.169.254) can ask only for names its policy allows, so that channel is limited to the
allowed domains' own servers.

Only the question is read (one question, no compression in it: what every stub resolver
sends); the answer is passed back unchanged. The egress proxy process serves it
(egress/resolver.py): UDP on its port, TCP through its redirected connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass

DNS_PORT = 53
HEADER = struct.Struct("!HHHHHH")
RCODE_FORMERR, RCODE_SERVFAIL, RCODE_REFUSED = 1, 2, 5
UPSTREAM_TIMEOUT = 5.0
MAX_MESSAGE = 4096  # a query larger than this is not a stub resolver's


class DnsFormatError(ValueError):
    """Not a DNS query this resolver reads (the message says what is wrong)."""


@dataclass(frozen=True)
class Question:
    id: int
    name: str  # lower case, no trailing dot
    qtype: int
    end: int  # offset just past the question section


def parse_query(message: bytes) -> Question:
    if len(message) < HEADER.size:
        raise DnsFormatError("shorter than a DNS header")
    if len(message) > MAX_MESSAGE:
        raise DnsFormatError(f"larger than {MAX_MESSAGE} bytes")
    qid, flags, qdcount, _, _, _ = HEADER.unpack_from(message)
    if flags & 0x8000:
        raise DnsFormatError("a response, not a query")
    if (flags >> 11) & 0xF != 0:
        raise DnsFormatError("not a standard query")
    if qdcount != 1:
        raise DnsFormatError(f"{qdcount} questions (one is read)")
    labels: list[str] = []
    pos = HEADER.size
    while True:
        if pos >= len(message):
            raise DnsFormatError("the question name runs past the message")
        length = message[pos]
        if length & 0xC0:
            raise DnsFormatError("a compressed or extended label in the question")
        pos += 1
        if length == 0:
            break
        label = message[pos:pos + length]
        if len(label) != length:
            raise DnsFormatError("a label runs past the message")
        try:
            labels.append(label.decode("ascii").lower())
        except UnicodeDecodeError:
            raise DnsFormatError("a label that is not ASCII") from None
        pos += length
    if pos + 4 > len(message):
        raise DnsFormatError("no question type and class")
    name = ".".join(labels)
    if len(name) > 253:
        raise DnsFormatError("a name longer than 253 characters")
    qtype = struct.unpack_from("!H", message, pos)[0]
    return Question(qid, name, qtype, pos + 4)


def error_response(message: bytes, rcode: int, question: Question | None) -> bytes:
    """A response to `message` with `rcode`, echoing its question (when it could be read)."""
    qid = struct.unpack_from("!H", message)[0] if len(message) >= 2 else 0
    rd = (struct.unpack_from("!H", message, 2)[0] & 0x0100) if len(message) >= 4 else 0
    flags = 0x8000 | rd | 0x0080 | rcode  # QR, RD echoed, RA, RCODE
    if question is None:
        return HEADER.pack(qid, flags, 0, 0, 0, 0)
    return HEADER.pack(qid, flags, 1, 0, 0, 0) + message[HEADER.size:question.end]


async def forward_udp(message: bytes, upstream: tuple[str, int],
                      timeout: float = UPSTREAM_TIMEOUT) -> bytes:
    """One query to the upstream resolver over UDP; its answer (same id) or TimeoutError."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        sock.connect(upstream)  # only the upstream's datagrams are received
        await loop.sock_sendall(sock, message)
        async with asyncio.timeout(timeout):
            while True:
                answer = await loop.sock_recv(sock, 65535)
                if answer[:2] == message[:2]:
                    return answer
    finally:
        sock.close()


def system_upstream(path: str = "/etc/resolv.conf") -> tuple[str, int]:
    """The node's first IPv4 nameserver (what its own getaddrinfo asks)."""
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver" and "." in parts[1]:
                return parts[1], DNS_PORT
    raise ValueError(f"no IPv4 nameserver in {path}: give the DNS upstream (--dns-upstream)")


def parse_upstream(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(DNS_PORT)
    try:
        socket.inet_aton(host)
    except OSError:
        raise ValueError(f"DNS upstream {text!r} is not an IPv4 address[:port]") from None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"DNS upstream {text!r}: bad port")
    return host, int(port)


def a_query(name: str, qid: int) -> bytes:
    """A recursive query for `name`'s A records."""
    labels = b"".join(bytes([len(part)]) + part.encode("ascii")
                      for part in name.rstrip(".").split(".") if part)
    return HEADER.pack(qid, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", 1, 1)


def _skip_name(message: bytes, pos: int) -> int:
    while True:
        if pos >= len(message):
            raise DnsFormatError("a name runs past the message")
        length = message[pos]
        if length & 0xC0 == 0xC0:
            return pos + 2  # a pointer ends the name
        if length & 0xC0:
            raise DnsFormatError("an extended label")
        pos += 1 + length
        if length == 0:
            return pos


def a_answers(message: bytes, qid: int) -> frozenset[str]:
    """The IPv4 addresses in the answer section of a response to query `qid` (every A record:
    a CNAME chain's target records are there too); empty for an error response."""
    if len(message) < HEADER.size:
        raise DnsFormatError("shorter than a DNS header")
    rid, flags, qdcount, ancount, _, _ = HEADER.unpack_from(message)
    if rid != qid or not flags & 0x8000:
        raise DnsFormatError("not the response to this query")
    if flags & 0xF:
        return frozenset()
    pos = HEADER.size
    for _ in range(qdcount):
        pos = _skip_name(message, pos) + 4
    found: set[str] = set()
    for _ in range(ancount):
        pos = _skip_name(message, pos)
        if pos + 10 > len(message):
            raise DnsFormatError("a record runs past the message")
        rtype, rclass, _, rdlength = struct.unpack_from("!HHIH", message, pos)
        pos += 10
        if pos + rdlength > len(message):
            raise DnsFormatError("a record's data runs past the message")
        if rtype == 1 and rclass == 1 and rdlength == 4:
            found.add(socket.inet_ntoa(message[pos:pos + 4]))
        pos += rdlength
    return frozenset(found)
