"""A small network lab for the egress proxy: real namespaces, veths, nftables and servers.

- an "internet" namespace (198.18.0.2 and 198.18.0.3, the benchmarking range) behind a veth
  from the host (198.18.0.1), with a plain HTTP server on 198.18.0.2:80 and a TLS server on
  198.18.0.2:443 that presents a certificate for each of two names (SNI);
- real slots (runtime.network.NetworkSlot under a test prefix), each with a "guest" namespace
  wired in place of its TAP device (`guest_ns`): what a client sends from there crosses the
  slot's rules and leaves with the slot's guest_address, as a VM's traffic does;
- a host nft table with the egress redirects (metadata always; 80/443 of "web" sources; all TCP
  of "all" sources) to the proxy's port, as the node installs them;
- the proxy process itself (EgressProxyProcess), in a mount namespace of its own whose
  /etc/hosts names the lab's servers and whose resolv.conf names a lab address (its
  getaddrinfo is the node's resolver: a name is let out only to the addresses it resolves
  to; no lookup leaves the lab).
Sockets inside a namespace are made by a thread that entered it (setns): a socket stays in the
namespace it was made in, whichever thread uses it later. Servers run as threads of the test.
Used by tests/network and bench/egress_proxy_bench.py; needs root.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import http.server
import json
import os
import socket
import socketserver
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentenv.network.control import EgressControlClient, SlotEntry, SlotIdentity
from agentenv.network.policy import EgressPolicy
from agentenv.network.process import EgressProxyProcess
from agentenv.runtime import network as rtnet

INET_HOST = "198.18.0.1"
INET_SERVER = "198.18.0.2"
INET_SOCKS = "198.18.0.3"
INET_OTHER = "198.18.0.4"  # servers no name in the lab's hosts file points at
LAB_RESOLVER = INET_SOCKS  # the proxy's nameserver (its resolv.conf), port 53
OTHER_PORT = 8080  # a plain HTTP server on a port the "web" redirects leave alone
NAMES = ("example-allowed.test", "example-denied.test")
SOCKS_NAME = "socks.test"  # the certificate name of the TLS front of the SOCKS5 server
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def run(*argv: str, stdin: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc.stdout


def in_netns(netns: str, fn: Callable[[], Any]) -> Any:
    """fn() run by a thread that entered /run/netns/<netns>; returns its result."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {netns}")
            finally:
                os.close(fd)
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def socket_in(netns: str, family: int = socket.AF_INET,
              type_: int = socket.SOCK_STREAM) -> socket.socket:
    return in_netns(netns, lambda: socket.socket(family, type_))  # type: ignore[no-any-return]


def blob(size: int) -> bytes:
    """The deterministic bytes the HTTP server serves for /blob?size=N."""
    seed = hashlib.sha256(b"egress-lab").digest() * 2048  # 64 KiB
    reps, rest = divmod(size, len(seed))
    return seed * reps + seed[:rest]


_blob_fds: dict[int, int] = {}
_blob_lock = threading.Lock()


def _blob_fd(size: int) -> int:
    """An unlinked file holding blob(size) (one per size, for this process's lifetime)."""
    with _blob_lock:
        if size not in _blob_fds:
            fd, path = tempfile.mkstemp(prefix="egress-blob-")
            os.unlink(path)
            os.write(fd, blob(size))
            _blob_fds[size] = fd
        return _blob_fds[size]


