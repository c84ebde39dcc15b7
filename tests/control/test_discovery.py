"""Node discovery: static lists (flags, file), self-registration, and the EndpointSlices of a
headless Service, from recorded API objects (tests/fixtures/k8s) parsed directly and served to
the real lightkube client by a loopback API server; against a real cluster only when one is
configured (KUBECONFIG or in-cluster), skipped otherwise."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import grpc
import pytest

from agentenv.control.scheduler.discovery import (
    Discovery,
    nodes_from_endpointslices,
    parse_entries,
    parse_service,
)
from agentenv.errors import AgentEnvError
from agentenv.scheduling.client import SchedulerError
from tests.conftest import FIXTURES
from tests.control.conftest import RedisServer
from tests.control.helpers import scheduler, status

K8S = FIXTURES / "k8s"
LISTED = {
    "worker-1": ("10.240.0.11:8000", True),
    "worker-2": ("10.240.0.12:8000", True),
    "worker-3": ("10.240.0.13:8000", False),  # not ready yet
    "worker-4": ("10.240.0.14:8000", True),
    "worker-5": ("10.240.0.15:8000", False),  # terminating
    "worker-6": ("[fd00:10:240::16]:8000", True),
}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, tuple[str, bool]]]] = []

    def set_discovered(self, source: str, nodes: Mapping[str, tuple[str, bool]]) -> None:
        self.calls.append((source, dict(nodes)))


def watch_events() -> list[dict[str, object]]:
    return [json.loads(line) for line in (K8S / "endpointslices-watch.jsonl").read_text().splitlines()]


def test_endpointslices_parsed() -> None:
    listed = json.loads((K8S / "endpointslices-list.json").read_text())
    assert nodes_from_endpointslices(listed["items"]) == LISTED


def test_watch_events_applied() -> None:
    listed = json.loads((K8S / "endpointslices-list.json").read_text())
    recorder = Recorder()
    discovery = Discovery(recorder)
    discovery.slices = {s["metadata"]["name"]: s for s in listed["items"]}
    events = watch_events()
    discovery.apply_slice_event(events[0]["type"], events[0]["object"])  # worker-3 ready
    assert recorder.calls[-1][1]["worker-3"] == ("10.240.0.13:8000", True)
    discovery.apply_slice_event(events[1]["type"], events[1]["object"])  # worker-7 added
    assert recorder.calls[-1][1]["worker-7"] == ("10.240.0.17:8000", True)
    discovery.apply_slice_event(events[2]["type"], events[2]["object"])  # slice deleted
    assert set(recorder.calls[-1][1]) == {"worker-1", "worker-2", "worker-3", "worker-6",
                                         "worker-7"}


def test_static_entries_and_bad_ones(tmp_path: Path) -> None:
    assert parse_entries(["a=127.0.0.1:8000, 127.0.0.2:8001", "# comment", ""], "--nodes") == {
        "a": ("127.0.0.1:8000", True),
        "127.0.0.2:8001": ("127.0.0.2:8001", True),
    }
    with pytest.raises(AgentEnvError, match="'nohost' is not a node"):
        parse_entries(["nohost"], "--nodes")
    with pytest.raises(AgentEnvError, match="listed twice"):
        parse_entries(["a=127.0.0.1:1", "a=127.0.0.1:2"], "--nodes")
    with pytest.raises(AgentEnvError, match="is not NAMESPACE/NAME"):
        parse_service("aenv")
    assert parse_service("aenv/aenv-node") == ("aenv", "aenv-node")


def test_static_nodes_in_the_scheduler(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    async def body() -> None:
        async with scheduler(
            redis_server.url, prefix, static_nodes=["n1=127.0.0.1:9001", "n2=127.0.0.1:9002"],
            self_registration=False,
        ) as (server, client):
            nodes = {n.node_id: n for n in await client.list_nodes()}
            assert set(nodes) == {"n1", "n2"}
            assert not nodes["n1"].up and "never heard from" in nodes["n1"].down_reason
            assert nodes["n1"].address == "127.0.0.1:9001"
            await client.heartbeat(status("n1", address="127.0.0.1:9001"))
            nodes = {n.node_id: n for n in await client.list_nodes()}
            assert nodes["n1"].up and nodes["n1"].discovered_by == ("heartbeat", "static")
            with pytest.raises(SchedulerError) as caught:
                await client.heartbeat(status("intruder"))
            assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
            # The nodes file is re-read; a node that left the list is down at once.
            server.service.set_discovered("static", {"n2": ("127.0.0.1:9002", True)})
            nodes = {n.node_id: n for n in await client.list_nodes()}
            assert not nodes["n1"].up
            assert nodes["n1"].down_reason == "removed from static discovery"

    asyncio.run(body())


# --- lightkube against a loopback API server serving the recorded objects -----------------------


class FakeApiServer:
    """Answers the list and the watch of EndpointSlices from the fixtures, over HTTP/1.1 on
    127.0.0.1; records each request's path and query."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, list[str]]]] = []
        self.port = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ")[1].decode()
                url = urlsplit(target)
                query = parse_qs(url.query)
                self.requests.append((url.path, query))
                if query.get("watch") == ["true"]:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
                    for line in (K8S / "endpointslices-watch.jsonl").read_bytes().splitlines():
                        chunk = line + b"\n"
                        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        await writer.drain()
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(3600)  # a watch stays open
                body = (K8S / "endpointslices-list.json").read_bytes()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_lightkube_list_and_watch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body() -> None:
        api = FakeApiServer()
        await api.start()
        config = tmp_path / "kubeconfig"
        config.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{api.port}"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}],
        }))
        monkeypatch.setenv("KUBECONFIG", str(config))
        recorder = Recorder()
        discovery = Discovery(
            recorder, k8s_service="aenv/aenv-node",
            service_account=tmp_path / "no-service-account",
        )
        await discovery.start()
        try:
            for _ in range(100):
                if len(recorder.calls) >= 4:
                    break
                await asyncio.sleep(0.05)
        finally:
            await discovery.stop()
            await api.stop()
        assert recorder.calls[0] == ("kubernetes", LISTED)
        final = recorder.calls[3][1]
        assert set(final) == {"worker-1", "worker-2", "worker-3", "worker-6", "worker-7"}
        assert all(ready for _, ready in final.values())
        path, query = api.requests[0]
        assert path == "/apis/discovery.k8s.io/v1/namespaces/aenv/endpointslices"
        assert query["labelSelector"] == ["kubernetes.io/service-name=aenv-node"]
        assert api.requests[1][1].get("watch") == ["true"]

    asyncio.run(body())


