"""A small "internet" for network tests and benchmarks: test hosts in a network namespace the
lab makes, reachable from the host (and so from guests, through their slots) and nothing else.

    host netns                      lab netns <prefix>-inet
    <prefix>i0  198.18.N.1/24 <--veth--> eth0 198.18.N.2 (host A), 198.18.N.3 (host B)

Addresses are in 198.18.0.0/15 (RFC 2544, benchmarking), outside every range the runtime walls
off. Each host runs a plain HTTP server on port 80 and a TLS server on port 443 that presents
a certificate for the name the client asked for (SNI): `ALLOWED_NAME` or `DENIED_NAME`
(self-signed; clients use `curl -k`: the tests are about who may connect, not about trust).
Guests find the names through /etc/hosts (`hosts_lines()`).

HTTP paths: `/` answers `host=<Host header> addr=<local address> sni=<name or -> peer=<client>`;
`/big`
streams BIG_BYTES bytes as fast as the client takes them; `/slow` streams them paced by the
server (16 KiB every 20 ms), so a client reading it holds little unread data and answers every
segment at once; `/bytes/<n>` streams n bytes; `/held/<n>/<gate>` streams n bytes, of which
at most half (a trickle after the first 256 KiB) before the test releases the gate
(`Internet.release(gate)`), the rest at once after: a download that is under way, and cannot
end, until the test says so. Every answer closes the connection.
Host B also answers DNS (UDP 53): the three names -> host A (`DNS_NAME` only there).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ALLOWED_NAME = "example-allowed.test"
DENIED_NAME = "example-denied.test"
DNS_NAME = "example-dns.test"  # only in the lab's DNS, never in a guest's /etc/hosts
BIG_BYTES = 64 << 20

SERVER = r'''
import os, socket, socketserver, ssl, sys, threading, time
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer as _ThreadingHTTPServer

class ThreadingHTTPServer(_ThreadingHTTPServer):
    # HTTPServer.server_bind asks DNS for the address's name (getfqdn): on a host whose
    # resolver is unreachable from here that blocks for minutes.
    def server_bind(self):
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

addrs, certdir, big = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
CHUNK = b"x" * 65536
HELD_HEAD = 262144

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def log_message(self, *args): pass
    def _stream(self, n, pace=0.0):
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.end_headers()
        size = 16384 if pace else len(CHUNK)
        while n > 0:
            chunk = CHUNK[:min(n, size)]
            self.wfile.write(chunk)
            n -= len(chunk)
            if pace:
                time.sleep(pace)
    def _held(self, n, gate):
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.end_headers()
        released = os.path.join(certdir, f"{gate}.released")
        sent = 0
        while sent < n:
            if sent >= HELD_HEAD and not os.path.exists(released):
                if sent < n // 2:
                    self.wfile.write(CHUNK[:1024])
                    sent += 1024
                time.sleep(0.1)
                continue
            chunk = CHUNK[:min(n - sent, len(CHUNK))]
            self.wfile.write(chunk)
            sent += len(chunk)
    def do_GET(self):
        if self.path.startswith("/held/"):
            _, _, n, gate = self.path.split("/")
            assert gate.isalnum()
            return self._held(int(n), gate)
        if self.path == "/big":
            return self._stream(big)
        if self.path == "/slow":
            return self._stream(big, pace=0.02)
        if self.path.startswith("/bytes/"):
            return self._stream(int(self.path.split("/")[2]))
        sni = getattr(self.connection, "aenv_sni", None) or "-"
        body = (f"host={self.headers.get('Host')} addr={self.connection.getsockname()[0]} "
                f"sni={sni} peer={self.client_address[0]}\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

class TLSServer(ThreadingHTTPServer):
    def __init__(self, addr, contexts):
        self.contexts = contexts
        super().__init__(addr, Handler)
    def get_request(self):
        sock, peer = self.socket.accept()
        chosen = {}
        default = self.contexts["default"]
        def pick(conn, name, ctx):
            chosen["name"] = name
            if name in self.contexts:
                conn.context = self.contexts[name]
        default.sni_callback = pick
        try:
            sock.settimeout(10)
            tls = default.wrap_socket(sock, server_side=True)
            tls.settimeout(None)
        except (OSError, ssl.SSLError):
            sock.close()
            raise OSError("handshake failed")
        tls.aenv_sni = chosen.get("name")
        return tls, peer
    def handle_error(self, request, client_address): pass

def context(name):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(f"{certdir}/{name}.pem", f"{certdir}/{name}.key")
    return ctx

names = sys.argv[4].split(",")
contexts = {n: context(n) for n in names}
contexts["default"] = context(names[0])
servers = []
for addr in addrs:
    servers.append(ThreadingHTTPServer((addr, 80), Handler))
    servers.append(TLSServer((addr, 443), contexts))
for s in servers:
    s.daemon_threads = True
    threading.Thread(target=s.serve_forever, daemon=True).start()

def dns_serve(sock, records):
    # A queries for `records` get their address, other types of those names no answer,
    # other names NXDOMAIN. Enough for a guest's glibc resolver (no EDNS, no TCP).
    while True:
        query, peer = sock.recvfrom(512)
        try:
            i, labels = 12, []
            while query[i]:
                labels.append(query[i + 1:i + 1 + query[i]].decode().lower())
                i += 1 + query[i]
            qtype = int.from_bytes(query[i + 1:i + 3], "big")
            question = query[12:i + 5]
        except (IndexError, UnicodeDecodeError):
            continue
        ip = records.get(".".join(labels))
        answer = b""
        if ip and qtype == 1:
            answer = b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04" + socket.inet_aton(ip)
        flags = 0x8180 | (0 if ip else 3)
        head = (query[:2] + flags.to_bytes(2, "big") + b"\x00\x01"
                + (1 if answer else 0).to_bytes(2, "big") + b"\x00\x00\x00\x00")
        sock.sendto(head + question + answer, peer)

dns_addr, records = sys.argv[5], dict(r.split("=") for r in sys.argv[6].split(","))
dns_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
dns_sock.bind((dns_addr, 53))
threading.Thread(target=dns_serve, args=(dns_sock, records), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
'''


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _make_cert(directory: Path, name: str) -> None:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(directory / f"{name}.key"), "-out", str(directory / f"{name}.pem"),
         "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}"],
        check=True, capture_output=True)


@dataclass
class Internet:
    prefix: str
    subnet: int  # N in 198.18.N.0/24
    netns: str
    host_if: str
    gateway: str  # the host's address on the lab link
    host_a: str
    host_b: str
    workdir: Path
    server: subprocess.Popen[bytes] | None = None

    def hosts_lines(self) -> str:
        """/etc/hosts lines a guest needs: both names on host A."""
        return f"{self.host_a} {ALLOWED_NAME}\n{self.host_a} {DENIED_NAME}\n"

    def url(self, host: str, path: str = "/", tls: bool = False) -> str:
        return f"{'https' if tls else 'http'}://{host}{path}"

    def release(self, gate: str) -> None:
        """Let the `/held/<n>/<gate>` downloads send the rest of their bytes."""
        (self.workdir / f"{gate}.released").touch()

    @contextlib.contextmanager
    def socks5(self, port: int = 1080) -> Iterator[str]:
        """A SOCKS5 server (microsocks, no auth) on host B; yields its `address:port`."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, "microsocks", "-i",
                                 self.host_b, "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(OSError), socket.create_connection(
                        (self.host_b, port), timeout=1):
                    break
                assert proc.poll() is None, "microsocks exited"
                assert time.monotonic() < deadline, "microsocks did not start"
                time.sleep(0.05)
            yield f"{self.host_b}:{port}"
        finally:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def internet(prefix: str, subnet: int, workdir: Path) -> Iterator[Internet]:
    """Make the lab (namespace, veth, route, certificates, servers); remove it all after."""
    assert 0 <= subnet <= 255
    net = Internet(prefix=prefix, subnet=subnet, netns=f"{prefix}-inet", host_if=f"{prefix}i0",
                   gateway=f"198.18.{subnet}.1", host_a=f"198.18.{subnet}.2",
                   host_b=f"198.18.{subnet}.3", workdir=workdir)
    subprocess.run(["ip", "netns", "del", net.netns], capture_output=True)
    subprocess.run(["ip", "link", "del", net.host_if], capture_output=True)
    workdir.mkdir(parents=True, exist_ok=True)
    for name in (ALLOWED_NAME, DENIED_NAME):
        _make_cert(workdir, name)
    _ip("netns", "add", net.netns)
    try:
        _ip("link", "add", net.host_if, "type", "veth", "peer", "name", "eth0", "netns", net.netns)
        _ip("addr", "add", f"{net.gateway}/24", "dev", net.host_if)
        _ip("link", "set", net.host_if, "up")
        for addr in (net.host_a, net.host_b):
            _ip("-n", net.netns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", net.netns, "link", "set", "eth0", "up")
        _ip("-n", net.netns, "link", "set", "lo", "up")
        _ip("-n", net.netns, "route", "add", "default", "via", net.gateway)
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        net.server = subprocess.Popen(
            ["ip", "netns", "exec", net.netns, sys.executable, "-c", SERVER,
             f"{net.host_a},{net.host_b}", str(workdir), str(BIG_BYTES),
             f"{ALLOWED_NAME},{DENIED_NAME}", net.host_b,
             ",".join(f"{n}={net.host_a}" for n in (ALLOWED_NAME, DENIED_NAME, DNS_NAME))],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://{net.host_a}/", timeout=2).status_code == 200:
                    break
            assert net.server.poll() is None, "the lab's servers exited"
            assert time.monotonic() < deadline, "the lab's servers did not start"
            time.sleep(0.1)
        yield net
    finally:
        if net.server is not None:
            net.server.kill()
            net.server.wait(5)
        subprocess.run(["ip", "link", "del", net.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", net.netns], capture_output=True)
