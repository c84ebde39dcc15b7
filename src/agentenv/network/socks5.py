"""The client side of SOCKS5 (RFC 1928) CONNECT by IPv4 address, with username/password
authentication (RFC 1929): how the egress proxy tunnels a sandbox's TCP through its
`egress_proxy`. Transport-agnostic: the caller gives an exact-read and a write coroutine (a plain
socket or a TLS stream to the proxy)."""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable

ReadExactly = Callable[[int], Awaitable[bytes]]
Write = Callable[[bytes], Awaitable[None]]

_REPLIES = {
    1: "general SOCKS server failure",
    2: "connection not allowed by ruleset",
    3: "network unreachable",
    4: "host unreachable",
    5: "connection refused",
    6: "TTL expired",
    7: "command not supported",
    8: "address type not supported",
}


class SocksError(ConnectionError):
    """The SOCKS5 proxy refused, failed or spoke something else; the message says which."""


async def connect(read_exactly: ReadExactly, write: Write, address: str, port: int,
                  username: str | None = None, password: str | None = None) -> None:
    """Ask the proxy at the other end to CONNECT to address:port; returns when the tunnel is
    open (the next bytes are the destination's). Raises SocksError."""
    methods = b"\x00\x02" if username is not None else b"\x00"
    await write(b"\x05" + bytes([len(methods)]) + methods)
    version, method = await read_exactly(2)
    if version != 5:
        raise SocksError(f"SOCKS proxy answered version {version}, not 5")
    if method == 0x02:
        if username is None:
            raise SocksError("SOCKS proxy chose username/password auth we did not offer")
        user, pw = username.encode(), (password or "").encode()
        if len(user) > 255 or len(pw) > 255:
            raise SocksError("SOCKS username or password longer than 255 bytes")
        await write(b"\x01" + bytes([len(user)]) + user + bytes([len(pw)]) + pw)
        _, status = await read_exactly(2)
        if status != 0:
            raise SocksError("SOCKS proxy rejected the username/password")
    elif method == 0xFF:
        raise SocksError("SOCKS proxy accepts none of our auth methods"
                         + ("" if username is not None else " (it may need a username)"))
    elif method != 0x00:
        raise SocksError(f"SOCKS proxy chose auth method {method} we did not offer")
    ip = ipaddress.IPv4Address(address)
    await write(b"\x05\x01\x00\x01" + ip.packed + port.to_bytes(2, "big"))
    version, reply, _, atyp = await read_exactly(4)
    if version != 5:
        raise SocksError(f"SOCKS proxy answered version {version}, not 5")
    # The bound address follows, whatever the reply; read it so the stream stays framed.
    if atyp == 1:
        await read_exactly(4 + 2)
    elif atyp == 4:
        await read_exactly(16 + 2)
    elif atyp == 3:
        (length,) = await read_exactly(1)
        await read_exactly(length + 2)
    else:
        raise SocksError(f"SOCKS proxy answered address type {atyp}")
    if reply != 0:
        raise SocksError(f"SOCKS CONNECT {address}:{port}: "
                         f"{_REPLIES.get(reply, f'reply code {reply}')}")
