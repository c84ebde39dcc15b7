"""The egress proxy's readers of first bytes: TLS ClientHello SNI and HTTP/1.x request heads.

ClientHellos are real ones, made by Python's ssl (OpenSSL) for a server name; the fuzz tests
feed garbage and mutated hellos and require a defined answer (a name, None, Incomplete or the
parser's own error), never a crash."""

from __future__ import annotations

import contextlib
import ssl

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv.network import httphead, sni
from agentenv.network.httphead import HttpError, RequestStream, parse_request_head


def client_hello(server_name: str | None, *, tls13: bool = True, alpn: bool = False) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if not tls13:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    if alpn:
        ctx.set_alpn_protocols(["h2", "http/1.1"])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def refragment(hello: bytes, first: int) -> bytes:
    """The same handshake message in two records, split after `first` bytes."""
    body = hello[5:]
    header = hello[:3]
    return (header + first.to_bytes(2, "big") + body[:first]
            + header + (len(body) - first).to_bytes(2, "big") + body[first:])


@pytest.mark.parametrize("tls13", [True, False])
@pytest.mark.parametrize("name", ["example-allowed.test", "A.Example.COM", "x" * 60 + ".test"])
def test_sni_of_real_hellos(name: str, tls13: bool) -> None:
    hello = client_hello(name, tls13=tls13, alpn=True)
    assert sni.looks_like_tls(hello)
    assert sni.server_name(hello) == name.lower()
    # What follows the hello (early data, the next record) does not matter.
    assert sni.server_name(hello + b"\x17\x03\x03\x00\x05hello") == name.lower()


def test_no_sni_when_connecting_by_address() -> None:
    assert sni.server_name(client_hello("198.18.0.2")) is None
    assert sni.server_name(client_hello(None)) is None


def test_every_prefix_is_incomplete() -> None:
    hello = client_hello("example-allowed.test")
    for cut in range(len(hello)):
        with pytest.raises(sni.Incomplete):
            sni.server_name(hello[:cut])


@pytest.mark.parametrize("first", [1, 3, 4, 50, 200])
def test_hello_split_over_two_records(first: int) -> None:
    hello = client_hello("example-allowed.test")
    split = refragment(hello, first)
    assert sni.server_name(split) == "example-allowed.test"
    with pytest.raises(sni.Incomplete):
        sni.server_name(split[:len(split) - 1])


@pytest.mark.parametrize("data, why", [
    (b"GET / HTTP/1.1\r\n", "not a TLS handshake"),
    (b"\x17\x03\x03\x00\x10" + b"x" * 16, "not a TLS handshake"),
    (b"\x16\x02\x00\x00\x10" + b"x" * 16, "not a TLS handshake"),
    (b"\x16\x03\x01\x00\x00", "record length 0"),
    (b"\x16\x03\x01\x00\x08\x02\x00\x00\x04abcd", "not ClientHello"),
])
def test_not_a_hello(data: bytes, why: str) -> None:
    with pytest.raises(sni.NotClientHello, match=why):
        sni.server_name(data)


def test_bad_server_names_are_refused() -> None:
    good = client_hello("aaaa.test")
    for bad in (b"a\x00aa.test", b"a aa.test", b"aaa..test", b"-aaa.test"):  # same length
        with pytest.raises(sni.NotClientHello, match="not a host name"):
            sni.server_name(good.replace(b"aaaa.test", bad))


def test_length_lies_are_caught() -> None:
    hello = bytearray(client_hello("example-allowed.test"))
    hello[9] ^= 0x40  # the handshake length's middle byte: claims more than the record
    with pytest.raises((sni.NotClientHello, sni.Incomplete)):
        sni.server_name(bytes(hello))


_HELLO = client_hello("fuzz.example.test", alpn=True)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_fuzz_sni_garbage(data: bytes) -> None:
    _sni_defined(data)
    _sni_defined(b"\x16\x03\x01" + data)


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_HELLO) - 1), st.integers(0, 255)), max_size=6),
       st.integers(0, len(_HELLO)))
