"""The node's proxy routing (node/proxy.py) and admission (node/admission.py) in-process: the
node app over an `Orchestrator` with the scripted backend (tests/node/scripted.py), requests
through httpx's ASGI transport, and every sandbox port answered by one real HTTP server
(uvicorn on loopback, in this process) that echoes what it received.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from agentenv.api.errors import Internal
from agentenv.node import pauses as pauses_module
from agentenv.node import proxy
from agentenv.node.admission import Admission, AdmissionRefused
from agentenv.node.api import NodeApp
from agentenv.node.backend import ENVD_PORT
from agentenv.node.metrics import NodeMetrics
from agentenv.node.orchestrator import CreateParams, NodeConfig, Orchestrator
from agentenv.node.records import State
from agentenv.node.security import TokenIssuer
from agentenv.node.store import Store
from agentenv.relay.server import StreamAborted
from tests.node.scripted import ScriptedBackend

API_KEY = "test-api-key-0123456789"
LIMIT = 20.0


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), LIMIT))


STREAMING: set[str] = set()  # query strings of /stream requests under way


async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers every request with what it received, as JSON; /stream sends one line and then
    nothing until the client goes away."""
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first\n", "more_body": True})
        STREAMING.add(scope["query_string"].decode())
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        finally:
            STREAMING.discard(scope["query_string"].decode())
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = json.dumps({
        "method": scope["method"], "path": scope["path"],
        "query": scope["query_string"].decode(), "body": body.decode(),
        "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
    }).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": answer})