class Certificates:
    """A throwaway CA and one certificate per name (openssl CLI)."""

    def __init__(self, directory: Path, names: tuple[str, ...] = NAMES) -> None:
        self.dir = directory
        self.ca = directory / "ca.pem"
        d = str(directory)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        run("openssl", "req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", str(self.ca),
            "-subj", "/CN=egress-lab-ca", "-days", "2")
        self.files: dict[str, tuple[Path, Path]] = {}
        for name in names:
            key, csr, cert, ext = (directory / f"{name}.{x}" for x in ("key", "csr", "pem", "ext"))
            ext.write_text(f"subjectAltName=DNS:{name}\n")
            run("openssl", "req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
            run("openssl", "x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey",
                f"{d}/ca.key", "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile",
                str(ext))
            self.files[name] = (cert, key)

    def server_context(self) -> ssl.SSLContext:
        contexts: dict[str, ssl.SSLContext] = {}
        for name, (cert, key) in self.files.items():
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, key)
            contexts[name] = ctx
        default = contexts[next(iter(contexts))]

        def pick(sslsock: ssl.SSLObject, name: str | None, _: ssl.SSLContext) -> None:
            sslsock.sni_seen = name  # type: ignore[attr-defined]  # what _Handler reports
            if name in contexts:
                sslsock.context = contexts[name]

        default.sni_callback = pick  # type: ignore[assignment]
        return default

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


