"""The code-interpreter server's access token (agentenv.guest.codeint, port 49999), in-process:
the ASGI app driven through httpx with kernels stood in for (no VM, no Jupyter), and envd's
/init writing what the server checks.

A secure sandbox's envd holds an access token; the server takes the same token in
X-Access-Token, by the SHA-256 envd publishes at /init (envd.ACCESS_TOKEN_DIGEST_FILE)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

TOKEN = "tok-codeint-0123456789"


def _stub_jupyter_client() -> None:
    """kernels.py imports jupyter_client, which the host's venv lacks; the kernels are stood in
    for here (FakeContext), so only its names are needed."""
    try:
        import jupyter_client  # noqa: F401
        return
    except ImportError:
        pass
    root = types.ModuleType("jupyter_client")
    kernelspec = types.ModuleType("jupyter_client.kernelspec")
    manager = types.ModuleType("jupyter_client.manager")
    kernelspec.KernelSpec = type("KernelSpec", (), {})  # type: ignore[attr-defined]
    kernelspec.KernelSpecManager = type("KernelSpecManager", (), {})  # type: ignore[attr-defined]
    manager.AsyncKernelManager = type("AsyncKernelManager", (), {})  # type: ignore[attr-defined]
    sys.modules.update({"jupyter_client": root, "jupyter_client.kernelspec": kernelspec,
                        "jupyter_client.manager": manager})


_stub_jupyter_client()

from agentenv.guest.codeint import app as codeint  # noqa: E402


class FakeContext:
    """A context without a kernel: a cell prints its own code."""

    def __init__(self, language: str, cwd: str, context_id: str | None = None) -> None:
        self.language, self.cwd = language, cwd
        self.id = context_id or f"ctx-{id(self)}"
        self.sandbox_env_applied = False
        self.sandbox_envs: list[dict[str, str] | None] = []  # what each cell was given

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def start(self) -> None:
        if self.cwd.startswith("/root"):  # as a kernel run by `user` finds it
            raise PermissionError(13, "Permission denied", self.cwd)

    async def warm(self) -> None:
        pass

    async def restart(self) -> None:
        self.sandbox_env_applied = False

    async def shutdown(self) -> None:
        pass

    async def interrupt(self) -> None:
        pass

    async def execute(self, code: str, env_vars: dict[str, str] | None = None,
                      sandbox_env: dict[str, str] | None = None
                      ) -> AsyncIterator[dict[str, Any]]:
        self.sandbox_envs.append(sandbox_env)
        if sandbox_env is not None:
            self.sandbox_env_applied = True
        yield {"type": "stdout", "text": code, "timestamp": 0}


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 20))


def digest_file(tmp_path: Path, token: str | None) -> Path:
    """Where the test's server reads the token digest; written as envd writes it."""
    path = tmp_path / "run" / "aenv" / "envd-token.sha256"
    if token is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(hashlib.sha256(token.encode()).hexdigest() + "\n")
    return path


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], codeint.CodeApp]]:
    monkeypatch.setattr(codeint, "Context", FakeContext)

    def make(token_file: Path) -> codeint.CodeApp:
        # where the server looks for envd's token digest: the module's constant (raising=False:
        # a server without token support has no such name, and must fail the tests below)
        monkeypatch.setattr(codeint, "ACCESS_TOKEN_DIGEST_FILE", str(token_file), raising=False)
        app = codeint.CodeApp(default_cwd="/tmp")
        app.envd_envs_url = "http://127.0.0.1:9/envs"  # no envd here (a test may serve one)
        return app

    yield make


async def client(app: codeint.CodeApp) -> httpx.AsyncClient:
    await app.start()
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://sandbox.test:49999")


def lines(answer: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in answer.text.splitlines()]