def test_real_cluster_if_reachable() -> None:
    """Lists the EndpointSlices of $AENV_TEST_K8S_SERVICE (NAMESPACE/NAME) in the cluster that
    KUBECONFIG or the in-cluster service account points at; skipped without one."""
    service = os.environ.get("AENV_TEST_K8S_SERVICE")
    if not service:
        pytest.skip("no Kubernetes cluster configured (set AENV_TEST_K8S_SERVICE=NS/NAME and "
                    "KUBECONFIG to test discovery against a real cluster)")
    from lightkube import AsyncClient, KubeConfig
    from lightkube.resources.discovery_v1 import EndpointSlice

    namespace, name = parse_service(service)

    async def body() -> dict[str, tuple[str, bool]]:
        client = AsyncClient(KubeConfig.from_env(), namespace=namespace, trust_env=False)
        slices = [s.to_dict() async for s in client.list(
            EndpointSlice, labels={"kubernetes.io/service-name": name})]
        return nodes_from_endpointslices(slices)

    nodes = asyncio.run(body())
    assert nodes, f"the Service {service} has no endpoints"


def test_nodes_file_is_reread_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentenv.control.scheduler import discovery as discovery_module

    monkeypatch.setattr(discovery_module, "FILE_POLL_S", 0.05)
    nodes_file = tmp_path / "nodes"
    nodes_file.write_text("# the cluster\nn1=127.0.0.1:9001\n")

    async def body() -> None:
        recorder = Recorder()
        discovery = Discovery(recorder, static=["n0=127.0.0.1:9000"], nodes_file=nodes_file)
        await discovery.start()
        try:
            assert recorder.calls[-1] == ("static", {"n0": ("127.0.0.1:9000", True),
                                                     "n1": ("127.0.0.1:9001", True)})
            nodes_file.write_text("n1=127.0.0.1:9001\nn2=127.0.0.1:9002  # new\n")
            for _ in range(100):
                if "n2" in recorder.calls[-1][1]:
                    break
                await asyncio.sleep(0.05)
            assert recorder.calls[-1] == ("static", {"n0": ("127.0.0.1:9000", True),
                                                     "n1": ("127.0.0.1:9001", True),
                                                     "n2": ("127.0.0.1:9002", True)})
            calls = len(recorder.calls)
            nodes_file.write_text("n1=127.0.0.1:9001\nbroken line\n")  # kept: the old list
            await asyncio.sleep(0.3)
            assert len(recorder.calls) == calls
        finally:
            await discovery.stop()

    asyncio.run(body())
    with pytest.raises(AgentEnvError, match="both in --nodes and the nodes file"):
        nodes_file.write_text("n0=127.0.0.1:9000\n")
        asyncio.run(Discovery(Recorder(), static=["n0=127.0.0.1:9000"],
                              nodes_file=nodes_file).start())
