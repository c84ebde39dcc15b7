"""TLS for the scheduler where configured (docs/control-plane.md §11): with a certificate the
scheduler speaks TLS only (a plaintext client gets nowhere, nor one that trusts another CA);
with a client CA too, a client must show a certificate that CA signed (mTLS). The node and the
gateway take the client side from AENV_SCHEDULER_TLS_*: a real node heartbeats over mTLS.
Certificates from a throwaway CA (openssl CLI)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from agentenv.cluster_keys import node_key
from agentenv.control.scheduler.server import SchedulerOptions, SchedulerServer, ServerTls
from agentenv.errors import AgentEnvError
from agentenv.scheduling.client import (
    ClientTls,
    Credentials,
    SchedulerClient,
    SchedulerError,
)
from tests.control.conftest import RedisServer, SchedulerProcess
from tests.control.helpers import SECRET, status, wait_for
from tests.control.pki import Authority
from tests.node.conftest import NodeProcess


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pki")
    ca, stranger = Authority(root, "cluster"), Authority(root, "stranger")
    server_cert, server_key = ca.issue("scheduler", "IP:127.0.0.1,DNS:localhost")
    client_cert, client_key = ca.issue("node", "DNS:node")
    stranger_cert, stranger_key = stranger.issue("intruder", "DNS:intruder")
    return {"ca": ca.cert, "server_cert": server_cert, "server_key": server_key,
            "client_cert": client_cert, "client_key": client_key,
            "stranger_ca": stranger.cert, "stranger_cert": stranger_cert,
            "stranger_key": stranger_key}


def client_tls(pki: dict[str, Path], ca: str = "ca", who: str | None = None) -> ClientTls:
    return ClientTls(pki[ca].read_bytes(),
                     pki[f"{who}_cert"].read_bytes() if who else None,
                     pki[f"{who}_key"].read_bytes() if who else None)


async def beats(port: int, tls: ClientTls | None) -> bool:
    """Whether a heartbeat of node n1 (with its own key) is taken over this kind of channel."""
    async with SchedulerClient(f"127.0.0.1:{port}", Credentials.node(node_key(SECRET, "n1"), "n1"),
                               timeout=10, tls=tls) as client:
        try:
            await client.heartbeat(status("n1", address="127.0.0.1:8001"))
        except SchedulerError as exc:
            assert exc.unavailable, exc  # the handshake failed: no call was answered
            return False
        return True


def run_scheduler(redis_server: RedisServer, prefix: str, tls: ServerTls,
                  tried: dict[str, ClientTls | None]) -> dict[str, bool]:
    async def body() -> dict[str, bool]:
        server = SchedulerServer(SchedulerOptions(
            cluster_secret=SECRET, listen="127.0.0.1:0", redis_url=redis_server.url,
            prefix=prefix, tls=tls))
        await server.start()
        try:
            return {name: await beats(server.port, client) for name, client in tried.items()}
        finally:
            await server.stop(grace=0)

    return asyncio.run(body())


def test_tls_client_works_a_plaintext_one_does_not(redis_server: RedisServer, prefix: str,
                                                   pki: dict[str, Path]) -> None:
    tls = ServerTls.load(str(pki["server_cert"]), str(pki["server_key"]), None)
    assert tls is not None
    answered = run_scheduler(redis_server, prefix, tls, {
        "tls": client_tls(pki), "plaintext": None,
        "trusts another CA": client_tls(pki, "stranger_ca")})
    assert answered == {"tls": True, "plaintext": False, "trusts another CA": False}


def test_mtls_wants_a_client_certificate_of_its_ca(redis_server: RedisServer, prefix: str,
                                                   pki: dict[str, Path]) -> None:
    tls = ServerTls.load(str(pki["server_cert"]), str(pki["server_key"]), str(pki["ca"]))
    assert tls is not None
    answered = run_scheduler(redis_server, prefix, tls, {
        "client certificate": client_tls(pki, who="client"),
        "no client certificate": client_tls(pki),
        "another CA's certificate": client_tls(pki, who="stranger"),
        "plaintext": None})
    assert answered == {"client certificate": True, "no client certificate": False,
                        "another CA's certificate": False, "plaintext": False}


def test_bad_tls_settings_are_named(pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(AgentEnvError, match=r"AENV_SCHEDULER_TLS_CERT .* go together"):
        ServerTls.load(str(pki["server_cert"]), None, None)
    with pytest.raises(AgentEnvError, match=r"AENV_SCHEDULER_TLS_CLIENT_CA .* needs"):
        ServerTls.load(None, None, str(pki["ca"]))
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(AgentEnvError, match=re.escape(f"TLS_CA: {not_pem} holds no PEM")):
        ClientTls.from_env({"AENV_SCHEDULER_TLS_CA": str(not_pem)})
    with pytest.raises(AgentEnvError, match="go together"):
        ClientTls.from_env({"AENV_SCHEDULER_TLS_CA": str(pki["ca"]),
                            "AENV_SCHEDULER_TLS_CLIENT_CERT": str(pki["client_cert"])})
    assert ClientTls.from_env({}) is None  # plaintext, the default


def test_a_node_heartbeats_over_mtls(redis_server: RedisServer, prefix: str,
                                     pki: dict[str, Path], tmp_path: Path) -> None:
    """`aenv scheduler` with --tls-* and a node with only its key and AENV_SCHEDULER_TLS_*:
    the node registers; a plaintext client is refused by the same scheduler."""
    sched = SchedulerProcess(redis_server.url, prefix, tmp_path / "scheduler.log",
                             "--heartbeat-interval", "0.3",
                             "--tls-cert", str(pki["server_cert"]),
                             "--tls-key", str(pki["server_key"]),
                             "--tls-client-ca", str(pki["ca"]))
    key_file = tmp_path / "node-key"
    key_file.write_text(node_key(SECRET, "node-tls"))
    node = NodeProcess(
        tmp_path / "state", tmp_path / "node.log",
        extra_args=("--backend", "process", "--scheduler", sched.address,
                    "--node-id", "node-tls", "--node-key-file", str(key_file)),
        extra_env={"AENV_SCHEDULER_TLS_CA": str(pki["ca"]),
                   "AENV_SCHEDULER_TLS_CLIENT_CERT": str(pki["client_cert"]),
                   "AENV_SCHEDULER_TLS_CLIENT_KEY": str(pki["client_key"])},
    )

    async def listed(tls: ClientTls | None) -> list[str]:
        async with SchedulerClient(sched.address, Credentials.gateway(SECRET), timeout=10,
                                   tls=tls) as client:
            return [n.node_id for n in await client.list_nodes() if n.up]

    try:
        sched.start()
        node.start()
        wait_for("the node to register over mTLS",
                 lambda: "node-tls" in asyncio.run(listed(client_tls(pki, who="client"))),
                 timeout=60)
        with pytest.raises(SchedulerError) as caught:
            asyncio.run(listed(None))
        assert caught.value.code in (grpc.StatusCode.UNAVAILABLE,
                                     grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        node.stop()
        sched.stop()