@asynccontextmanager
async def upstream() -> AsyncIterator[int]:
    """The echo server on a free loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(echo, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), task
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task
        sock.close()


class Node:
    def __init__(self, orch: Orchestrator, backend: ScriptedBackend, app: NodeApp,
                 client: httpx.AsyncClient, port: int) -> None:
        self.orch, self.backend, self.app, self.client, self.port = orch, backend, app, client, port

    async def create(self, **params: Any) -> str:
        rec = await self.orch.create(CreateParams(**({"template": "base"} | params)))
        return rec.sandbox_id

    def envd(self, sandbox_id: str) -> dict[str, str]:
        """What the SDK sends envd of a secure sandbox: its access token (the node refuses a
        request without it before it takes a proxied connection)."""
        return {"X-Access-Token": self.orch.sandboxes[sandbox_id].envd_access_token or ""}


@asynccontextmanager
async def node(tmp_path: Path, admission: Admission | None = None,
               node_key: str | None = None) -> AsyncIterator[Node]:
    async with upstream() as port:
        backend = ScriptedBackend(envd=("127.0.0.1", port))
        orch = Orchestrator(Store(tmp_path / "node.db"), backend, TokenIssuer(tmp_path),
                            NodeConfig(reaper_interval=3600.0))
        orch.admission = admission
        app = NodeApp(orch, API_KEY, NodeMetrics(), node_id="node-test", node_key=node_key)
        await orch.start()
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://node.test") as client:
            try:
                yield Node(orch, backend, app, client, port)
            finally:
                await orch.shutdown()
                await app.proxy.close()


def at(sandbox_id: str, port: int = ENVD_PORT) -> str:
    """The URL of a sandbox port as the SDKs form it (Host `{port}-{id}.{domain}`)."""
    return f"http://{port}-{sandbox_id}.node.test"


# --- routing -----------------------------------------------------------------------------------


def test_routes_by_host_and_by_headers(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path) as n:
            sid = await n.create()
            answer = await n.client.post(at(sid) + "/files?path=/a", content=b"data",
                                         headers={"X-API-KEY": API_KEY, **n.envd(sid),
                                                  "X-Forwarded-For": "192.0.2.66",
                                                  "X-Real-IP": "192.0.2.66"})
            assert answer.status_code == 200, answer.text
            seen = answer.json()
            assert (seen["method"], seen["path"], seen["query"], seen["body"]) == \
                ("POST", "/files", "path=/a", "data")
            assert "x-api-key" not in seen["headers"]  # the node's key stays with the node
            assert seen["headers"]["x-access-token"] == n.envd(sid)["X-Access-Token"]
            assert seen["headers"]["x-forwarded-host"] == f"{ENVD_PORT}-{sid}.node.test"
            # who the client is, the node says (its peer: no proxy is trusted), not the client
            assert seen["headers"]["x-forwarded-for"] == "127.0.0.1"
            assert "x-real-ip" not in seen["headers"]
            answer = await n.client.get("/some/path", headers={
                "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(n.port)})
            assert answer.status_code == 200 and answer.json()["path"] == "/some/path"
            assert "e2b-sandbox-id" not in answer.json()["headers"]
            # without a route it is the control plane, which wants the API key
            assert (await n.client.get("/sandboxes")).status_code == 401

    run(scenario)


def test_refusals(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path) as n:
            sid = await n.create(network={"allowPublicTraffic": False})
            unknown = await n.client.get(at("nosuchsandbox") + "/health")
            assert unknown.status_code == 502
            assert unknown.json()["message"] == "The sandbox was not found"
            init = await n.client.post(at(sid) + "/init", json={})
            assert init.status_code == 403  # only the node gives envd its identity
            bad_port = await n.client.get("/", headers={"E2b-Sandbox-Id": sid,
                                                        "E2b-Sandbox-Port": "99999"})
            assert bad_port.status_code == 400 and "E2b-Sandbox-Port" in bad_port.text
            rec = n.orch.sandboxes[sid]
            assert rec.traffic_access_token
            app_port = at(sid, n.port) + "/"
            assert (await n.client.get(app_port)).status_code == 403
            wrong = {"e2b-traffic-access-token": "wrong"}
            assert (await n.client.get(app_port, headers=wrong)).status_code == 403
            right = {"e2b-traffic-access-token": rec.traffic_access_token}
            assert (await n.client.get(app_port, headers=right)).status_code == 200
            await n.orch.kill(sid)
            assert (await n.client.get(at(sid) + "/health")).status_code == 502

    run(scenario)


def test_a_cluster_node_checks_its_key_before_any_signature_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signed /files URL names no sandbox: the node finds it by trying every sandbox's token
    (a SHA-256 each). A node of a cluster does that only for its gateway (the node key)."""
    key = "0f" * 32
    computed: list[tuple[Any, ...]] = []
    real = proxy.file_signature

    def counted(*args: Any) -> str:
        computed.append(args)
        return real(*args)

    monkeypatch.setattr(proxy, "file_signature", counted)
    signed = "/files?path=%2Fx&username=user&signature=v1_forged"

    async def scenario() -> None:
        async with node(tmp_path, node_key=key) as n:
            for _ in range(3):
                await n.create()
            refused = await n.client.get(signed)
            assert refused.status_code == 403, refused.text
            assert computed == []  # no work for a caller without the key
            checked = await n.client.get(signed, headers={"x-agentenv-node-key": key,
                                                          "x-agentenv-team": "team-a"})
            assert checked.status_code == 401 and checked.json()["message"] == "invalid signature"
            assert len(computed) == 3  # the gateway's request is still checked

    run(scenario)


def test_traffic_resumes_a_paused_sandbox_only_with_its_token(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path) as n:
            sid = await n.create(auto_pause=True, auto_resume=True)
            plain = await n.create()
            await n.orch.pause(sid)
            await n.orch.pause(plain)
            refused = await n.client.get(at(sid) + "/health")
            assert refused.status_code == 401 and "X-Access-Token" in refused.text
            assert n.orch.sandboxes[sid].state == State.PAUSED and not n.backend.called("resume")
            token = {"X-Access-Token": n.orch.sandboxes[sid].envd_access_token}
            assert (await n.client.get(at(plain) + "/health")).status_code == 502
            answer = await n.client.get(at(sid) + "/health", headers=token)
            assert answer.status_code == 200 and answer.json()["path"] == "/health"
            assert n.orch.sandboxes[sid].state == State.RUNNING
            assert n.orch.sandboxes[plain].state == State.PAUSED  # no autoResume: stays
            assert n.backend.called("resume") == [sid]

    run(scenario)


def test_pausing_closes_the_sandboxes_streams(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path) as n:
            sid = await n.create()
            stream = asyncio.create_task(n.client.get(at(sid) + f"/stream?{sid}",
                                                      headers=n.envd(sid)))
            while sid not in STREAMING:
                assert not stream.done(), stream
                await asyncio.sleep(0.01)
            assert n.app.proxy.connections(sid) == 1
            await n.orch.pause(sid)
            with pytest.raises(StreamAborted):  # the node's server then cuts the connection
                await stream
            assert n.app.proxy.connections(sid) == 0
            while sid in STREAMING:  # the upstream side was closed as well
                await asyncio.sleep(0.01)

    run(scenario)


