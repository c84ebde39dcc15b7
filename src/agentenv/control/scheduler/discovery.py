"""Node discovery: a static list (flags or a file), and the EndpointSlices of a headless Service.

Self-registration needs nothing here: any node that heartbeats is registered (unless
`--no-self-registration`). Discovery adds what heartbeats cannot say: the nodes that should be
there (a listed node that never heartbeats shows as down, "never heard from"), and, on
Kubernetes, a node pod that is not ready or is gone is down at once, before its heartbeats stop.

Static entries are `ID=HOST:PORT` or `HOST:PORT` (then the id is `HOST:PORT`); the node must
heartbeat with the same `--node-id`. A nodes file has one entry per line, `#` comments; it is
re-read when it changes.

Kubernetes: the slices labelled `kubernetes.io/service-name=NAME` in NAMESPACE are listed and
watched (lightkube; in-cluster service account or ~/.kube/config). Each endpoint is a node: its
id is the endpoint's `nodeName` (the node's default `--node-id` is the host name, which is the
Kubernetes node name for a host-network DaemonSet pod), else its `targetRef` name, else its
address; its address is the first address with the slice's `http` port (else its first port).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from agentenv.errors import AgentEnvError

log = logging.getLogger("agentenv.control.scheduler.discovery")

ENTRY_RE = re.compile(
    r"(?:(?P<id>[A-Za-z0-9][A-Za-z0-9._:-]{0,127})=)?"
    r"(?P<address>(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5})"
)
SERVICE_RE = re.compile(r"(?P<ns>[a-z0-9]([-a-z0-9]*[a-z0-9])?)/(?P<name>[a-z0-9]([-a-z0-9]*[a-z0-9])?)")
FILE_POLL_S = 5.0


class Registry(Protocol):
    def set_discovered(self, source: str, nodes: Mapping[str, tuple[str, bool]]) -> None: ...


def parse_entries(entries: Iterable[str], where: str) -> dict[str, tuple[str, bool]]:
    """`ID=HOST:PORT` / `HOST:PORT` entries -> node id -> (address, ready)."""
    nodes: dict[str, tuple[str, bool]] = {}
    for raw in entries:
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        for part in entry.split(","):
            part = part.strip()
            if not part:
                continue
            match = ENTRY_RE.fullmatch(part)
            if not match:
                raise AgentEnvError(
                    f"{where}: {part!r} is not a node (ID=HOST:PORT or HOST:PORT)"
                )
            address = match["address"]
            node_id = match["id"] or address
            if node_id in nodes:
                raise AgentEnvError(f"{where}: node {node_id!r} is listed twice")
            nodes[node_id] = (address, True)
    return nodes


def parse_service(value: str) -> tuple[str, str]:
    match = SERVICE_RE.fullmatch(value)
    if not match:
        raise AgentEnvError(
            f"--k8s-service {value!r} is not NAMESPACE/NAME (lower-case DNS labels)"
        )
    return match["ns"], match["name"]


def _format_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def nodes_from_endpointslices(slices: Iterable[Mapping[str, Any]]) -> dict[str, tuple[str, bool]]:
    """The nodes in EndpointSlice objects (discovery.k8s.io/v1, as the API returns them)."""
    nodes: dict[str, tuple[str, bool]] = {}
    for sl in slices:
        ports = sl.get("ports") or []
        port = next((p.get("port") for p in ports if p.get("name") == "http"), None)
        if port is None and ports:
            port = ports[0].get("port")
        if not port:
            continue  # a headless Service without ports: nothing to reach
        for endpoint in sl.get("endpoints") or []:
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            conditions = endpoint.get("conditions") or {}
            # The API: an unset `ready` means unknown and is to be read as ready.
            ready = conditions.get("ready") is not False and not conditions.get("terminating")
            node_id = (
                endpoint.get("nodeName")
                or (endpoint.get("targetRef") or {}).get("name")
                or addresses[0]
            )
            address = _format_address(addresses[0], int(port))
            # The same node in two slices (during an update): ready wins.
            if node_id in nodes and nodes[node_id][1] and not ready:
                continue
            nodes[node_id] = (address, ready)
    return nodes


class Discovery:
    def __init__(
        self,
        registry: Registry,
        static: Iterable[str] = (),
        nodes_file: Path | None = None,
        k8s_service: str | None = None,
        service_account: Path | None = None,
    ) -> None:
        self.registry = registry
        self.service_account = service_account
        self.static = parse_entries(static, "--nodes")
        self.nodes_file = nodes_file
        self.k8s = parse_service(k8s_service) if k8s_service else None
        self._tasks: list[asyncio.Task[None]] = []
        self._file_stamp: tuple[int, int] | None = None
        # name -> slice object, as last seen on the watch
        self.slices: dict[str, dict[str, Any]] = {}

    async def start(self) -> None:
        if self.static or self.nodes_file:
            self._load_static()
        if self.nodes_file:
            self._tasks.append(asyncio.create_task(self._watch_file()))
        if self.k8s:
            self._tasks.append(asyncio.create_task(self._watch_k8s(*self.k8s)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def _load_static(self) -> None:
        nodes = dict(self.static)
        if self.nodes_file:
            try:
                stat = self.nodes_file.stat()
                text = self.nodes_file.read_text()
            except OSError as exc:
                raise AgentEnvError(f"cannot read --nodes-file {self.nodes_file}: {exc}") from exc
            self._file_stamp = (stat.st_mtime_ns, stat.st_size)
            for node_id, value in parse_entries(text.splitlines(), str(self.nodes_file)).items():
                if node_id in nodes:
                    raise AgentEnvError(f"node {node_id!r} is both in --nodes and the nodes file")
                nodes[node_id] = value
        self.registry.set_discovered("static", nodes)

    async def _watch_file(self) -> None:
        assert self.nodes_file is not None
        while True:
            await asyncio.sleep(FILE_POLL_S)
            try:
                stat = self.nodes_file.stat()
                if (stat.st_mtime_ns, stat.st_size) != self._file_stamp:
                    self._load_static()
                    log.info("nodes file reloaded", extra={"file": str(self.nodes_file)})
            except (OSError, AgentEnvError) as exc:
                log.warning("nodes file not reloaded: %s", exc)

    def apply_slice_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ADDED / MODIFIED / DELETED) -> the registry's kubernetes nodes."""
        name = (obj.get("metadata") or {}).get("name", "")
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = dict(obj)
        self.registry.set_discovered("kubernetes", nodes_from_endpointslices(self.slices.values()))

    async def _watch_k8s(self, namespace: str, service: str) -> None:
        from lightkube import AsyncClient, KubeConfig
        from lightkube.resources.discovery_v1 import EndpointSlice

        labels = {"kubernetes.io/service-name": service}
        delay = 1.0
        while True:
            try:
                config = (
                    KubeConfig.from_env(service_account=self.service_account)
                    if self.service_account
                    else KubeConfig.from_env()
                )
                # No proxy from the environment: the API server is reached directly.
                client = AsyncClient(config, namespace=namespace, trust_env=False)
                # List first (a full picture, slices gone while away are dropped), then watch.
                listed = [s.to_dict() async for s in client.list(EndpointSlice, labels=labels)]
                self.slices = {s["metadata"]["name"]: s for s in listed}
                self.registry.set_discovered(
                    "kubernetes", nodes_from_endpointslices(self.slices.values())
                )
                delay = 1.0
                async for kind, obj in client.watch(EndpointSlice, labels=labels):
                    self.apply_slice_event(kind, obj.to_dict())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "EndpointSlice watch of %s/%s failed (retrying in %.0f s): %s",
                    namespace, service, delay, exc,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
