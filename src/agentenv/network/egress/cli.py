"""The proxy process: `python -m agentenv.network.egress` or `aenv egress-proxy`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import resource
import signal
from ipaddress import IPv4Network

from agentenv import logs
from agentenv.network import dns
from agentenv.network.egress import limits
from agentenv.network.egress.metrics import rss_bytes
from agentenv.network.egress.server import EgressProxyServer
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.egress")

DESCRIPTION = ("The node-wide egress proxy: one process serves every slot's redirected TCP and "
               "the metadata")


def _dns_upstream(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    return dns.system_upstream() if text == "system" else dns.parse_upstream(text)


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run(server: EgressProxyServer) -> None:
    _raise_fd_limit()
    rss_bytes()  # opens its descriptor now
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop)
    try:
        await server.serve_until_stopped()
    finally:
        await server.stop()
        log.info("egress proxy stopped", extra={"event": "stopped"})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="aenv egress-proxy", description=DESCRIPTION)
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--control", required=True, help="unix socket the node controls it on")
    parser.add_argument("--port", type=int, required=True, help="TCP port the redirects go to")
    parser.add_argument("--bind", default="0.0.0.0")
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--metrics-bind", default="127.0.0.1")
    parser.add_argument("--open-range", action="append", default=[], type=IPv4Network,
                        help="a walled range to open anyway (a lab's private network)")
    parser.add_argument("--max-connections", type=int, default=limits.MAX_CONNECTIONS)
    parser.add_argument("--max-per-slot", type=int, default=limits.MAX_CONNECTIONS_PER_SLOT,
                        help="a slot's egress connections at most (its fair share of "
                             "--max-connections may be less)")
    parser.add_argument("--max-metadata-per-slot", type=int, default=limits.MAX_METADATA_PER_SLOT)
    parser.add_argument("--idle-timeout", type=float, default=limits.IDLE_TIMEOUT)
    parser.add_argument("--peek-timeout", type=float, default=limits.PEEK_TIMEOUT)
    parser.add_argument("--dns-upstream", default=get_settings().dns_filter_upstream or None,
                        help="serve the filtering resolver (169.254.169.254:53), forwarding "
                             "allowed names to this IPv4[:port], or 'system' (the node's "
                             "resolv.conf); default $AENV_DNS_FILTER_UPSTREAM, else off")
    parser.add_argument("--name-server", default=get_settings().egress_name_server or None,
                        help="IPv4[:port] of the DNS server names are bound with (A queries), "
                             "instead of the node's getaddrinfo; default "
                             "$AENV_EGRESS_NAME_SERVER")
    parser.add_argument("--resolve-ttl", type=float, default=limits.RESOLVE_TTL,
                        help="seconds a name's addresses (getaddrinfo) are kept")
    parser.add_argument("--copy", action="store_true",
                        help="copy bytes through the process instead of splice(2) (to compare)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-max-bytes", type=int, default=limits.LOG_MAX_BYTES,
                        help="bytes of the log (stderr, when a file) and its rotated tail "
                             "<log>.1 kept on disk; 0: no bound")
    parser.add_argument("--log-burst", type=int, default=limits.LOG_BURST,
                        help="lines a slot's refusals, DNS queries and failures write whole in "
                             "each --log-window; the rest are counted in a summary line")
    parser.add_argument("--log-window", type=float, default=limits.LOG_WINDOW, help="seconds")


def server_from_args(args: argparse.Namespace) -> EgressProxyServer:
    return EgressProxyServer(
        args.control, args.port, args.bind, metrics_port=args.metrics_port,
        metrics_bind=args.metrics_bind, open_ranges=tuple(args.open_range),
        max_connections=args.max_connections, max_per_slot=args.max_per_slot,
        max_metadata_per_slot=args.max_metadata_per_slot,
        idle_timeout=args.idle_timeout, peek_timeout=args.peek_timeout, splice=not args.copy,
        resolve_ttl=args.resolve_ttl, dns_upstream=_dns_upstream(args.dns_upstream),
        name_server=dns.parse_upstream(args.name_server) if args.name_server else None,
        log_max_bytes=args.log_max_bytes, log_burst=args.log_burst,
        log_window=args.log_window)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logs.setup(args.log_level)
    asyncio.run(run(server_from_args(args)))
