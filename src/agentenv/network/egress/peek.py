"""Reading what a connection on a web port says before it is decided: a TLS ClientHello's SNI
or an HTTP/1.x request head's Host (at most PEEK_MAX bytes within the peek timeout)."""

from __future__ import annotations

import asyncio
import socket

from agentenv.network import httphead, sni
from agentenv.network.egress.decisions import Refused
from agentenv.network.egress.limits import PEEK_MAX


async def peek(loop: asyncio.AbstractEventLoop, guest: socket.socket,
               timeout: float) -> tuple[bytes, str | None, str]:
    """The first bytes and what they say: (data, name, kind), kind one of tls, http,
    opaque (neither; decided by address) or eof (the client left without a byte)."""
    data = b""
    deadline = loop.time() + timeout
    while True:
        remaining = deadline - loop.time()
        try:
            if remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                chunk = await loop.sock_recv(guest, 16384)
        except TimeoutError:
            if data and (sni.looks_like_tls(data) or httphead.looks_like_http(data)):
                raise Refused("an incomplete TLS hello or HTTP head at the peek timeout") \
                    from None
            return data, None, "opaque"
        if not chunk:
            return data, None, "eof" if not data else "opaque"
        data += chunk
        if sni.looks_like_tls(data):
            try:
                return data, sni.server_name(data), "tls"
            except sni.Incomplete:
                pass
        elif httphead.looks_like_http(data):
            try:
                head = httphead.parse_request_head(data)
            except httphead.Incomplete:
                pass
            except httphead.NotHttp:
                return data, None, "opaque"
            else:
                return data, head.host(), "http"
        else:
            return data, None, "opaque"
        if len(data) > PEEK_MAX:
            raise Refused(f"no complete TLS hello or HTTP head in {PEEK_MAX} bytes")