class _Handler(http.server.BaseHTTPRequestHandler):
    """/blob?size=N: N deterministic bytes; /echo with Upgrade: 101, then an echo of what
    follows; anything else (an Upgrade too: declined): JSON of what the server saw."""

    protocol_version = "HTTP/1.1"
    timeout = 120

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

    def do_GET(self) -> None:
        if self.path == "/echo" and self.headers.get("Upgrade"):
            # Agrees to switch (101), then echoes raw bytes until the client ends.
            self.send_response(101)
            self.send_header("Upgrade", self.headers["Upgrade"])
            self.send_header("Connection", "Upgrade")
            self.end_headers()
            self.wfile.flush()
            self.close_connection = True
            while data := self.connection.recv(65536):
                self.connection.sendall(data)
            return
        if self.path.startswith("/blob"):
            size = int(self.path.partition("size=")[2] or 0)
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.wfile.flush()
            if not isinstance(self.connection, ssl.SSLSocket):
                # Zero-copy from a file of the same bytes: the server is not what is measured.
                with os.fdopen(os.dup(_blob_fd(size)), "rb") as f:
                    self.connection.sendfile(f, 0, size)
                return
            view = memoryview(blob(size))
            for i in range(0, size, 1 << 20):
                self.wfile.write(view[i:i + (1 << 20)])
            return
        sni = getattr(self.connection, "sni_seen", None)
        body = json.dumps({"path": self.path, "headers": [list(h) for h in self.headers.items()],
                           "client": self.client_address[0],
                           "tls": isinstance(self.connection, ssl.SSLSocket),
                           "sni": sni}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        """The body's length and sha256 (Content-Length or chunked), and the headers seen."""
        digest, length = hashlib.sha256(), 0
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    break
                chunk = self.rfile.read(size)
                digest.update(chunk)
                length += len(chunk)
                self.rfile.readline()
        else:
            left = int(self.headers.get("Content-Length", "0"))
            while left:
                chunk = self.rfile.read(min(left, 1 << 20))
                digest.update(chunk)
                length += len(chunk)
                left -= len(chunk)
        body = json.dumps({"length": length, "sha256": digest.hexdigest(),
                           "headers": [list(h) for h in self.headers.items()]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients reset on purpose all the time here


def serve(netns: str, address: str, port: int,
          context: ssl.SSLContext | None = None) -> _Server:
    """An HTTP(S) server on address:port inside netns, in a thread of this process."""
    sock = socket_in(netns)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(256)
    server = _Server((address, port), _Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False) \
        if context else sock
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                     daemon=True).start()
    return server


def identity(n: int) -> SlotIdentity:
    return SlotIdentity(f"sbx-{n}", "tpl-base", f"snap-{n}", hashlib.sha256(f"t{n}".encode())
                        .hexdigest(), f"instance-token-{n}")


class Lab:
    """The whole lab; `with Lab(tmp, slots=2) as lab:` builds it and takes it all down."""

    def __init__(self, tmp: Path, slots: int = 2, prefix: str = "eptest", port: int = 15001,
                 tls: bool = True, proxy_args: tuple[str, ...] = (),
                 slot_rate_mbit: int = 0, slot_max_flows: int = 0,
                 nfs_port: int | None = None, proxy: bool = True,
                 nfs_address: str | None = None) -> None:
        """`nfs_port`: the host's redirect of NFS-enabled slots goes there (docs/volumes.md
        §7.1), a DNAT to `nfs_address` when given (the server's own namespace,
        runtime/nfs_net.py); `proxy` False: no egress proxy process is started."""
        self.tmp, self.prefix, self.port = tmp, prefix, port
        self.nfs_port = nfs_port
        self.nfs_address = nfs_address
        self.with_proxy = proxy
        self.inet = f"{prefix}-inet"
        # Slots come from a pool, as the node's do: an index whose addresses the host routes
        # already (another runtime's slot, a host network inside 10.12/16) is skipped.
        self.pool = rtnet.SlotPool(prefix, low=0, high=0, rate_mbit=slot_rate_mbit,
                                   max_flows=slot_max_flows)
        self.slot_count = slots
        self.slots: list[rtnet.NetworkSlot] = []
        self.table = f"{prefix}_egress"
        self.with_tls = tls
        self.proxy_args = proxy_args
        self.proxy: EgressProxyProcess | None = None
        self.servers: list[_Server] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.certs: Certificates | None = None
        self.loop = asyncio.new_event_loop()

    # -- build and tear down -----------------------------------------------------------------

    def __enter__(self) -> Lab:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        self.loop.run_until_complete(rtnet.remove_leftovers(self.prefix))
        # The node's host table (its input wall lets only redirected TCP reach this port).
        self.loop.run_until_complete(rtnet.setup_host(self.prefix, self.port,
                                                      nfs_port=self.nfs_port,
                                                      nfs_address=self.nfs_address))
        veth = f"{self.prefix}i0"
        run("ip", "link", "del", veth, check=False)
        run("ip", "netns", "add", self.inet)
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", self.inet)
        run("ip", "addr", "add", f"{INET_HOST}/24", "dev", veth)
        run("ip", "link", "set", veth, "up")
        run("ip", "-n", self.inet, "-batch", "-", stdin=(
            "link set lo up\n"
            f"addr add {INET_SERVER}/24 dev eth0\n"
            f"addr add {INET_SOCKS}/24 dev eth0\n"
            f"addr add {INET_OTHER}/24 dev eth0\n"
            "link set eth0 up\n"
            f"route add default via {INET_HOST}\n"))
        for _ in range(self.slot_count):
            slot = self.loop.run_until_complete(self.pool.take())
            self.slots.append(slot)
            self.wire_guest(slot)
        run("nft", "-f", "-", stdin=self.nft_rules())
        self.servers.append(serve(self.inet, INET_SERVER, 80))
        self.servers.append(serve(self.inet, INET_OTHER, 80))
        self.servers.append(serve(self.inet, INET_SERVER, OTHER_PORT))
        if self.with_tls:
            self.certs = Certificates(self.tmp, (*NAMES, SOCKS_NAME))
            self.servers.append(serve(self.inet, INET_SERVER, 443, self.certs.server_context()))
            self.servers.append(serve(self.inet, INET_OTHER, 443, self.certs.server_context()))
        if self.with_proxy:
            self.start_proxy()

    def guest_ns(self, slot: rtnet.NetworkSlot) -> str:
        """The namespace standing for the slot's VM (`wire_guest`)."""
        return f"{self.prefix}-g{slot.index}"

    def wire_guest(self, slot: rtnet.NetworkSlot) -> None:
        """A namespace wired as the slot's guest: a veth in place of its TAP device, the
        guest's address and route. Its traffic crosses the slot's own rules, as a VM's does
        (what the slot's namespace sends itself does not leave it: its output guard)."""
        ns = self.guest_ns(slot)
        run("ip", "netns", "del", ns, check=False)
        run("ip", "netns", "add", ns)
        run("ip", "-n", slot.netns_name, "link", "del", "tap0")
        run("ip", "-n", slot.netns_name, "-batch", "-", stdin=(
            f"link add tap0 type veth peer name eth0 netns {ns}\n"
            f"link set tap0 address {rtnet.TAP_MAC}\n"
            f"addr add {rtnet.TAP_IP}/30 dev tap0\n"
            "link set tap0 up\n"))
        run("ip", "-n", ns, "-batch", "-", stdin=(
            "link set lo up\n"
            f"addr add {rtnet.GUEST_IP}/30 dev eth0\n"
            "link set eth0 up\n"
            f"route add default via {rtnet.TAP_IP}\n"))

    def nft_rules(self) -> str:
        p = self.prefix
        return (
            f"table ip {self.table} {{\n"
            "  set web { type ipv4_addr; }\n"
            "  set every { type ipv4_addr; }\n"
            "  chain pre {\n"
            "    type nat hook prerouting priority dstnat;\n"
            f'    iifname "{p}h*" ip daddr 169.254.169.254 tcp dport 80 redirect to :{self.port}\n'
            f'    iifname "{p}h*" ip daddr 169.254.169.254 meta l4proto {{ tcp, udp }} th dport 53 '
            f"redirect to :{self.port}\n"
            f'    iifname "{p}h*" ip saddr @web tcp dport {{ 80, 443 }} redirect to :{self.port}\n'
            f'    iifname "{p}h*" ip saddr @every meta l4proto tcp redirect to :{self.port}\n'
            "  }\n"
            "}\n")

    def hosts_file(self) -> Path:
        """The proxy's /etc/hosts: the lab's names at the lab's servers."""
        path = self.tmp / "hosts"
        path.write_text("127.0.0.1 localhost\n"
                        + "".join(f"{INET_SERVER} {name}\n" for name in NAMES)
                        + f"{INET_SOCKS} {SOCKS_NAME}\n")
        return path

    def resolv_conf(self) -> Path:
        """The proxy's resolv.conf: a lab address (no lookup leaves the lab). Nothing answers
        there unless a test listens (198.18.0.3:53): a name not in the hosts file fails fast."""
        path = self.tmp / "resolv.conf"
        path.write_text(f"nameserver {LAB_RESOLVER}\noptions timeout:5 attempts:1\n")
        return path

    def start_proxy(self) -> dict[str, Any]:
        launcher = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$0" /etc/hosts && mount --bind "$1" /etc/resolv.conf && '
                    'shift && exec "$@"', str(self.hosts_file()), str(self.resolv_conf()))
        self.proxy = EgressProxyProcess(self.tmp / "egress.sock", self.port,
                                        log_path=self.tmp / "egress.log",
                                        extra_args=self.proxy_args, launcher=launcher)
        return self.loop.run_until_complete(self.proxy.start())

    def stop_proxy(self) -> None:
        if self.proxy is not None:
            self.loop.run_until_complete(self.proxy.stop())
            self.proxy = None

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        self.stop_proxy()
        for server in self.servers:
            server.shutdown()
            server.server_close()
        run("nft", "delete", "table", "ip", self.table, check=False)
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.pool.close())  # destroys its slots
        for slot in self.slots:
            run("ip", "netns", "del", self.guest_ns(slot), check=False)
        run("ip", "netns", "del", self.inet, check=False)
        run("ip", "link", "del", f"{self.prefix}i0", check=False)
        self.loop.run_until_complete(rtnet.teardown_host(self.prefix))
        self.loop.close()

    # -- control ---------------------------------------------------------------------------

    def control(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request on a fresh control connection (the answer, errors included)."""
        assert self.proxy is not None

        async def call() -> dict[str, Any]:
            reader, writer = await asyncio.open_unix_connection(str(self.proxy.control_path))
            writer.write(json.dumps({"op": op, **fields}).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
            writer.close()
            return json.loads(line)  # type: ignore[no-any-return]

        return self.loop.run_until_complete(call())

    def client(self) -> EgressControlClient:
        assert self.proxy is not None
        return EgressControlClient(self.proxy.control_path)

    def set_policy(self, slot: rtnet.NetworkSlot, network: dict[str, Any] | None = None,
                   mode: str | None = None, n: int | None = None) -> None:
        """Tell the proxy the slot's policy (as the node does) and point the redirects at it:
        `mode` web/all/none, by default the policy's proxied_ports."""
        policy = EgressPolicy.from_wire(network or {})
        entry = SlotEntry(slot.guest_address, identity(n or slot.index), policy)
        client = self.client()
        self.loop.run_until_complete(client.set_slot(entry))
        self.loop.run_until_complete(client.close())
        self.redirect(slot, mode or policy.proxied_ports)

    def redirect(self, slot: rtnet.NetworkSlot, mode: str) -> None:
        lines = []
        for name, mode_name in (("web", "web"), ("every", "all")):
            op = "add" if mode_name == mode else "delete"
            check = run("nft", "get", "element", "ip", self.table, name,
                        f"{{ {slot.guest_address} }}", check=False)
            present = slot.guest_address in check
            if (op == "add") != present:
                lines.append(f"{op} element ip {self.table} {name} {{ {slot.guest_address} }}")
        if lines:
            run("nft", "-f", "-", stdin="\n".join(lines) + "\n")

    def start_socks(self, username: str = "lab", password: str = "secret") -> subprocess.Popen[bytes]:
        """microsocks on 198.18.0.3:1080 in the internet namespace (its outbound connections
        leave from 198.18.0.3 too: the servers see who carried a request)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.inet, "microsocks", "-i", INET_SOCKS, "-p", "1080",
             "-b", INET_SOCKS, "-u", username, "-P", password],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        for _ in range(200):
            probe = socket_in(self.inet)
            try:
                probe.connect((INET_SOCKS, 1080))
                return proc
            except OSError:
                time.sleep(0.02)
            finally:
                probe.close()
        raise RuntimeError("microsocks did not start listening")

    def start_tls_front(self, port: int = 1443) -> socket.socket:
        """TLS on 198.18.0.3:<port> (certificate for socks.test) in front of microsocks: a
        SOCKS5 proxy reached over TLS. Close the returned socket to stop accepting."""
        assert self.certs is not None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(*self.certs.files[SOCKS_NAME])
        listener = socket_in(self.inet)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((INET_SOCKS, port))
        listener.listen(64)
        inet = self.inet

        def pipe(src: socket.socket, dst: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(65536):
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR) if not isinstance(dst, ssl.SSLSocket) else dst.close()

        def handle(raw: socket.socket) -> None:
            try:
                tls = ctx.wrap_socket(raw, server_side=True)
                back = socket_in(inet)
                back.connect((INET_SOCKS, 1080))
            except OSError:
                raw.close()
                return
            threading.Thread(target=pipe, args=(tls, back), daemon=True).start()
            pipe(back, tls)

        def accept() -> None:
            with contextlib.suppress(OSError):
                while True:
                    raw, _ = listener.accept()
                    threading.Thread(target=handle, args=(raw,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return listener

    def stop_process(self, proc: subprocess.Popen[bytes]) -> None:
        proc.terminate()
        proc.wait(5)

    # -- clients inside a slot -------------------------------------------------------------

    def connect(self, slot: rtnet.NetworkSlot, address: str, port: int,
                timeout: float = 10.0) -> socket.socket:
        sock = socket_in(self.guest_ns(slot))
        sock.settimeout(timeout)
        sock.connect((address, port))
        return sock

    def tls(self, slot: rtnet.NetworkSlot, name: str, address: str = INET_SERVER,
            port: int = 443) -> ssl.SSLSocket:
        assert self.certs is not None
        raw = self.connect(slot, address, port)
        try:
            return self.certs.client_context().wrap_socket(raw, server_hostname=name)
        except BaseException:
            raw.close()
            raise

    def proxy_log(self) -> list[dict[str, Any]]:
        path = self.tmp / "egress.log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def http_get(sock: socket.socket, host: str, path: str = "/",
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One keep-alive HTTP/1.1 GET on `sock`; (status, headers, body)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode())
    return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before a response head")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    length = int(headers.get("content-length", "0"))
    chunks = [body]
    have = len(body)
    while have < length:
        chunk = sock.recv(min(1 << 20, length - have))
        if not chunk:
            raise ConnectionError("closed in the middle of a body")
        chunks.append(chunk)
        have += len(chunk)
    return status, headers, b"".join(chunks)
