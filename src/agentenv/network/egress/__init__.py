"""The node-wide egress proxy: one process serves every slot's redirected TCP and the metadata
service (169.254.169.254:80).

How traffic reaches it: on the host, nftables redirects (prerouting, from the slots' host-side
veths) TCP to the metadata address, TCP 80/443 of slots whose policy reads names
(`proxied_ports == "web"`) and all TCP of slots with a SOCKS5 `egress_proxy` ("all") to this
process's port. A connection's source address is the slot's guest_address (the node says which
sandbox that is over the control socket, control.py); its original destination comes from
SO_ORIGINAL_DST.

Per connection:
- unknown source, over the connection caps, or a destination behind the walls (private ranges,
  loopback, link-local, multicast, an address of this host): reset at once;
- 169.254.169.254:80: the metadata service answers that slot's identity (metadata.py);
- else, on ports 80/443 only, the first bytes are read (at most PEEK_MAX, PEEK_TIMEOUT): a TLS
  ClientHello gives the SNI, an HTTP/1.x request head the Host; other ports are decided by
  address alone (a server-speaks-first protocol would wait forever for a client byte);
- `policy.decide(address, port, name)` decides; a name that decides it must resolve to the
  destination here (NameAnswers: the node's getaddrinfo), and on 80/443 a connection without
  a readable name follows the unnamed rule. Denied: reset (SO_LINGER 0), one log line with
  the reason, counted.
  Header `rules` are for plain HTTP only (a policy whose rules would cover HTTPS is refused
  by policy.py: the headers cannot be set without decrypting), so TLS is never transformed;
- allowed: a connection to the original destination, directly or through the slot's SOCKS5
  proxy (fail closed: no tunnel, no connection), the read bytes sent unchanged, then bytes are
  copied both ways unchanged. On plain HTTP every request head on the connection is checked
  again (a keep-alive connection may ask another Host) and gets the rules' headers.
A `set` that changes a slot's policy resets every live connection of that slot the new policy
denies (or whose SOCKS5 route changed); `remove` resets all of them.

With --dns-upstream it is also the filtering resolver at 169.254.169.254:53 (dns.py).

Run it as `python -m agentenv.network.egress --control SOCK --port PORT` (what process.py

The package, one module a concern: server.py (the listener, the slot table, a connection's
path), decisions.py (what the policy says, Refused), names.py (a name's addresses here),
destinations.py (SO_ORIGINAL_DST, the walls), peek.py (SNI, Host), upstream.py (direct or
SOCKS5), pumps.py (copy or splice), conn.py (a connection, a slot), shares.py (fair shares of
the caps), resolver.py (the filtering resolver), commands.py (the control socket), metrics.py
(counters, Prometheus text), limits.py (numbers), cli.py (the process).
"""

from agentenv.network.egress.cli import add_arguments, main, parse_args, run, server_from_args
from agentenv.network.egress.conn import Conn, Slot
from agentenv.network.egress.decisions import Refused
from agentenv.network.egress.destinations import original_destination
from agentenv.network.egress.limits import (
    CONNECT_TIMEOUT,
    IDLE_TIMEOUT,
    LOG_BURST,
    LOG_MAX_BYTES,
    LOG_WINDOW,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_SLOT,
    MAX_METADATA_PER_SLOT,
    PEEK_MAX,
    PEEK_TIMEOUT,
    RESOLVE_TTL,
)
from agentenv.network.egress.metrics import Counters, rss_bytes
from agentenv.network.egress.names import NameAnswers
from agentenv.network.egress.server import EgressProxyServer

__all__ = [
    "CONNECT_TIMEOUT", "IDLE_TIMEOUT", "LOG_BURST", "LOG_MAX_BYTES", "LOG_WINDOW",
    "MAX_CONNECTIONS", "MAX_CONNECTIONS_PER_SLOT", "MAX_METADATA_PER_SLOT", "PEEK_MAX",
    "PEEK_TIMEOUT", "RESOLVE_TTL", "Conn", "Counters", "EgressProxyServer", "NameAnswers",
    "Refused", "Slot", "add_arguments", "main", "original_destination", "parse_args", "rss_bytes",
    "run", "server_from_args",
]
