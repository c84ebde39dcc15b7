"""The upstream side of an allowed connection: a socket to the original destination, directly
or through the slot's SOCKS5 proxy (plain, or TLS: then streams, relayed here)."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from ipaddress import IPv4Address
from typing import Any

from agentenv.network import httphead, socks5
from agentenv.network.egress.conn import Conn, Tunnel
from agentenv.network.egress.decisions import Refused
from agentenv.network.egress.destinations import Walls
from agentenv.network.egress.limits import COPY_CHUNK
from agentenv.network.egress.metrics import Counters
from agentenv.network.policy import EgressProxy


async def connect(loop: asyncio.AbstractEventLoop, conn: Conn, via: EgressProxy | None,
                  timeout: float, walls: Walls) -> None:
    """Open the upstream, directly or through the SOCKS5 proxy `via` (conn.via): conn.upstream
    (a plain socket) or, through a TLS SOCKS5 proxy, conn.tunnel (streams)."""
    conn.via = via
    async with asyncio.timeout(timeout):
        if via is None:
            conn.upstream = await tcp_connect(loop, str(conn.dst_ip), conn.dst_port)
            return
        proxy_ip = await resolve(loop, via.host)
        if proxy_ip in walls:
            raise Refused(f"egress proxy address {proxy_ip} is behind the walls")
        if not via.tls:
            sock = conn.upstream = await tcp_connect(loop, str(proxy_ip), via.port)

            async def read_exactly(n: int) -> bytes:
                buf = b""
                while len(buf) < n:
                    chunk = await loop.sock_recv(sock, n - len(buf))
                    if not chunk:
                        raise socks5.SocksError("the SOCKS proxy closed the connection")
                    buf += chunk
                return buf

            async def write(data: bytes) -> None:
                await loop.sock_sendall(sock, data)

            await socks5.connect(read_exactly, write, str(conn.dst_ip), conn.dst_port,
                                 via.username, via.password)
            return
        context = ssl.create_default_context(cadata=via.tls_ca_cert) \
            if via.tls_ca_cert else ssl.create_default_context()
        reader, writer = await asyncio.open_connection(
            str(proxy_ip), via.port, ssl=context,
            server_hostname=via.tls_server_name or via.host, limit=COPY_CHUNK)
        conn.transports.append(writer.transport)  # a reset aborts it
        await socks5.connect(reader.readexactly, stream_write(writer), str(conn.dst_ip),
                             conn.dst_port, via.username, via.password)
        conn.tunnel = Tunnel(reader, writer)


async def resolve(loop: asyncio.AbstractEventLoop, host: str) -> IPv4Address:
    try:
        return IPv4Address(host)
    except ValueError:
        pass
    infos = await loop.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host} has no IPv4 address")
    return IPv4Address(infos[0][4][0])


async def tcp_connect(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def stream_write(writer: asyncio.StreamWriter) -> Callable[[bytes], Any]:
    async def write(data: bytes) -> None:
        writer.write(data)
        await writer.drain()
    return write


async def relay_through_tunnel(loop: asyncio.AbstractEventLoop, counters: Counters,
                               conn: Conn, data: bytes,
                               stream: httphead.RequestStream | None,
                               transform: Callable[[bytes], bytes] | None,
                               responses: Callable[[bytes], bytes] | None) -> None:
    """Relay through a TLS connection to the SOCKS5 proxy (streams; the rarer, slower path)."""
    tunnel = conn.tunnel
    assert tunnel is not None
    reader, writer = await asyncio.open_connection(sock=conn.guest, limit=COPY_CHUNK)
    conn.transports.append(writer.transport)
    if stream is not None:
        stream.release = tunnel.writer.write

    async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool) -> None:
        change = transform if up else responses
        while chunk := await src.read(COPY_CHUNK):
            conn.last_active = loop.time()
            if change is not None:
                chunk = change(chunk)
            dst.write(chunk)
            await dst.drain()
            if up:
                counters.bytes_up += len(chunk)
            else:
                counters.bytes_down += len(chunk)
        if dst.can_write_eof():
            dst.write_eof()

    if data:
        tunnel.writer.write(data)
        counters.bytes_up += len(data)
    copies = {loop.create_task(copy(reader, tunnel.writer, True)),
              loop.create_task(copy(tunnel.reader, writer, False))}
    try:
        # Both directions end (half-closes pass on), or the first failure ends both.
        done, _ = await asyncio.wait(copies, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    except Refused as exc:
        conn.refuse(str(exc), exc.kind, exc.fields)
    except httphead.HttpError as exc:
        conn.refuse(str(exc))
    except (OSError, asyncio.CancelledError):
        conn.reset()
    else:
        conn.close()
    finally:
        for task in copies:
            task.cancel()