def test_a_secure_sandbox_runs_code_only_with_its_token(
        server: Callable[[Path], codeint.CodeApp], tmp_path: Path) -> None:
    app = server(digest_file(tmp_path, TOKEN))

    async def scenario() -> None:
        async with await client(app) as http:
            cell = {"code": "print('hi')"}
            # what the red team did: no token, then a guessed one
            for headers in ({}, {"X-Access-Token": "wrong"}, {"X-Access-Token": ""},
                            {"X-Access-Token": TOKEN + "x"}):
                answer = await http.post("/execute", json=cell, headers=headers)
                assert answer.status_code == 401, (headers, answer.text)
                assert answer.json() == {
                    "code": 401,
                    "message": "unauthorized access, please provide a valid access token "
                               "(X-Access-Token)"}
            twice = [("X-Access-Token", TOKEN), ("X-Access-Token", "wrong")]
            answer = await http.post("/execute", json=cell, headers=twice)
            assert answer.status_code == 401
            assert (await http.post("/aenv/warm")).status_code == 401
            answer = await http.post("/execute", json=cell, headers={"X-Access-Token": TOKEN})
            assert answer.status_code == 200, answer.text
            assert lines(answer)[0]["text"] == "print('hi')"
            assert lines(answer)[-1] == {"type": "end_of_execution"}
            answer = await http.post("/aenv/warm", headers={"X-Access-Token": TOKEN})
            assert answer.status_code == 204
            # the liveness probe (the template build's, a load balancer's) stays open
            assert (await http.get("/health")).status_code == 200

    run(scenario)


def test_context_routes_check_a_token_that_is_given(
        server: Callable[[Path], codeint.CodeApp], tmp_path: Path) -> None:
    """The E2B Code Interpreter SDKs send X-Access-Token with run_code only: their context calls
    (create, list, restart, remove) go without it, so a missing one is let through there; a
    wrong one is refused everywhere."""
    app = server(digest_file(tmp_path, TOKEN))

    async def scenario() -> None:
        async with await client(app) as http:
            wrong = {"X-Access-Token": "wrong"}
            right = {"X-Access-Token": TOKEN}
            assert (await http.post("/contexts", json={}, headers=wrong)).status_code == 401
            assert (await http.get("/contexts", headers=wrong)).status_code == 401
            created = await http.post("/contexts", json={"cwd": "/srv"})
            assert created.status_code == 200, created.text
            ctx = created.json()["id"]
            assert ctx in {c["id"] for c in (await http.get("/contexts")).json()}
            assert (await http.post(f"/contexts/{ctx}/restart", headers=wrong)).status_code == 401
            assert (await http.post(f"/contexts/{ctx}/restart")).status_code == 204
            assert (await http.delete(f"/contexts/{ctx}", headers=wrong)).status_code == 401
            assert (await http.delete(f"/contexts/{ctx}", headers=right)).status_code == 204
            # a context's cells are /execute: the token is asked for there
            assert (await http.post("/execute", json={"code": "1"})).status_code == 401

    run(scenario)


