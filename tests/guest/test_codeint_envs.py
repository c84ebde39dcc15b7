"""The sandbox's own env vars (Sandbox.create's `envs`) in the code-interpreter server's
kernels (agentenv.guest.codeint): read from envd's GET /envs with the caller's token before a
context's first cell, once per kernel, as E2B's server does. In-process: envd's real ASGI app
served on a local port, the kernels stood in for (test_codeint_auth.FakeContext); the VM test
is tests/node/test_code_interpreter.py::test_sandbox_env_vars_reach_every_kernel.

Found by E2B's own code-interpreter suite (env_vars/test_*.py::test_env_vars_on_sandbox): the
kernels start in the template, before any sandbox's envs exist, so without this a create's
envs never reached run_code."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import httpx

from agentenv.guest.envd.app import Envd, EnvdConfig
from agentenv.guest.envd.httpserver import HttpServer
from tests.guest.test_codeint_auth import (  # noqa: F401 (server is a fixture)
    TOKEN,
    FakeContext,
    client,
    codeint,
    digest_file,
    run,
    server,
)


def test_a_context_gets_the_sandbox_env_before_its_first_cell(
        server: Callable[[Path], codeint.CodeApp], tmp_path: Path) -> None:  # noqa: F811
    root = tmp_path / "root"
    root.mkdir()
    envd = Envd(EnvdConfig(root=str(root), system_changes=False))
    app = server(digest_file(tmp_path, TOKEN))

    async def scenario() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        envd_server = HttpServer(envd)
        await envd_server.start(listener)
        app.envd_envs_url = f"http://127.0.0.1:{port}/envs"
        try:
            async with await client(app) as http:
                token = {"X-Access-Token": TOKEN}
                async with httpx.AsyncClient() as to_envd:
                    init = await to_envd.post(
                        f"http://127.0.0.1:{port}/init",
                        json={"accessToken": TOKEN, "envVars": {"SBX_VAR": "from-create"}})
                assert init.status_code == 204, init.text
                for _ in range(2):
                    cell = await http.post("/execute", json={"code": "1"}, headers=token)
                    assert cell.status_code == 200, cell.text
                default = app.defaults["python"]
                assert isinstance(default, FakeContext)
                # the first cell is given them, the second finds them set
                assert default.sandbox_envs == [{"SBX_VAR": "from-create"}, None]
                made = await http.post("/contexts", json={"language": "bash"})
                ctx = app.contexts[made.json()["id"]]
                assert isinstance(ctx, FakeContext)
                await http.post("/execute", json={"code": "1", "context_id": ctx.id},
                                headers=token)
                assert ctx.sandbox_envs == [{"SBX_VAR": "from-create"}]
                # a restart is a new kernel: given them again
                await http.post(f"/contexts/{ctx.id}/restart")
                await http.post("/execute", json={"code": "1", "context_id": ctx.id},
                                headers=token)
                assert ctx.sandbox_envs[-1] == {"SBX_VAR": "from-create"}
        finally:
            await envd_server.close()

    run(scenario)
