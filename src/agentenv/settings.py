"""Every `AENV_*` setting of the host side: its type, default, unit and meaning, in one place.

The components read their configuration through `get_settings()` (or `load(env)` for an
environment of their own), never from `os.environ`: a setting is declared here once, documented
in docs/settings.md (generated from this module: `aenv settings --markdown`), and a variable the
environment sets that nobody declares is reported when a server starts (`warn_unknown`).

When settings are read: at the call, from the environment of that moment. `get_settings()`
keeps one `Settings` per distinct set of `AENV_*` variables, so a component that reads a setting
per request pays a dictionary look-up, and a test that changes a variable with monkeypatch sees
the change at the next read, with no cache to reset.

A value is checked against its type: reading a bad one raises `SettingsError` (a ValueError)
naming the variable and the value, so only the components that read it fail, as each did when
it parsed its own (`aenv settings` lists them all). Settings whose format is richer than a number
(sizes with K/M/G suffixes, percentages, lists of CIDRs) are strings here and parsed by their
component, which names the variable in its errors too.

Guest code (agentenv.guest) imports nothing host-side and reads its few variables itself;
they are listed, with the variables of the scripts and tests, in `ELSEWHERE`, so that they are
known names, not reported as unknown.

This module imports nothing of agentenv: every layer may import it (pyproject.toml,
[tool.importlinter]).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, PrivateAttr, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources import EnvSettingsSource
from pydantic_settings.sources.utils import parse_env_vars

PREFIX = "AENV_"

log = logging.getLogger("agentenv.settings")


def _s(default: Any, component: str, doc: str, unit: str = "", **checks: Any) -> Any:
    """A declared setting: its default, the component reading it, its unit and its meaning."""
    return Field(default, description=doc, json_schema_extra={"component": component,
                                                              "unit": unit}, **checks)


class SettingsError(ValueError):
    """A setting's value does not fit its type; the message names the variable and the value."""