def test_contexts_are_capped(server: Callable[[Path], codeint.CodeApp], tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Context routes take no token from the SDKs: a stranger's creates (a kernel each) stop
    at the cap instead of filling the guest's memory (found by the red team)."""
    monkeypatch.setattr(codeint, "MAX_CONTEXTS", 5)
    app = server(digest_file(tmp_path, TOKEN))

    async def scenario() -> None:
        async with await client(app) as http:
            made = []
            while (answer := await http.post("/contexts", json={})).status_code == 200:
                made.append(answer.json()["id"])
                assert len(made) <= 5
            assert answer.status_code == 429 and "at most 5" in answer.json()["error"]
            assert len(app.contexts) == 5
            assert (await http.delete(f"/contexts/{made[0]}")).status_code == 204
            assert (await http.post("/contexts", json={})).status_code == 200

    run(scenario)


def test_without_a_token_nothing_changes(
        server: Callable[[Path], codeint.CodeApp], tmp_path: Path) -> None:
    """A sandbox created with secure=False: envd has no token, nor has the server."""
    app = server(digest_file(tmp_path, None))

    async def scenario() -> None:
        async with await client(app) as http:
            answer = await http.post("/execute", json={"code": "1 + 1"})
            assert answer.status_code == 200 and lines(answer)[0]["text"] == "1 + 1"
            # a client that sends a token anyway (an SDK of a secure sandbox's snapshot) is fine
            answer = await http.post("/execute", json={"code": "2"},
                                     headers={"X-Access-Token": "anything"})
            assert answer.status_code == 200
            assert (await http.post("/aenv/warm")).status_code == 204
            assert (await http.post("/contexts", json={})).status_code == 200
            assert (await http.get("/health")).status_code == 200

    run(scenario)


def test_an_unreadable_digest_refuses_instead_of_opening(
        server: Callable[[Path], codeint.CodeApp], tmp_path: Path) -> None:
    path = digest_file(tmp_path, TOKEN)
    path.write_text("not a digest\n")
    app = server(path)

    async def scenario() -> None:
        async with await client(app) as http:
            for headers in ({}, {"X-Access-Token": TOKEN}):
                answer = await http.post("/execute", json={"code": "1"}, headers=headers)
                assert answer.status_code == 503, answer.text
            assert (await http.get("/health")).status_code == 200

    run(scenario)


def test_envd_init_publishes_the_token_the_server_checks(
        server: Callable[[Path], codeint.CodeApp], tmp_path: Path) -> None:
    """envd's /init (a create, a resume, a fork's new token) is where the server learns it."""
    from agentenv.guest.envd import ACCESS_TOKEN_DIGEST_FILE
    from agentenv.guest.envd.app import Envd, EnvdConfig

    root = tmp_path / "root"
    root.mkdir()
    envd = Envd(EnvdConfig(root=str(root), system_changes=False))
    path = root / ACCESS_TOKEN_DIGEST_FILE.lstrip("/")
    app = server(path)

    async def scenario() -> None:
        envd_http = httpx.AsyncClient(transport=httpx.ASGITransport(app=envd),  # type: ignore[arg-type]
                                      base_url="http://sandbox.test:49983")
        async with envd_http, await client(app) as http:
            cell = {"code": "1"}
            assert (await http.post("/execute", json=cell)).status_code == 200  # no token yet
            assert (await envd_http.post("/init", json={"accessToken": TOKEN})).status_code == 204
            assert oct(path.stat().st_mode & 0o777) == "0o644"  # the server runs as `user`
            assert TOKEN not in path.read_text()  # a digest, not the token
            assert (await http.post("/execute", json=cell)).status_code == 401
            ok = await http.post("/execute", json=cell, headers={"X-Access-Token": TOKEN})
            assert ok.status_code == 200
            # a fork's child gets a token of its own: the parent's no longer runs code there
            new = "tok-child-9876543210"
            answer = await envd_http.post("/init", json={"accessToken": new},
                                          headers={"X-Access-Token": TOKEN})
            assert answer.status_code == 204
            old = await http.post("/execute", json=cell, headers={"X-Access-Token": TOKEN})
            assert old.status_code == 401
            ok = await http.post("/execute", json=cell, headers={"X-Access-Token": new})
            assert ok.status_code == 200

    run(scenario)


def test_a_context_that_cannot_start_is_a_400(
        server: Callable[[Path], codeint.CodeApp], tmp_path: Path) -> None:
    """create_code_context(cwd="/root") (E2B's test_create_context_with_options): the kernels
    run as `user`, who cannot enter /root. The answer says so; before, the request's connection
    was dropped, which the node reported as the sandbox's port not answering (a 502)."""
    app = server(digest_file(tmp_path, None))

    async def scenario() -> None:
        async with await client(app) as http:
            before = len(app.contexts)
            answer = await http.post("/contexts", json={"language": "python", "cwd": "/root"})
            assert answer.status_code == 400, answer.text
            assert "/root" in answer.json()["error"]
            assert "Permission denied" in answer.json()["error"]
            assert len(app.contexts) == before
            assert (await http.post("/contexts", json={"cwd": "/tmp"})).status_code == 200

    run(scenario)
