"""What the egress proxy counts (Counters, every event, however few are logged) and its
Prometheus text (`GET /metrics` on --metrics-port)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Counters:
    accepted: int = 0
    allowed: int = 0
    denied: int = 0
    denied_name_address: int = 0  # a name allowed, but the destination is not one of its addresses
    denied_unnamed: int = 0  # on a web port without a readable name (no SNI, no Host)
    unknown_source: int = 0
    over_capacity: int = 0
    upstream_failed: int = 0
    cut_by_update: int = 0
    idle_closed: int = 0
    evicted: int = 0  # closed because its slot held more than its share and another needed one
    metadata_requests: int = 0
    dns_answered: int = 0  # forwarded to the upstream resolver and answered
    dns_refused: int = 0  # a name the policy does not let the sandbox resolve
    dns_failed: int = 0  # malformed, over the slot's cap, or the upstream did not answer
    bytes_up: int = 0  # guest -> destination
    bytes_down: int = 0



_statm_fd = -1


def rss_bytes() -> int:
    """Resident set size, from a descriptor kept open (ping must answer when out of them)."""
    global _statm_fd
    if _statm_fd < 0:
        _statm_fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
    return int(os.pread(_statm_fd, 128, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")


def metrics_text(c: Counters, slots: int, connections: int, metadata_connections: int) -> str:
    lines = [
        "# TYPE aenv_egress_slots gauge", f"aenv_egress_slots {slots}",
        "# TYPE aenv_egress_connections gauge", f"aenv_egress_connections {connections}",
        "# TYPE aenv_egress_metadata_connections gauge",
        f"aenv_egress_metadata_connections {metadata_connections}",
        "# TYPE aenv_egress_rss_bytes gauge", f"aenv_egress_rss_bytes {rss_bytes()}",
        "# TYPE aenv_egress_connections_total counter",
    ]
    for verdict in ("allowed", "denied", "denied_name_address", "denied_unnamed",
                    "unknown_source", "over_capacity",
                    "upstream_failed", "cut_by_update", "idle_closed", "evicted"):
        lines.append(f'aenv_egress_connections_total{{verdict="{verdict}"}} '
                     f"{getattr(c, verdict)}")
    lines.append("# TYPE aenv_egress_dns_queries_total counter")
    for verdict in ("answered", "refused", "failed"):
        lines.append(f'aenv_egress_dns_queries_total{{verdict="{verdict}"}} '
                     f"{getattr(c, 'dns_' + verdict)}")
    lines += [
        "# TYPE aenv_egress_metadata_requests_total counter",
        f"aenv_egress_metadata_requests_total {c.metadata_requests}",
        "# TYPE aenv_egress_bytes_total counter",
        f'aenv_egress_bytes_total{{direction="up"}} {c.bytes_up}',
        f'aenv_egress_bytes_total{{direction="down"}} {c.bytes_down}',
    ]
    return "\n".join(lines) + "\n"


async def serve_metrics_client(text: Callable[[], str], reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> None:
    """One scrape: `text` answers GET /metrics, anything else is a 404."""
    try:
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
        ok = head.startswith(b"GET /metrics ")
        body = text().encode() if ok else b"not found\n"
        status = "200 OK" if ok else "404 Not Found"
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                     + body)
        await writer.drain()
    except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()
