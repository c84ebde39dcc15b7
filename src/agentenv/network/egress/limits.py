"""The egress proxy's numbers (defaults of its flags, caps) and the node services it answers
itself."""

from __future__ import annotations

from ipaddress import IPv4Address

from agentenv.network import dns, metadata

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
PEEK_TIMEOUT = 10.0
PEEK_MAX = 64 << 10
CONNECT_TIMEOUT = 10.0
IDLE_TIMEOUT = 900.0
RESOLVE_TTL = 30.0
MAX_CONNECTIONS = 8192
MAX_CONNECTIONS_PER_SLOT = 1024
MIN_SLOT_SHARE = 8  # a slot's share of max_connections never falls below this
MAX_METADATA_PER_SLOT = 16
COPY_CHUNK = 256 << 10
CONTROL_LINE_MAX = 64 << 20
#: bytes of the log (this process's stderr, when a file) and its rotated tail kept on disk
LOG_MAX_BYTES = 16 << 20
LOG_CHECK_INTERVAL = 1.0
#: per slot: lines written whole in each window of seconds (the rest counted, summarized)
LOG_BURST, LOG_WINDOW = 20, 60.0

METADATA = (IPv4Address(metadata.METADATA_ADDRESS), metadata.METADATA_PORT)
RESOLVER = (IPv4Address(metadata.METADATA_ADDRESS), dns.DNS_PORT)  # the filtering resolver
NODE_SERVICES = (METADATA, RESOLVER)  # answered here, with caps apart from egress
MAX_DNS_INFLIGHT_PER_SLOT = 64
MAX_LOOKUPS_PER_SLOT = 8