def test_fuzz_sni_mutated_hellos(flips: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(_HELLO)
    for pos, value in flips:
        data[pos] = value
    _sni_defined(bytes(data[:cut]) if cut else bytes(data))


def _sni_defined(data: bytes) -> None:
    try:
        name = sni.server_name(data)
    except (sni.Incomplete, sni.NotClientHello):
        return
    assert name is None or (isinstance(name, str) and name == name.lower() and len(name) <= 253)


# -- HTTP ----------------------------------------------------------------------------------------


def test_request_head_and_host() -> None:
    data = b"GET /a?b HTTP/1.1\r\nHost: Example-Allowed.TEST:8080\r\nX-A:  1 \r\n\r\nbody"
    head = parse_request_head(data)
    assert (head.method, head.target, head.version) == ("GET", "/a?b", "HTTP/1.1")
    assert head.host() == "example-allowed.test"
    assert head.headers == [("host", "Example-Allowed.TEST:8080"), ("x-a", "1")]
    assert head.length == len(data) - 4
    assert head.raw == data[:-4]


@pytest.mark.parametrize("data, host", [
    (b"GET http://abs.test/x HTTP/1.1\r\nHost: ABS.test:80\r\n\r\n", "abs.test"),
    (b"GET http://user@abs.test:81 HTTP/1.1\r\n\r\n", "abs.test"),
    (b"GET / HTTP/1.0\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\nHost: 198.18.0.2\r\n\r\n", "198.18.0.2"),
    (b"GET / HTTP/1.1\r\nHost: trailing.dot.\r\n\r\n", "trailing.dot"),
])
def test_host_forms(data: bytes, host: str | None) -> None:
    assert parse_request_head(data).host() == host


@pytest.mark.parametrize("data, error", [
    (b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n", "two Host"),
    (b"GET / HTTP/1.1\r\nHost: a b.test\r\n\r\n", "not a host name"),
    (b"GET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n", "folded"),
    (b"GET http://a.test/ HTTP/1.1\r\nHost: b.test\r\n\r\n", "different hosts"),
    (b"GET / HTTP/1.1\r\nBad Header: a\r\n\r\n", "malformed header"),
])
def test_bad_heads(data: bytes, error: str) -> None:
    with pytest.raises(HttpError, match=error):
        parse_request_head(data).host()


def test_not_http_and_incomplete() -> None:
    for data in (b"\x16\x03\x01", b"SSH-2.0-OpenSSH\r\n", b"GET /\r\n\r\n", b"get / HTTP/2.0\r\n"):
        with pytest.raises(httphead.NotHttp):
            parse_request_head(data)
    for data in (b"", b"GE", b"GET / HTTP/1.1", b"GET / HTTP/1.1\r\nHost: a"):
        with pytest.raises(httphead.Incomplete):
            parse_request_head(data)
    assert httphead.looks_like_http(b"POST ")
    assert not httphead.looks_like_http(b"\x16\x03")


def test_head_size_cap() -> None:
    data = b"GET / HTTP/1.1\r\nX: " + b"a" * httphead.MAX_HEAD
    with pytest.raises(HttpError, match="longer than"):
        parse_request_head(data)


def _seen_hosts() -> tuple[list[str | None], RequestStream]:
    hosts: list[str | None] = []

    def on_head(head: httphead.RequestHead) -> bytes:
        hosts.append(head.host())
        return head.raw

    return hosts, RequestStream(on_head)


KEEPALIVE = (
    b"POST /1 HTTP/1.1\r\nHost: a.test\r\nContent-Length: 11\r\n\r\nhello world"
    b"PUT /2 HTTP/1.1\r\nHost: b.test\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    b"\r\nGET /3 HTTP/1.1\r\nHost: c.test\r\n\r\n"
)


@pytest.mark.parametrize("step", [1, 2, 7, 64, len(KEEPALIVE)])
def test_stream_frames_every_request(step: int) -> None:
    hosts, stream = _seen_hosts()
    out = b"".join(stream.feed(KEEPALIVE[i:i + step]) for i in range(0, len(KEEPALIVE), step))
    assert hosts == ["a.test", "b.test", "c.test"]
    assert out == KEEPALIVE.replace(b"\r\nGET /3", b"GET /3")  # only the stray CRLF is dropped


def test_stream_sets_rule_headers() -> None:
    def on_head(head: httphead.RequestHead) -> bytes:
        return httphead.with_headers(head, (("Authorization", "Bearer x"), ("X-New", "1")))

    stream = RequestStream(on_head)
    out = stream.feed(b"GET / HTTP/1.1\r\nHost: a.test\r\nauthorization: old\r\nAccept: */*\r\n\r\n")
    assert out == (b"GET / HTTP/1.1\r\nHost: a.test\r\nAccept: */*\r\n"
                   b"Authorization: Bearer x\r\nX-New: 1\r\n\r\n")


def test_stream_refuses_smuggling() -> None:
    _, stream = _seen_hosts()
    with pytest.raises(HttpError, match="both Transfer-Encoding and Content-Length"):
        stream.feed(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
    _, stream = _seen_hosts()
    with pytest.raises(HttpError, match="Content-Length"):
        stream.feed(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n")
    _, stream = _seen_hosts()
    with pytest.raises(HttpError, match="chunk size"):
        stream.feed(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")


WS = b"GET /ws HTTP/1.1\r\nHost: a.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
FRAME = b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58"


def test_stream_after_an_accepted_upgrade_is_raw() -> None:
    hosts, stream = _seen_hosts()
    released: list[bytes] = []
    stream.release = released.append
    responses = stream.responses()
    assert stream.feed(WS) == WS
    assert stream.feed(FRAME) == b""  # held: the server has not answered yet
    answer = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n\x81\x02hi"
    assert responses.feed(answer) == answer
    assert released == [FRAME]  # the server switched: not ours to frame
    assert stream.feed(b"GET / HTTP/1.1\r\nHost: b.test\r\n\r\n").startswith(b"GET")
    assert hosts == ["a.test"]  # raw from then on


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_stream_after_a_declined_upgrade_reads_requests_again(step: int) -> None:
    """The answer to earlier pipelined requests (chunked, HEAD, 100 Continue) comes first;
    the one to the Upgrade declines it: the held bytes are requests, each decided."""
    hosts, stream = _seen_hosts()
    released: list[bytes] = []
    stream.release = released.append
    responses = stream.responses()
    first = b"HEAD /h HTTP/1.1\r\nHost: a.test\r\n\r\n" + \
        b"POST /p HTTP/1.1\r\nHost: a.test\r\nContent-Length: 2\r\n\r\nhi"
    smuggled = b"GET\t/\tHTTP/1.1\r\nHost: evil.test\r\n\r\n"
    out = stream.feed(first + WS + smuggled)
    assert out == first + WS and hosts == ["a.test"] * 3
    answers = (b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"  # HEAD: no body
               b"HTTP/1.1 100 Continue\r\n\r\n"
               b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nHTT\r\n0\r\n\r\n")
    for i in range(0, len(answers), step):
        responses.feed(answers[i:i + step])
    assert released == []
    with pytest.raises(HttpError, match=r"not an HTTP/1\.x request line"):
        responses.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")  # declined
    # A declined upgrade followed by a proper request: it is decided and passed.
    hosts, stream = _seen_hosts()
    stream.release = released.append
    responses = stream.responses()
    stream.feed(WS + b"GET / HTTP/1.1\r\nHost: b.test\r\n\r\n")
    responses.feed(b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\n\r\n")
    assert hosts == ["a.test", "b.test"] and released == [b"GET / HTTP/1.1\r\nHost: b.test\r\n\r\n"]


def test_stream_upgrade_limits() -> None:
    _, stream = _seen_hosts()
    stream.feed(WS)
    with pytest.raises(HttpError, match="held back"):
        stream.feed(b"x" * (httphead.MAX_HEAD + 8))
    _, stream = _seen_hosts()
    with pytest.raises(HttpError, match="a body with a request to switch"):
        stream.feed(b"POST / HTTP/1.1\r\nHost: a\r\nUpgrade: h2c\r\nContent-Length: 1\r\n\r\n")
    # A server whose answers cannot be framed: no upgrade is let through after that.
    _, stream = _seen_hosts()
    responses = stream.responses()
    stream.feed(WS)
    assert responses.feed(b"garbage\r\n\r\n") == b"garbage\r\n\r\n"
    with pytest.raises(HttpError):
        stream.feed(FRAME)


def test_h2c_offers_are_taken_out() -> None:
    head = parse_request_head(b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: h2c\r\n"
                              b"HTTP2-Settings: AAMA\r\nAccept: */*\r\n\r\n")
    assert httphead.without_h2c(head).raw == b"GET / HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n"
    mixed = parse_request_head(b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket, h2c\r\n\r\n")
    with pytest.raises(HttpError, match="h2c with other"):
        httphead.without_h2c(mixed)
    plain = parse_request_head(WS)
    assert httphead.without_h2c(plain) is plain


def test_connect_is_decided_by_its_target() -> None:
    head = parse_request_head(b"CONNECT b.test:443 HTTP/1.1\r\n\r\n")
    assert head.host() == "b.test"
    head = parse_request_head(b"CONNECT b.test:443 HTTP/1.1\r\nHost: a.test\r\n\r\n")
    with pytest.raises(HttpError, match="CONNECT target"):
        head.host()


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=400), st.integers(1, 50))
def test_fuzz_http_garbage(data: bytes, step: int) -> None:
    with contextlib.suppress(httphead.Incomplete, httphead.NotHttp, HttpError):
        parse_request_head(data).host()
    _, stream = _seen_hosts()
    try:
        for i in range(0, len(data), step):
            stream.feed(data[i:i + step])
    except HttpError:
        pass


_TOKENS = st.sampled_from([b"GET", b"POST", b" ", b"/", b"\r\n", b"Host: a.test", b":",
                           b"Content-Length: 3", b"Transfer-Encoding: chunked", b"HTTP/1.1",
                           b"0", b"3", b"abc", b"\r\n\r\n", b"Upgrade: x", b";", b"\t", b"\x00"])


@settings(max_examples=1500, deadline=None)
@given(st.lists(_TOKENS, max_size=40), st.integers(1, 30))
def test_fuzz_http_near_valid(tokens: list[bytes], step: int) -> None:
    data = b"".join(tokens)
    whole_hosts, whole = _seen_hosts()
    try:
        whole_out: bytes | None = whole.feed(data)
    except HttpError:
        whole_out = None
    hosts, stream = _seen_hosts()
    out = b""
    try:
        for i in range(0, len(data), step):
            out += stream.feed(data[i:i + step])
    except HttpError:
        return
    # Chunking does not change what is decided or forwarded.
    if whole_out is not None:
        assert hosts == whole_hosts
        assert out == whole_out


def test_dns_questions_are_read_and_bad_ones_named() -> None:
    from agentenv.network import dns

    query = bytes.fromhex("abcd01000001000000000000") + b"\x03WWW\x07example\x03com\x00" \
        + bytes.fromhex("00010001")
    question = dns.parse_query(query)
    assert (question.id, question.name, question.qtype, question.end) == \
        (0xABCD, "www.example.com", 1, len(query))
    refused = dns.error_response(query, dns.RCODE_REFUSED, question)
    assert refused[:2] == b"\xab\xcd" and refused[3] & 0xF == 5 and refused[2] & 0x80
    assert refused[12:] == query[12:]
    for bad, why in ((query[:11], "shorter"), (query[:20], "runs past"),
                     (bytes.fromhex("abcd81000001000000000000"), "a response"),
                     (bytes.fromhex("abcd01000002000000000000"), "2 questions"),
                     (query[:12] + b"\xc0\x0c" + query[-4:], "compressed")):
        with pytest.raises(dns.DnsFormatError, match=why):
            dns.parse_query(bad)


def test_names_bound_through_a_name_server() -> None:
    """NameAnswers with a name server: A queries to it, every A record of the answer kept
    (a CNAME chain's target too); an error answer is no address."""
    import asyncio
    import socket
    import struct
    import threading
    from ipaddress import IPv4Address

    from agentenv.network import dns
    from agentenv.network.egress import NameAnswers

    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))

    def answer() -> None:
        while True:
            try:
                query, peer = server.recvfrom(4096)
            except OSError:
                return
            question = dns.parse_query(query)
            if question.name == "missing.test":
                head = struct.pack("!HHHHHH", question.id, 0x8183, 1, 0, 0, 0)
                server.sendto(head + query[12:question.end], peer)
                continue
            head = struct.pack("!HHHHHH", question.id, 0x8180, 1, 3, 0, 0)
            cname = struct.pack("!HHHIH", 0xC00C, 5, 1, 60, 2) + b"\xc0\x0c"
            records = b"".join(struct.pack("!HHHIH", 0xC00C, 1, 1, 60, 4)
                               + socket.inet_aton(ip) for ip in ("192.0.2.1", "192.0.2.2"))
            server.sendto(head + query[12:question.end] + cname + records, peer)

    threading.Thread(target=answer, daemon=True).start()

    async def scenario() -> None:
        names = NameAnswers(30.0, server.getsockname())
        assert await names.answers("www.example.test") == \
            {IPv4Address("192.0.2.1"), IPv4Address("192.0.2.2")}
        assert await names.answers("missing.test") == frozenset()
        assert names.fresh("www.example.test") and not names.fresh("other.test")

    try:
        asyncio.run(scenario())
    finally:
        server.close()
    with pytest.raises(dns.DnsFormatError, match="not the response"):
        dns.a_answers(dns.a_query("a.test", 1), 1)