class _Environment(EnvSettingsSource):
    """The AENV_* variables of a given mapping (os.environ or a test's own) instead of always
    os.environ, as pydantic-settings' own source reads."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._given = env
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._given, self.case_sensitive, self.env_ignore_empty,
                              self.env_parse_none_str)


class Settings(BaseSettings):
    """The host side's settings, each from the environment variable AENV_<NAME> (an empty value
    counts as unset). Grouped by the component that reads them."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, env_ignore_empty=True, extra="ignore",
                                      frozen=True, case_sensitive=False)
    #: field -> the error of its bad value (see _load)
    _problems: dict[str, str] = PrivateAttr(default_factory=dict)

    # --- common: state and where things live ------------------------------------------------
    home: Path | None = _s(
        None, "common", "The node's state directory (default /var/lib/aenv; see `state_dir`): "
        "database, secrets, logs, templates, blockd of `make up`.", "path")
    state_dir: Path | None = _s(
        None, "common", "Older name of AENV_HOME, read when AENV_HOME is unset.", "path")
    layer_cache: Path | None = _s(
        None, "template", "The layer cache shared by pulls and conversions (default "
        "<state>/layer-cache).", "path")

    # --- node: API, keys, processes ---------------------------------------------------------
    api_key: str = _s(
        "", "node", "The node's API key (default: <state>/secrets/api-key, made at first "
        "start). `aenv` client commands also take it.")
    domain: str = _s(
        "", "node, gateway", "The domain sandbox hosts are named under ({port}-{id}.{domain}); "
        "`aenv serve --domain`, `aenv gateway --domain`.")
    scheduler: str = _s(
        "", "node, gateway", "host:port of `aenv scheduler` (gRPC); a node without one is "
        "standalone. `--scheduler`.")
    node_id: str = _s("", "node", "The node's id in a cluster (`aenv serve --node-id`).")
    advertise: str = _s(
        "", "node", "host:port the gateway reaches this node at (`aenv serve --advertise`).")
    node_key: str = _s(
        "", "node", "The node's own key, 64 hex digits (`aenv node-key`); the file of "
        "AENV_NODE_KEY_FILE is read first.")
    node_key_file: Path | None = _s(
        None, "node", "File holding the node's key (`aenv serve --node-key-file`).", "path")
    metrics_token: str = _s(
        "", "node", "The metrics token a node of a cluster accepts on /metrics (64 hex digits); "
        "the file of AENV_METRICS_TOKEN_FILE is read first.")
    metrics_token_file: Path | None = _s(
        None, "node", "File holding the metrics token (`aenv serve --metrics-token-file`).",
        "path")
    public_metrics: bool = _s(
        False, "node, gateway", "/metrics answers without a credential "
        "(`--public-metrics`).", "on/off")
    idle_pause_after: int = _s(
        0, "node", "The node's default idlePauseAfter: a sandbox pauses after this long "
        "without traffic (0: off, as E2B). `aenv serve --idle-pause-after`.", "seconds")
    cluster_secret: str = _s(
        "", "scheduler, gateway", "The cluster secret every other key derives from (the file of "
        "`--cluster-secret-file` is read first).")
    allow_process_backend_in_cluster: bool = _s(
        False, "node", "A node of a cluster may run `--backend process` (development only: no "
        "isolation between teams).", "on/off")
    process_backend_host_ports: str = _s(
        "", "node", "Ports of the host (`A-B` ranges, comma-separated) every process-backend "
        "sandbox may reach through the proxy as its own.", "port list")
    test_crash_at: str = _s(
        "", "node", "Fault injection for tests: the node exits at this named point "
        "(node/pauses.py CRASH_POINT_ENV).")
    gc_grace_seconds: float = _s(
        60.0, "node", "Files younger than this are never deleted by the garbage collector.",
        "seconds", ge=0)
    template_files_ttl: float = _s(
        3600.0, "node", "Uploaded build files no build uses are deleted after this.", "seconds",
        ge=0)
    events_retention_days: float = _s(
        7.0, "node, gateway", "Days sandbox events are kept (0: none recorded nor delivered to "
        "webhooks).", "days")
    snapshot_publish: str = _s(
        "", "node", "PREFIX: every template build is published to PREFIX/<team>/<name> (an OCI "
        "repository or dir:///path).")
    snapshot_repository: str = _s(
        "", "gateway, node", "PREFIX: an OCI registry repository prefix the nodes push a "
        "snapshot to (PREFIX/<team>/spill:<id>) and pull it from lazily when a batch from a "
        "snapshot spills over to other nodes, deleted when the team deletes the snapshot ('': "
        "no spill-over; the refused children stay 429). On a node (optional): a team pushes, "
        "pulls and deletes under PREFIX only in PREFIX/<team>/.")
    reclaim_min_age_seconds: int = _s(
        30, "node", "Seconds a guest page sits untouched before the guest gives it back, for "
        "built-in templates and builds naming none (0: keep it).", "seconds")
    vm_code_interpreter: bool = _s(
        True, "node", "Build the code-interpreter-v1 template at first start (0: base only).",
        "on/off")

    # --- node: admission (429/503 before anything is made) ----------------------------------
    max_sandboxes: int = _s(0, "node", "Sandboxes holding a VM at once (0: no limit).", "count")
    cpu_request_ratio: str = _s(
        "14", "node", "The vCPUs of the sandboxes holding a VM may reach ratio x the host's "
        "CPUs.", "ratio")
    node_vcpus: str = _s("", "node", "A fixed vCPU ceiling instead of the ratio's.", "vCPUs")
    memory_request_ratio: str = _s(
        "5", "node", "Guest memory + QEMU overhead of the sandboxes holding a VM may reach "
        "ratio x MemTotal.", "ratio")
    memory_budget_mb: str = _s(
        "", "node", "A fixed memory ceiling instead of the ratio's.", "MiB")
    memory_overcommit: str = _s(
        "", "node", "Gone: a node that has it set refuses to start (the ceiling is "
        "AENV_MEMORY_REQUEST_RATIO).")
    sandbox_overhead_mb: str = _s(
        "", "node", "QEMU's memory counted beside each guest's (default 64 + 64 + 4 per "
        "vCPU).", "MiB")
    memory_reserve_mb: str = _s(
        "256", "node", "429 when MemAvailable, less what starting sandboxes will take, would "
        "fall below it.", "MiB")
    memory_pressure_max: str = _s(
        "10", "node", "429 when PSI memory some avg10 is over it (0: off).", "%")
    cpu_pressure_max: str = _s(
        "90", "node", "429 when PSI cpu some avg10 is over it (0: off).", "%")
    min_free_disk_mb: str = _s(
        "1024", "node", "429 when the state directory's filesystem has less free.", "MiB")
    disk_reserve: str = _s(
        "", "node, blockd", "Bytes kept free on the state filesystem (default 256 MiB): blockd "
        "refuses upper growth into it, pulls and uploads keep it free, admission refuses below "
        "it. `aenv blockd --disk-reserve`.", "bytes")
    team_max_sandboxes: str = _s(
        "100", "node, gateway", "A team's sandboxes at once (0: no limit).", "count")
    team_max_templates: str = _s(
        "100", "node, gateway", "A team's templates (0: no limit).", "count")
    team_max_snapshots: str = _s(
        "500", "node, gateway", "A team's snapshots (0: no limit).", "count")
    team_template_files_mb: str = _s(
        str(16 << 10), "node", "One team's uploaded build files on the node (0: no limit).",
        "MiB")

    # --- node: volumes ----------------------------------------------------------------------
    volume_size_mb: str = _s(
        "1024", "node", "A new volume's size when the request names none.", "MiB")
    volume_max_size_mb: str = _s(
        str(16 << 10), "node", "The largest volume size a request may name.", "MiB")
    volume_max_mounts: str = _s("4", "node", "Volumes one sandbox mounts at most.", "count")
    volume_shared_rw: str = _s(
        "0", "node", "1: offer the 'rw-shared' volume mount mode (shared read-write over NFS); "
        "off by default while its known gaps are open (docs/security.md).", "0/1")

    # --- node: ready pools ------------------------------------------------------------------
    vm_pool_low: str = _s("", "node", "Ready VMs kept per hot template (default 2; 0: off).",
                          "count")
    vm_pool_high: str = _s("", "node", "Ready VMs a busy template's pool grows to (default 4).",
                           "count")
    vm_pool_templates: str = _s("", "node", "Templates pooled at once, base included "
                                "(default 3).", "count")
    vm_pool_idle: str = _s("", "node", "A template without a create for this long loses its "
                           "pool (default 600).", "seconds")

    # --- node: observer, webhooks, template builds ------------------------------------------
    metrics_interval: float = _s(
        5.0, "node", "Sandbox metrics sampling interval (0: off).", "seconds")
    metrics_grace: float = _s(
        600.0, "node", "Metrics and logs of a gone sandbox are kept this long.", "seconds")
    metrics_max_samples: int = _s(2880, "node", "Metric samples kept per sandbox.", "count")
    logs_max_bytes: int = _s(256 << 10, "node", "Log bytes kept per sandbox.", "bytes")
    webhook_queue: int = _s(1000, "node, gateway", "Events queued per webhook.", "count")
    webhook_attempts: int = _s(4, "node, gateway", "Delivery attempts per event.", "count")
    webhook_backoff: float = _s(2.0, "node, gateway", "First retry delay, doubled each time.",
                                "seconds")
    webhook_timeout: float = _s(10.0, "node, gateway", "One delivery's timeout.", "seconds")
    webhook_allow_private: bool = _s(
        False, "node, gateway", "Webhooks may target loopback, link-local and private "
        "addresses.", "on/off")
    template_builds: int = _s(1, "node", "Template builds running at once (at least 1).",
                              "count")
    build_timeout_seconds: str = _s(
        "3600", "node", "A build's running time once it has its slot (0: no limit).", "seconds")
    build_log_tail: str = _s(
        "", "node", "Bytes of a build's log kept, the newest (default 1 MiB, at least 4096).",
        "bytes")
    build_output_tail: str = _s(
        "", "node", "Characters of each RUN step's output kept (default 1 MiB).", "characters")

    # --- node: VM backend ---------------------------------------------------------------------
    vm_assets_dir: Path | None = _s(
        None, "node", "Where the guest assets are built (default the state directory).", "path")
    vm_debian_cache: Path | None = _s(
        None, "node", "debootstrap cache of the base template (default <state>/cache/debian).",
        "path")
    vm_template_cache: Path | None = _s(
        None, "node", "Built-in templates' boot snapshots shared by the nodes of one host: "
        "each is built once per key, and a node that finds one uses it in place (default: "
        "none, every node builds its own).", "path")
    vm_network_prefix: str = _s(
        "aenv", "node", "Prefix of the node's network slots (namespaces, interfaces, nft "
        "tables); two nodes on a host need two.")
    vm_accel: str = _s("auto", "node", "QEMU accelerator: auto, kvm or tcg.")
    vm_first_slot: int = _s(1, "node", "First network slot index (disjoint per runtime on a "
                            "host).", "index", ge=1)
    blockd_socket: Path | None = _s(
        None, "node, blockd", "blockd's control socket (default $AENV_HOME/blockd/blockd.sock; "
        "a node finding none starts a private blockd).", "path")
    blockd_state_dir: Path | None = _s(
        None, "node", "State directory of `make up`'s blockd: the node's supervisor restarts it "
        "with it.", "path")
    blockd_log: Path | None = _s(
        None, "node", "Log of that blockd (default beside its state directory).", "path")
    blockd_pidfile: Path | None = _s(
        None, "node", "Pid file of that blockd (default beside its state directory).", "path")
    blockd_wait: float = _s(
        15.0, "node", "Creates wait this long for a down blockd, then answer 503.", "seconds")
    egress_proxy: bool = _s(
        True, "node", "Run the egress proxy (0: no metadata service, names in policies cannot "
        "be allowed).", "on/off")
    egress_proxy_port: int = _s(0, "node", "The egress proxy's port on the host (0: any free "
                                "one).", "port")
    nfs_port: int = _s(0, "node", "The port of the node's NFS server (shared read-write "
                       "volumes) on the host, below 1024 (0: the first free one from 1023 "
                       "down, kept in <state>/nfs/port for every later start); only guests' "
                       "redirected connections reach it.", "port")
    net_open_ranges: str = _s(
        "", "node", "Private CIDRs (comma-separated) guests may reach, under each policy.",
        "CIDR list")
    net_wall_ranges: str = _s(
        "", "node", "CIDRs (comma-separated) guests never reach, besides the uplink's "
        "networks.", "CIDR list")
    dns_filter_upstream: str = _s(
        "", "node", "`system` or IP[:port]: the egress proxy also serves a filtering resolver at "
        "169.254.169.254:53.")
    egress_name_server: str = _s(
        "", "node", "IP[:port] of the DNS server names in policies are bound with (default the "
        "node's getaddrinfo).")

    # --- runtime: QEMU, privilege and limits (RuntimeConfig fields) -------------------------
    qemu_user: str = _s("", "runtime", "User QEMU runs as (default aenv-vm; root: none).")
    qemu_sandbox: str = _s("", "runtime", "QEMU's own seccomp sandbox (0: off).", "on/off")
    qemu_jail: str = _s("", "runtime", "Jail each QEMU (0: off).", "on/off")
    vm_uid_range: str = _s("", "runtime", "uids leased to jailed QEMUs (default "
                           "200000-265535).", "range")
    cgroups: str = _s("", "runtime", "auto (default), on or off.")
    cgroup_parent: str = _s("", "runtime", "cgroup the VMs' cgroups go under.", "path")
    vm_memory_overhead_mb: str = _s("", "runtime", "Memory limit beside the guest's.", "MiB")
    cpu_weight_per_vcpu: str = _s("", "runtime", "cgroup CPU weight per vCPU thread (100).",
                                  "weight")
    cpu_max_per_vcpu: str = _s("", "runtime", "CPU cap per vCPU (1; 0: none).", "CPUs")
    qemu_pids_max: str = _s("", "runtime", "Tasks per QEMU (512).", "count")
    io_read_bps: str = _s("", "runtime", "QEMU's read throttle on the state device.", "bytes/s")
    io_write_bps: str = _s("", "runtime", "QEMU's write throttle on the state device.",
                           "bytes/s")
    io_read_iops: str = _s("", "runtime", "QEMU's read IOPS throttle.", "IOPS")
    io_write_iops: str = _s("", "runtime", "QEMU's write IOPS throttle.", "IOPS")
    memory_device: str = _s("", "runtime", "Guest memory from blockd's shared memory device "
                            "(default) or `file`.")
    memory_prefetch: str = _s("", "runtime", "Prefetch a snapshot's startup pages (0: off).",
                              "on/off")
    disk_bus: str = _s("", "runtime", "The writable disk's bus: virtio-scsi (node default) or "
                       "virtio-blk.")
    guest_dns: str = _s("", "runtime", "Resolver written into guests (default 8.8.8.8; none: "
                        "keep the image's).")
    serial_log_max_bytes: str = _s("", "runtime", "A VM's serial log size (4 MiB; 0: no cap).",
                                   "bytes")
    slot_rate_mbit: str = _s("", "runtime", "Each sandbox's bandwidth each way (0: not "
                             "shaped).", "Mbit/s")
    slot_max_flows: str = _s("", "runtime", "Live flows per sandbox (4096; 0: none).", "count")
    qemu_max_file_bytes: str = _s("", "runtime", "Largest file QEMU may write (64 MiB).",
                                  "bytes")
    qemu_max_open_files: str = _s("", "runtime", "QEMU's descriptors (4096).", "count")

    # --- relay: the node's proxy and the gateway ---------------------------------------------
    proxy_max_head_bytes: str = _s("", "node, gateway", "Request line and headers (65536; "
                                   "431 above).", "bytes")
    proxy_head_timeout: str = _s("", "node, gateway", "Time to send a request head (30; 0: "
                                 "none).", "seconds")
    proxy_max_body_bytes: str = _s("", "node, gateway", "One proxied request body (16 GiB).",
                                   "bytes")
    proxy_idle_timeout: str = _s("", "node, gateway", "No byte either way for this long ends "
                                 "an exchange (600).", "seconds")
    proxy_total_timeout: str = _s("", "node, gateway", "One exchange's whole time (86400; 0: "
                                  "none).", "seconds")
    proxy_max_connections: str = _s("", "node, gateway", "Proxied requests and WebSockets per "
                                    "sandbox (512).", "count")
    proxy_max_websockets: str = _s("", "node, gateway", "Proxied WebSockets per sandbox (128).",
                                   "count")
    proxy_connect_timeout: str = _s("", "node, gateway", "Connecting to a sandbox (5).",
                                    "seconds")
    proxy_max_ws_message_bytes: str = _s("", "node, gateway", "One WebSocket message (16 MiB; "
                                         "close 1009 above).", "bytes")
    envd_max_reply_bytes: str = _s("", "node", "What the node reads of one envd answer or "
                                   "Connect message (4 MiB).", "bytes")
    max_concurrent_requests: str = _s("4096", "node, gateway", "Requests and WebSockets served "
                                      "at once (0: no cap; 503 above).", "count")
    idle_connections_per_client: str = _s("256", "node, gateway", "A client address's idle "
                                          "connections (0: no bound).", "count")
    stalled_connections_per_client: str = _s("256", "node, gateway", "A client address's "
                                             "stalled connections (0: no bound).", "count")
    send_timeout: str = _s("60", "node, gateway", "A client taking nothing of its answers for "
                           "this long is cut (0: none).", "seconds")
    body_timeout: str = _s("60", "node, gateway", "A request body that brings no byte for "
                           "this long while it is read gets 408 (0: none).", "seconds")
    body_connections_per_client: str = _s("256", "node, gateway", "A client address's "
                                          "connections whose request body is still arriving "
                                          "(0: no bound; past it, 429); relayed by a trusted "
                                          "proxy or a node's gateway: the client it names.",
                                          "count")
    max_connections: str = _s("", "node, gateway", "Open connections (default half the "
                              "open-file limit, at most 16384; 0: no bound).", "count")
    tls_handshake_timeout: str = _s("10", "node", "A TLS handshake not done by then ends the "
                                    "connection (0: asyncio's 60).", "seconds")
    trusted_proxies: str = _s("", "node, gateway", "Proxies (addresses/CIDRs, comma-separated) "
                              "whose X-Forwarded-For names the client; not bounded as one "
                              "client (a node: its gateways).", "CIDR list")
    node_tls_cert: str = _s("", "node", "The node's API serves TLS with this certificate "
                            "(PEM).", "path")
    node_tls_key: str = _s("", "node", "The key of AENV_NODE_TLS_CERT (PEM).", "path")
    node_tls_ca: str = _s("", "node, gateway", "CA of the nodes' certificates: the gateway "
                          "speaks TLS to nodes.", "path")

    # --- gateway ----------------------------------------------------------------------------
    control_body_seconds: str = _s("60", "gateway", "Time a control request's body may take "
                                   "(0.1-3600; 408 after).", "seconds")
    gateway_create_lease: str = _s("", "gateway", "Lease of a create's idempotency key "
                                   "(1-300).", "seconds")
    gateway_events_poll: str = _s("1", "gateway", "Look of an idle webhook worker no wake "
                                  "reached; lease renewals at most this far apart (0.05-60).",
                                  "seconds")
    gateway_events_lease: str = _s("15", "gateway", "Lease of a node's event collector and of a "
                                   "webhook worker (1-300).",
                                   "seconds")
    team_max_concurrent_requests: str = _s("", "gateway", "One team's requests in progress "
                                           "(default a quarter of the cap; 0: no share).",
                                           "count")
    signed_lookup_rate: str = _s("20", "gateway", "A client address's signed-URL owner "
                                 "lookups (0: off).", "per second")
    signed_lookup_burst: str = _s("40", "gateway", "Burst of those lookups.", "count")
    unknown_sandbox_rate: str = _s("20", "gateway", "A client address's sandbox traffic "
                                   "lookups that find no sandbox (0: off).", "per second")
    unknown_sandbox_burst: str = _s("40", "gateway", "Burst of those lookups.", "count")
    redis_url: str = _s("", "gateway, scheduler", "Redis of the cluster (default "
                        "redis://127.0.0.1:6379/0).", "URL")
    redis_user: str = _s("", "gateway, scheduler", "Redis ACL user (default Redis's "
                         "`default`).")
    redis_password_file: Path | None = _s(None, "gateway, scheduler", "File holding that "
                                          "user's password.", "path")

    # --- scheduler ----------------------------------------------------------------------------
    scheduler_tls_cert: str = _s("", "scheduler", "The scheduler serves TLS with this "
                                 "certificate (PEM).", "path")
    scheduler_tls_key: str = _s("", "scheduler", "Its key (PEM).", "path")
    scheduler_tls_client_ca: str = _s("", "scheduler", "mTLS: clients show a certificate this "
                                      "CA signed.", "path")
    scheduler_tls_ca: str = _s("", "node, gateway", "TLS to the scheduler, whose certificate "
                               "this CA signed.", "path")
    scheduler_tls_client_cert: str = _s("", "node, gateway", "Client certificate for mTLS.",
                                        "path")
    scheduler_tls_client_key: str = _s("", "node, gateway", "Its key.", "path")
    scheduler_tls_server_name: str = _s("", "node, gateway", "Name the scheduler's certificate "
                                        "is checked against (default the target's host).")
    scheduler_metrics_bind: str = _s("", "scheduler", "Address of the scheduler's metrics "
                                     "port.")
    k8s_service: str = _s("", "scheduler", "NAMESPACE/NAME of the headless Service whose "
                          "EndpointSlices list the nodes.")

    # --- blockd -----------------------------------------------------------------------------
    blockd_native: str = _s("1", "blockd", "Serve NBD from the native core (0: the Python "
                            "path).", "on/off")
    blockd_metrics_bind: str = _s("127.0.0.1", "blockd", "Address of blockd's "
                                  "--metrics-port.")
    disk_upper_limit: str = _s("25%", "blockd", "A writable disk's chain cap: bytes (K/M/G/T) or "
                               "N% of the state filesystem (0: none).", "bytes or %")
    chunk_cache_dir: Path | None = _s(None, "blockd", "The chunk cache (default "
                                      "<blockd state>/chunk-cache).", "path")
    chunk_cache_size: str = _s("10G", "blockd", "Chunk cache capacity (K/M/G/T).", "bytes")
    chunk_cache_eviction: str = _s("2q", "blockd", "Chunk cache eviction: 2q or lru.")
    chunk_size: str = _s(str(1 << 20), "blockd", "Remote layers' chunk size.", "bytes")
    remote_timeout: float = _s(30.0, "blockd", "A remote read nobody serves fails with EIO "
                               "after this.", "seconds")
    remote_background_bw: str = _s("32M", "blockd", "Bandwidth of background fetches.",
                                   "bytes/s")
    peers: str = _s("", "blockd", "http://host:port of other nodes' chunk servers, "
                    "comma-separated.", "URL list")
    p2p_listen: str = _s("", "blockd", "host:port to serve verified chunks to peers on.")
    peer_trust_file: Path | None = _s(None, "blockd", "Static peers: the nodes served, one a "
                                      "line, `<node id> ed25519:<key> [http://host:port]` "
                                      "(`aenv peer-key` prints a node's).", "path")
    peer_node_id: str = _s("", "blockd", "This node's id in its static peers' trust files "
                           "(default node-<20 hex digits of its public key's SHA-256>).")
    peer_key: str = _s("", "blockd", "Removed (the shared peer key): set, blockd refuses to "
                       "start; see AENV_PEER_TRUST_FILE.")
    peer_key_file: Path | None = _s(None, "blockd", "Removed, as AENV_PEER_KEY.", "path")
    memory_chunk_cache_size: str = _s("", "blockd", "memfs's chunk cache capacity (default "
                                      "the chunk cache's).", "bytes")
    private_chunk_cache: int = _s(1 << 30, "blockd", "Capacity of a private chunk cache (no "
                                  "shared one configured).", "bytes")

    # --- template: pulls and registries -------------------------------------------------------
    layer_max_uncompressed_bytes: str = _s(
        str(16 << 30), "template", "A pulled layer's uncompressed size (0: no limit).", "bytes")
    registry_allow_private: str = _s(
        "", "template", "`host` or `host:port` list: registries reachable on loopback, "
        "link-local or private addresses.", "host list")
    insecure_registries: str = _s(
        "", "template", "Registries (host[:port], comma-separated) pulled over unverified "
        "TLS.", "host list")

    @classmethod
    def settings_customise_sources(
            cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Only what load() passes in: its mapping's variables, already picked (no .env file).
        return (init_settings,)

    def __getattr__(self, name: str) -> Any:
        # Reached for a field only when its value was bad (see _load).
        problem = (self.__pydantic_private__ or {}).get("_problems", {}).get(name)
        if problem:
            raise SettingsError(problem)
        return super().__getattr__(name)  # type: ignore[misc]

    def problems(self) -> list[str]:
        """The errors of the values that do not fit their type (each raised when read)."""
        return list(self._problems.values())

    @property
    def state_home(self) -> Path:
        """The state directory: AENV_HOME, else the older AENV_STATE_DIR, else /var/lib/aenv."""
        return self.home or self.state_dir or Path("/var/lib/aenv")


#: Variables read outside this module: by the guest (which imports nothing host-side), the
#: scripts and Makefile, tests and benches. Known names, so never reported as unknown.
ELSEWHERE: dict[str, str] = {
    "AENV_ENVD_SHELL_FALLBACK": "guest: envd's shell when the image has none (guest/init/init)",
    "AENV_ENVD_PATH": "guest: envd's PATH for commands (guest/envd/server.py)",
    "AENV_ENVD_BUSYBOX": "guest: the busybox envd runs tools with (guest/envd/server.py)",
    "AENV_CONTROL_FD": "guest: the code interpreter's kernel control descriptor",
    "AENV_RAM_FILE": "QEMU's environment: the RAM file it opens read-only (runtime/_ramopen.c)",
    "AENV_HOST": "scripts/up.sh: the node's listen address (127.0.0.1)",
    "AENV_PORT": "scripts/up.sh: the node's port (8000)",
    "AENV_LOG_DIR": "scripts/up.sh: logs (<state>/logs)",
    "AENV_UP_TIMEOUT": "scripts/up.sh, cluster-up.sh: seconds to wait for the node(s) (1800)",
    "AENV_DOWN_TIMEOUT": "scripts/down.sh, cluster-down.sh: seconds to pause sandboxes (300)",
    "AENV_CLUSTER_DIR": "scripts/cluster-*.sh: the cluster's state (/var/lib/aenv-cluster)",
    "AENV_CLUSTER_NET": "scripts/cluster-up.sh: first three octets of the nodes' /24 (10.213.0)",
    "AENV_CLUSTER_TEAM": "scripts/cluster-up.sh: the team of the printed key (default)",
    "AENV_CLUSTER_STRATEGY": "scripts/cluster-up.sh: the scheduler's placement (cache-aware)",
    "AENV_CLUSTER_REDIS_PORT": "scripts/cluster-up.sh: Redis's port (6390)",
    "AENV_GATEWAY_PORT": "scripts/cluster-up.sh: the gateway's port (8080)",
    "AENV_TEST_K8S_SERVICE": "tests: NS/NAME of a reachable Kubernetes Service",
    "AENV_TEST_GUEST_STATE": "tests: where the test guest assets are kept",
    "AENV_TEST_GUEST_CACHE": "tests: cache of the test guest",
    "AENV_TEST_CACHE": "tests: cache of downloads",
    "AENV_TEST_JAIL_CANARY": "tests: the jail test's canary",
    "AENV_OPENAPI_EXAMPLES": "tests: examples per operation of the OpenAPI fuzz test",
    "AENV_OPENAPI_CREATE_EXAMPLES": "tests: examples of the create operation",
    "AENV_GATEWAY_OPENAPI_EXAMPLES": "tests: examples per operation against the gateway",
    "AENV_TS_MODULES": "tests: node_modules of the TypeScript SDK test",
    "AENV_BENCH_KEEP": "benches: keep the bench's state directory",
}


def env_name(field: str) -> str:
    return PREFIX + field.upper()


def declared() -> dict[str, Any]:
    """Environment variable -> its field info, in declaration order."""
    return {env_name(name): info for name, info in Settings.model_fields.items()}


def known_names() -> set[str]:
    return set(declared()) | set(ELSEWHERE)


_KIND = {"int_parsing": "a whole number", "float_parsing": "a number",
         "bool_parsing": "on or off (1/0, true/false, yes/no, on/off)"}


def _error(exc: ValidationError, given: Mapping[str, str], item: Any) -> SettingsError:
    name = env_name(str(item["loc"][0]))
    raw = given.get(name, "")
    if item["type"] in _KIND:
        return SettingsError(f"{name}={raw!r} is not {_KIND[item['type']]}")
    return SettingsError(f"{name}={raw!r}: {item['msg']}")


@lru_cache(maxsize=16)
def _load(items: tuple[tuple[str, str], ...]) -> Settings:
    given = dict(items)
    fields = Settings.model_fields
    values = {name.removeprefix(PREFIX).lower(): value for name, value in items
              if name.removeprefix(PREFIX).lower() in fields}
    try:
        return Settings(**values)
    except ValidationError as exc:
        # Only the components reading a bad value fail (as when each parsed its own): the
        # others get their settings; reading the bad one raises SettingsError naming it.
        problems = {str(item["loc"][0]): str(_error(exc, given, item)) for item in exc.errors()}
        settings = Settings(**{k: v for k, v in values.items() if k not in problems})
        for name in problems:
            del settings.__dict__[name]  # so that reading it reaches Settings.__getattr__
        settings._problems.update(problems)
        return settings


def load(env: Mapping[str, str] | None = None) -> Settings:
    """The settings of `env` (default: the process environment at this moment). Empty values
    count as unset; a value that does not fit its type raises SettingsError naming it."""
    env = os.environ if env is None else env
    return _load(tuple(sorted((k, v) for k, v in env.items()
                              if k.startswith(PREFIX) and v.strip())))


def get_settings() -> Settings:
    """The settings of the process environment, read now (cached per distinct set of values)."""
    return load()


def setting_text(name: str, env: Mapping[str, str] | None = None) -> str:
    """The setting `name` (its variable, AENV_...) as text, "" when unset and without default:
    for components that parse a richer format than the field's type and name the variable in
    their own errors."""
    value = getattr(load(env), name.removeprefix(PREFIX).lower())
    return "" if value is None else str(value)


def unknown(env: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """(variable, the closest known name or None) for each AENV_* variable of `env` that no
    component declares: a typo, or a setting that was renamed or removed."""
    env = os.environ if env is None else env
    names = known_names()
    return [(name, next(iter(difflib.get_close_matches(name, names, n=1, cutoff=0.6)), None))
            for name in sorted(env) if name.startswith(PREFIX) and name not in names]


def warn_unknown(component: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Log one warning per unknown AENV_* variable (a server calls it as it starts); the names."""
    found = unknown(env)
    for name, closest in found:
        log.warning("unknown setting %s%s", name,
                    f" (did you mean {closest}?)" if closest else "",
                    extra={"setting": name, "closest": closest, "component": component})
    return [name for name, _ in found]


def markdown() -> str:
    """docs/settings.md: every setting by component, generated from this module."""
    lines = [
        "# Settings",
        "",
        "<!-- Generated from src/agentenv/settings.py by `aenv settings --markdown > "
        "docs/settings.md`;",
        "     tests/test_settings.py fails when it is not current. Do not edit by hand. -->",
        "",
        "Every component reads its `AENV_*` environment variables through one module, "
        "`agentenv.settings`.",
        "An empty value counts as unset. A server reports, as it starts, every `AENV_*` "
        "variable of its",
        "environment that none declares (a structured warning naming it and the closest "
        "known name).",
        "Command-line options, where a command has one, win over the variable.",
        "",
    ]
    groups: dict[str, list[str]] = {}
    for name, info in declared().items():
        extra = info.json_schema_extra or {}
        assert isinstance(extra, dict)
        component = str(extra["component"])
        default = info.default
        shown = "unset" if default in (None, "") else (
            ("on" if default else "off") if isinstance(default, bool) else f"`{default}`")
        unit = str(extra.get("unit") or "")
        doc = (info.description or "").replace("|", "\\|")
        groups.setdefault(component.split(",")[0], []).append(
            f"| `{name}` | {shown} | {unit} | {component} | {doc} |")
    for group in sorted(groups):
        lines += [f"## {group}", "", "| variable | default | unit | read by | what it does |",
                  "|---|---|---|---|---|", *groups[group], ""]
    lines += ["## Read elsewhere", "",
              "Not read through `agentenv.settings`: by the guest (which imports nothing of the "
              "host side), the scripts, tests and benches. Known names: never reported as "
              "unknown.", "", "| variable | read by |", "|---|---|"]
    lines += [f"| `{name}` | {what} |" for name, what in sorted(ELSEWHERE.items())]
    return "\n".join(lines) + "\n"
