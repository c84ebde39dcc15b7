"""A local cluster for the gateway's tests and bench: Debian's redis-server (with the ACL and
passwords of `make cluster-up`), `aenv scheduler`,
N nodes (process backend unless asked otherwise) and `aenv gateway`, each its own process on
loopback. Only the scheduler and the gateway hold the cluster secret: each node is given its
own key (agentenv.cluster_keys, `aenv node-key`), as `make cluster-up` does, which runs the same
parts with each node in a network namespace of its own (scripts/cluster-up.sh)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from agentenv.cluster_keys import node_key
from agentenv.control.gateway.store import GatewayStore
from tests.control.conftest import AclRedis, SchedulerProcess, free_port
from tests.control.helpers import SECRET
from tests.node.conftest import NO_READY_POOLS, NodeProcess, vm_node_process

AENV = [sys.executable, "-m", "agentenv.cli.main"]
#: slot namespaces of a VM node of these tests (unique prefix: teardown removes {prefix}-s*)
VM_NET_PREFIX = "agw"
VM_FIRST_SLOT = 25501  # 25501-25700: disjoint from the other VM test modules and benches


class GatewayProcess:
    def __init__(self, scheduler: str, redis_url: str, secret_file: Path, log: Path,
                 domain: str | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [*AENV, "gateway", "--host", "127.0.0.1", "--port", str(self.port),
                     "--scheduler", scheduler, "--redis", redis_url,
                     "--cluster-secret-file", str(secret_file)]
        if domain:
            self.argv += ["--domain", domain]
        self.log = log
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=out,
                                         env={**os.environ, **self.env})

    def wait_ready(self) -> None:
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"gateway did not start: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class LocalCluster:
    def __init__(self, root: Path, nodes: int = 3, vm_nodes: int = 0,
                 heartbeat: float = 1.0, strategy: str = "least-loaded",
                 node_env: dict[str, str] | None = None) -> None:
        self.root = root
        self.vm_nodes = vm_nodes
        root.mkdir(parents=True, exist_ok=True)
        self.redis = AclRedis(root)  # as cluster-up runs it: a password per component
        self.secret_file = root / "cluster-secret"
        self.secret_file.write_text(SECRET + "\n")  # the scheduler's too (SchedulerProcess)
        os.chmod(self.secret_file, 0o600)
        self.secret = self.secret_file.read_text().strip()
        self.scheduler = SchedulerProcess(
            self.redis.url, "aenv:sched:", root / "scheduler.log",
            "--heartbeat-interval", str(heartbeat), "--missed-heartbeats", "3",
            "--strategy", strategy, *self.redis.args("scheduler"),
        )
        self.nodes: list[NodeProcess] = []
        for i in range(nodes):
            backend = "vm" if i < vm_nodes else "process"
            if backend == "vm":
                # tests/node's VM node: shared guest assets, its own slot range, a state
                # directory QEMU (aenv-vm) can reach
                node = vm_node_process(root / f"node{i}", root / f"node{i}.log",
                                       VM_NET_PREFIX, VM_FIRST_SLOT + 100 * i, NO_READY_POOLS)
            else:
                node = NodeProcess(root / f"node{i}", root / f"node{i}.log")
            key_file = root / f"node{i}.key"
            key_file.write_text(node_key(SECRET, f"node{i}") + "\n")
            os.chmod(key_file, 0o600)
            node.extra_args = ("--backend", backend, "--scheduler", self.scheduler.address,
                               "--node-id", f"node{i}", "--advertise", f"127.0.0.1:{node.port}",
                               "--node-key-file", str(key_file))
            node.extra_env = {**node.extra_env, **(node_env or {})}
            self.nodes.append(node)
        self.gateway = GatewayProcess(self.scheduler.address, self.redis.url, self.secret_file,
                                      root / "gateway.log", env=self.redis.env("gateway"))
        self.keys: dict[str, str] = {}

    @property
    def url(self) -> str:
        return self.gateway.url

    def start(self) -> None:
        # Every process starts at once and is waited for after: most of a start is Python
        # loading its modules, which the host's cores do side by side. A node up before the
        # scheduler retries its heartbeat.
        self.redis.start()
        parts = [self.scheduler, *self.nodes, self.gateway]
        for part in parts:
            part.spawn()
        for part in parts:
            part.wait_ready()
        self.wait_nodes_up(len(self.nodes))

    def team(self, name: str) -> str:
        """A new team with one key; returns the key. Made through the gateway's store as
        `aenv team create` and `aenv team key` make it (their CLI is tests/control/
        test_redis_auth.py's), without two more Python starts per team."""
        async def make() -> str:
            store = GatewayStore(self.redis.url, self.redis.auth("gateway"))
            try:
                await store.create_team(name)
                return await store.new_key(name)
            finally:
                await store.close()

        # its own thread and loop: a caller may be inside a running loop
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            self.keys[name] = pool.submit(asyncio.run, make()).result()
        return self.keys[name]

    def node_headers(self, node: NodeProcess, team: str) -> dict[str, str]:
        """What the gateway sends `node` with a request of `team`: that node's key and the
        team."""
        return {"x-agentenv-node-key": node_key(self.secret, f"node{self.nodes.index(node)}"),
                "x-agentenv-team": team}

    def up_nodes(self) -> set[str]:
        """The nodes the gateway reports up (none while it cannot reach the scheduler)."""
        key = next(iter(self.keys.values()), None) or self.team("probe")
        try:
            answer = httpx.get(self.url + "/nodes", headers={"X-API-KEY": key}, timeout=30)
        except httpx.HTTPError:
            return set()
        if answer.status_code == 503:
            return set()
        answer.raise_for_status()
        return {n["nodeID"] for n in answer.json() if n.get("status") != "unhealthy"}

    def wait_nodes_up(self, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.up_nodes()) >= count:
                return
            time.sleep(0.1)
        raise RuntimeError(f"only {self.up_nodes()} of {count} nodes up")

    def node_of(self, node_id: str) -> NodeProcess:
        return self.nodes[int(node_id.removeprefix("node"))]

    def stop(self) -> None:
        self.gateway.stop()
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.cleanup()
        if self.vm_nodes:
            from agentenv.runtime.network import remove_leftovers

            asyncio.run(remove_leftovers(VM_NET_PREFIX))
        self.scheduler.stop()
        self.redis.stop()


#: node sizes admission never refuses: for tests whose subject is not admission
ROOMY_NODES = {"AENV_NODE_VCPUS": "64", "AENV_MEMORY_BUDGET_MB": "100000"}


@contextlib.contextmanager
def running(cluster: LocalCluster, *teams: str) -> Iterator[LocalCluster]:
    """`cluster` started, with an API key for each of `teams`; stopped whatever happens."""
    try:
        cluster.start()
        for team in teams:
            cluster.team(team)
        yield cluster
    finally:
        cluster.stop()