def test_a_secure_sandboxs_code_interpreter_runs_cells_only_with_its_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Port 49999 (the code-interpreter server, which checks envd's token on the routes that run
    code): a cell without the token is refused at the node, before a connection or a resume."""
    async def scenario() -> None:
        async with node(tmp_path) as n:
            # the echo server stands for the code-interpreter port (raising=False: a proxy
            # without the check has no such name, and must fail this test)
            monkeypatch.setattr(proxy, "CODE_INTERPRETER_PORT", n.port, raising=False)
            sid = await n.create()  # secure, as the SDK creates by default
            plain = await n.create(secure=False)
            paused = await n.create(auto_pause=True, auto_resume=True)
            url, cell = at(sid, n.port), {"code": "import os; os.system('id')"}
            for headers in ({}, {"X-Access-Token": "wrong"}, {"X-Access-Token": ""}):
                answer = await n.client.post(url + "/execute", json=cell, headers=headers)
                assert answer.status_code == 401, (headers, answer.text)
                assert "X-Access-Token" in answer.json()["message"]
            assert (await n.client.post(url + "/execute/", json=cell)).status_code == 401
            assert (await n.client.post(url + "/aenv/warm")).status_code == 401
            by_headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(n.port)}
            answer = await n.client.post("/execute", json=cell, headers=by_headers)
            assert answer.status_code == 401
            ok = await n.client.post(url + "/execute", json=cell, headers=n.envd(sid))
            assert ok.status_code == 200 and ok.json()["path"] == "/execute"
            assert ok.json()["headers"]["x-access-token"] == n.envd(sid)["X-Access-Token"]
            # the SDKs' context calls carry no token: the server decides (it checks one given)
            assert (await n.client.post(url + "/contexts", json={})).status_code == 200
            # token-less calls there are anyone's: not the sandbox's activity, or a stranger's
            # polls would keep it from idling out (red team, 2026-12-06)
            last = n.orch.activity._last.get(sid)
            assert (await n.client.get(url + "/health")).status_code == 200
            assert n.orch.activity._last.get(sid) == last
            await n.client.get(url + "/health", headers=n.envd(sid))
            assert n.orch.activity._last.get(sid) != last
            # secure=False: envd has no token, nor has the code interpreter
            answer = await n.client.post(at(plain, n.port) + "/execute", json=cell)
            assert answer.status_code == 200
            # a stranger's cell does not wake a paused sandbox
            await n.orch.pause(paused)
            answer = await n.client.post(at(paused, n.port) + "/execute", json=cell)
            assert answer.status_code == 401
            assert n.orch.sandboxes[paused].state == State.PAUSED
            assert not n.backend.called("resume")
            # any other port of a secure sandbox is as before: the token is not its business
            monkeypatch.setattr(proxy, "CODE_INTERPRETER_PORT", 49999, raising=False)
            assert (await n.client.post(url + "/execute", json=cell)).status_code == 200

    run(scenario)


# --- admission ---------------------------------------------------------------------------------


def limits(tmp_path: Path, **kwargs: Any) -> Admission:
    options: dict[str, Any] = {"memory_budget_mb": 1 << 20, "memory_reserve_mb": 0,
                               "min_free_disk_mb": 0, "cpu_pressure_max": 0,
                               "memory_pressure_max": 0}
    return Admission(tmp_path, **(options | kwargs))


def test_sandbox_limit_counts_what_holds_a_vm(tmp_path: Path) -> None:
    async def scenario() -> None:
        admission = limits(tmp_path, max_sandboxes=2)
        async with node(tmp_path, admission) as n:
            first = await n.create()
            with pytest.raises(AdmissionRefused) as refused:
                await n.orch.fork(first, 2, 60)  # 1 + 2 > 2
            assert refused.value.status == 429 and "AENV_MAX_SANDBOXES" in str(refused.value)
            assert list(n.orch.sandboxes) == [first] and not n.backend.called("fork")
            assert n.orch.sandboxes[first].state == State.RUNNING
            second = await n.create()
            answer = await n.client.post("/sandboxes", json={"templateID": "base"},
                                         headers={"X-API-KEY": API_KEY})
            assert answer.status_code == 429 and "sandbox limit reached" in answer.text
            assert len(n.orch.sandboxes) == 2 and len(n.backend.called("create")) == 2
            await n.orch.pause(second)  # a paused sandbox holds no VM
            third = await n.create()
            with pytest.raises(AdmissionRefused):
                await n.orch.connect(second, 60)
            assert n.orch.sandboxes[second].state == State.PAUSED
            assert not n.backend.called("resume")
            await n.orch.kill(third)
            await n.orch.connect(second, 60)
            assert admission.refusals == {"max_sandboxes": 3}
            assert admission.holding(n.orch.sandboxes.values())[0] == 2  # nothing else held

    run(scenario)


def test_memory_budget_and_released_reservations(tmp_path: Path) -> None:
    async def scenario() -> None:
        probe = limits(tmp_path)
        one = probe.sandbox_mb(256, 1)  # the base template's size
        admission = limits(tmp_path, memory_budget_mb=2 * one)
        async with node(tmp_path, admission) as n:
            n.backend.fail("create")
            with pytest.raises(Internal):
                await n.create()
            assert admission.holding(n.orch.sandboxes.values()) == (0, 0)  # given back
            first = await n.create()
            n.backend.fail("fork")
            with pytest.raises(Internal):
                await n.orch.fork(first, 1, 60)
            assert admission.holding(n.orch.sandboxes.values()) == (1, one)
            await n.orch.fork(first, 1, 60)
            with pytest.raises(AdmissionRefused) as refused:
                await n.create()
            assert refused.value.limit == "memory_requested" and "AENV_MEMORY_BUDGET_MB" in str(
                refused.value)
            assert len(n.orch.sandboxes) == 2

    run(scenario)


def test_a_failed_auto_resume_is_not_tried_again_by_every_request(tmp_path: Path) -> None:
    """A guest that breaks its own resume (envd replaced by a server that never answers: each
    try a restore held up to 30 s on a real node) does not get one per allowed request: traffic
    waits out a backoff that doubles per failure in a row; the owner's connect is not held back
    (red team of 2026-12-07)."""
    async def scenario() -> None:
        async with node(tmp_path) as n:
            sid = await n.create(auto_pause=True, auto_resume=True)
            await n.orch.pause(sid)
            token = {"X-Access-Token": n.orch.sandboxes[sid].envd_access_token}
            pauses = n.orch._pauses
            now = [1000.0]
            pauses.clock = lambda: now[0]
            n.backend.fail("resume")
            assert (await n.client.get(at(sid) + "/health", headers=token)).status_code == 502
            assert n.backend.called("resume") == [sid]
            assert n.orch.sandboxes[sid].state == State.PAUSED
            for _ in range(5):  # within the backoff: no new restore
                assert (await n.client.get(at(sid) + "/health",
                                           headers=token)).status_code == 502
            assert n.backend.called("resume") == [sid]
            now[0] += pauses_module.AUTO_RESUME_BACKOFF_S + 0.1
            n.backend.fail("resume")  # a second failure in a row: twice the wait
            assert (await n.client.get(at(sid) + "/health", headers=token)).status_code == 502
            assert len(n.backend.called("resume")) == 2
            now[0] += pauses_module.AUTO_RESUME_BACKOFF_S + 0.1
            await n.client.get(at(sid) + "/health", headers=token)
            assert len(n.backend.called("resume")) == 2
            now[0] += pauses_module.AUTO_RESUME_BACKOFF_S
            answer = await n.client.get(at(sid) + "/health", headers=token)
            assert answer.status_code == 200 and n.orch.sandboxes[sid].state == State.RUNNING
            assert len(n.backend.called("resume")) == 3
            assert sid not in pauses._auto_resume_failed  # forgotten once it runs
            # the owner's connect is never held back by it
            await n.orch.pause(sid)
            n.backend.fail("resume")
            await n.client.get(at(sid) + "/health", headers=token)
            assert len(n.backend.called("resume")) == 4
            await n.orch.connect(sid, 60)
            assert n.orch.sandboxes[sid].state == State.RUNNING

    run(scenario)
