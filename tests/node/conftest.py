"""Fixtures: a real node server process on a free loopback port (`--backend process` unless a
test asks for the VM backend, which is the CLI's default)."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.template.registry_server import Registry, running_registry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Host ports a test node's process sandboxes may reach as their own
#: (AENV_PROCESS_BACKEND_HOST_PORTS): servers a test runs on the host stand in for a sandbox's.
TEST_HOST_PORTS = range(24000, 25000)


def free_host_port() -> int:
    """A free port of TEST_HOST_PORTS, for a host server standing in for a sandbox's."""
    for port in random.sample(TEST_HOST_PORTS, len(TEST_HOST_PORTS)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {TEST_HOST_PORTS}")


def _pids_using(state_dir: Path) -> list[int]:
    """Processes whose command line names state_dir: the envd processes a node started."""
    needle = str(state_dir).encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if needle in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


class NodeProcess:
    """`python -m agentenv.node` on a free port; restartable on the same state directory."""

    def __init__(self, state_dir: Path, log_path: Path, *,
                 extra_args: tuple[str, ...] = ("--backend", "process"),
                 extra_env: dict[str, str] | None = None, start_timeout: float = 90,
                 cpus: set[int] | None = None) -> None:
        """`cpus`: the CPUs the node (and its process sandboxes) may run on, as `taskset`."""
        self.state_dir = state_dir
        self.cpus = cpus
        self.log_path = log_path
        self.extra_args = extra_args
        self.extra_env = extra_env or {}
        self.start_timeout = start_timeout
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def tls_ca(self) -> str | None:
        """The CA this node's certificate is checked with, where it serves TLS (relay/tls.py)."""
        return self.extra_env.get("AENV_NODE_TLS_CA") \
            if self.extra_env.get("AENV_NODE_TLS_CERT") else None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls_ca else 'http'}://127.0.0.1:{self.port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else True

    @property
    def api_key(self) -> str:
        return (self.state_dir / "secrets" / "api-key").read_text().strip()

    def start(self) -> None:
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start the process without waiting for it (several start at once: wait_ready each)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "agentenv.node",
                    *self.extra_args,
                    "--state-dir",
                    str(self.state_dir),
                    "--port",
                    str(self.port),
                ],
                stdout=log,
                stderr=log,
                # a process-backend node of a test cluster is a development cluster
                env={k: v for k, v in os.environ.items() if k != "AENV_API_KEY"}
                | {"AENV_ALLOW_PROCESS_BACKEND_IN_CLUSTER": "1",
                   "AENV_PROCESS_BACKEND_HOST_PORTS":
                   f"{TEST_HOST_PORTS.start}-{TEST_HOST_PORTS.stop - 1}"} | self.extra_env,
                preexec_fn=(None if self.cpus is None
                            else lambda: os.sched_setaffinity(0, self.cpus or ())),
            )

    def wait_ready(self) -> None:
        """Wait until the spawned node answers /health; a node that exits raises with its log."""
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + self.start_timeout
        verify = self.verify
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited: {self.log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1, verify=verify).status_code == 200:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"node did not start: {self.log_path.read_text()[-3000:]}")

    def stop(self) -> int:
        """Graceful stop (SIGTERM); returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.proc = None
        return code

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def client(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            headers={"X-API-KEY": key if key is not None else self.api_key},
            timeout=60,
            trust_env=False,
            verify=self.verify,
        )

    def cleanup(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.stop()
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
        for pid in _pids_using(self.state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # FUSE mounts of processes killed above (blockd's memfs) would stay behind, dead.
        real = str(self.state_dir.resolve())
        with open("/proc/self/mounts") as mounts:
            points = [line.split()[1] for line in mounts if line.split()[1].startswith(real)]
        for point in points:
            subprocess.run(["fusermount3", "-u", "-z", "-q", point], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


#: how much of a node's log a failed test's report carries
FAILED_LOG_TAIL = 12_000


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used a node: its report carries the tail of the node's log (the
    node's temporary directory, and the log with it, is gone once the module ends; a failure
    in a full run, e.g. a create's 500, was otherwise left without its cause)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, NodeProcess):
            with contextlib.suppress(OSError):
                with open(value.log_path, "rb") as log:
                    log.seek(0, os.SEEK_END)
                    log.seek(max(0, log.tell() - FAILED_LOG_TAIL))
                    tail = log.read().decode(errors="replace")
                report.sections.append((f"log of node {name!r} (last {FAILED_LOG_TAIL} bytes)",
                                        tail))


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[type[NodeProcess] | object]:
    """A factory: make_node() -> started NodeProcess with its own state directory."""
    made: list[NodeProcess] = []

    def make(state_dir: Path | None = None) -> NodeProcess:
        node = NodeProcess(state_dir or tmp_path / f"state{len(made)}", tmp_path / "node.log")
        made.append(node)
        node.start()
        return node

    yield make
    for node in made:
        node.cleanup()


@pytest.fixture(scope="session")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node shared by the test session (tests clean up the sandboxes they make)."""
    base = tmp_path_factory.mktemp("node")
    proc = NodeProcess(base / "state", base / "node.log")
    proc.start()
    yield proc
    proc.cleanup()


@contextlib.contextmanager
def sdk_pointed_at(node: NodeProcess) -> Iterator[NodeProcess]:
    """Point the official e2b SDK at `node` (as a user would, by environment); restore after."""
    with environ_set({"E2B_API_URL": node.url, "E2B_SANDBOX_URL": node.url,
                      "E2B_VOLUME_API_URL": node.url, "E2B_API_KEY": node.api_key}):
        yield node


@contextlib.contextmanager
def environ_set(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set for the block, then as it was."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def sdk_env(node: NodeProcess) -> Iterator[NodeProcess]:
    with sdk_pointed_at(node):
        yield node


# --- the node with --backend vm (root, QEMU) ------------------------------------------------------

# Guest assets, shared with tests/runtime; AENV_TEST_GUEST_STATE gives a checkout that changes the
# guest (envd, init) assets of its own, so two checkouts on one host do not rebuild each other's.
GUEST_STATE = Path(os.environ.get("AENV_TEST_GUEST_STATE", "/var/cache/aenv-test/guest/state"))
DEBIAN_CACHE = Path("/var/cache/aenv-test/guest")  # the base template's debootstrap tarballs
# extra_env for a node without ready pools: tests that count VMs or files see only their own.
NO_READY_POOLS = {"AENV_VM_POOL_LOW": "0", "AENV_VM_POOL_HIGH": "0"}


_REACHABLE_ROOTS: list[Path] = []
_TEMPLATE_CACHE: list[Path] = []


def template_cache() -> Path:
    """The built-in templates' cache every VM node of this session shares
    (AENV_VM_TEMPLATE_CACHE): the first node to need base (or code-interpreter-v1) builds it,
    the others take it. A new one per session, so every run still builds each once; under /tmp,
    beside the nodes' state, so that publishing a build is a rename."""
    if not _TEMPLATE_CACHE:
        root = Path(tempfile.mkdtemp(prefix="aenv-templates-", dir="/tmp"))
        atexit.register(shutil.rmtree, root, True)
        _TEMPLATE_CACHE.append(root / "cache")
    return _TEMPLATE_CACHE[0]


def reachable_state_dir(state_dir: Path) -> Path:
    """Where a VM node's state really lives. QEMU runs as the unprivileged aenv-vm and opens
    the VM's files by path, through every directory above them; pytest's temporary directories
    are 0700, and every pytest session (any concurrent one on the host) resets
    /tmp/pytest-of-root to 0700. So the state lives in a 0711 directory of its own under /tmp,
    `state_dir` being a symlink to it (a restart on the same `state_dir` finds it again)."""
    if state_dir.is_symlink():
        return state_dir.resolve()
    if state_dir.exists():
        return state_dir
    real = Path(tempfile.mkdtemp(prefix="aenv-vmnode-", dir="/tmp"))
    real.chmod(0o711)
    _REACHABLE_ROOTS.append(real)
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    state_dir.symlink_to(real / "state")
    return real / "state"


@pytest.fixture(scope="session", autouse=True)
def _remove_reachable_roots() -> Iterator[None]:
    yield

    for root in _REACHABLE_ROOTS:
        shutil.rmtree(root, ignore_errors=True)


def vm_node_process(state_dir: Path, log_path: Path, net_prefix: str, first_slot: int,
                    extra_env: dict[str, str] | None = None) -> NodeProcess:
    """The node subprocess with --backend vm (its first start builds the base template, and
    code-interpreter-v1 where extra_env sets AENV_VM_CODE_INTERPRETER=1).
    Each test module uses its own slot prefix and addresses: teardown deletes its namespaces."""
    return NodeProcess(
        reachable_state_dir(state_dir), log_path, extra_args=("--backend", "vm"),
        extra_env={"AENV_VM_ASSETS_DIR": str(GUEST_STATE), "AENV_VM_DEBIAN_CACHE": str(DEBIAN_CACHE),
                   "AENV_VM_TEMPLATE_CACHE": str(template_cache()),
                   "AENV_VM_NETWORK_PREFIX": net_prefix, "AENV_VM_FIRST_SLOT": str(first_slot),
                   # only the modules that test it pay for the code-interpreter-v1 build
                   "AENV_VM_CODE_INTERPRETER": "0",
                   **(extra_env or {})},
        start_timeout=600,  # guest assets + debootstrap on a cold cache
    )


@contextlib.contextmanager
def serving_vm_node(node: NodeProcess, net_prefix: str,
                    point_sdk: bool = True) -> Iterator[NodeProcess]:
    """Start a VM-backend node with the SDK pointed at it (unless not `point_sdk`); at the end
    a graceful stop (which must succeed), then its files and its network slots are removed
    whatever happened."""
    import asyncio

    from agentenv.runtime import nfs_net
    from agentenv.runtime.network import remove_leftovers

    if os.geteuid() != 0:
        pytest.skip("the VM backend needs root (network namespaces, nftables, blockd)")
    if shutil.which("qemu-system-x86_64") is None:
        pytest.fail("qemu-system-x86_64 is missing: run scripts/install-system.sh")
    try:
        node.start()
        with sdk_pointed_at(node) if point_sdk else contextlib.nullcontext(node):
            yield node
        if node.proc is not None:
            assert node.stop() in (0, -15), node.log_path.read_text()[-3000:]
    finally:
        node.cleanup()
        asyncio.run(remove_leftovers(net_prefix))
        # and its NFS server's network namespace, if a killed node left it (runtime/nfs_net.py)
        with contextlib.suppress(Exception):
            nfs_net.remove_leftover(net_prefix)


@contextlib.contextmanager
def template_build_node(base: Path, net_prefix: str, first_slot: int,
                        layer_cache: Path) -> Iterator[NodeProcess]:
    """A serving VM node for template builds: converted layers cached in `layer_cache` (kept
    across runs), no parked VMs (they would take CPU from the builds)."""
    layer_cache.mkdir(parents=True, exist_ok=True)
    node = vm_node_process(base / "state", base / "node.log", net_prefix, first_slot,
                           {"AENV_LAYER_CACHE": str(layer_cache), **NO_READY_POOLS})
    with serving_vm_node(node, net_prefix):
        yield node


@contextlib.contextmanager
def code_interpreter_node(base: Path, net_prefix: str, first_slot: int) -> Iterator[NodeProcess]:
    """A serving VM node with the code-interpreter-v1 template and one ready VM per template,
    for the benches run outside pytest (bench/code_interpreter_bench.py,
    bench/e2b_code_interpreter_suite.py); afterwards `base` and the reachable state roots go."""
    node = vm_node_process(
        base / "state", base / "node.log", net_prefix, first_slot,
        {"AENV_VM_CODE_INTERPRETER": "1", "AENV_VM_POOL_LOW": "1", "AENV_VM_POOL_HIGH": "1"})
    node.start_timeout = 1200
    try:
        with serving_vm_node(node, net_prefix):
            yield node
    finally:
        for root in [*_REACHABLE_ROOTS, base]:
            shutil.rmtree(root, ignore_errors=True)


# One VM node shared by the modules whose tests need no ready pool and hold at most two
# sandboxes at a time (test_parity, test_build_secrets, test_admission's VM check): a VM node's
# start (guest assets check, base template build) is paid once instead of once per module. Its
# memory budget holds two base sandboxes (512 MiB + QEMU's 64 + 64 + 4 per vCPU each, 2 vCPUs)
# so test_admission can fill it with two creates. test_network_policy keeps a node of its own:
# it needs a ready pool (handover must get the create's policy), kills its node with SIGKILL
# and holds up to four sandboxes at once.
SHARED_VM_PREFIX, SHARED_VM_FIRST_SLOT = "asv", 28801  # 28801-29000
BASE_SANDBOX_MB = 512 + 64 + 64 + 4 * 2
SHARED_VM_BUDGET_MB = 2 * BASE_SANDBOX_MB + 4


@pytest.fixture(scope="session")
def shared_vm_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """The shared VM node, started at its first use. The SDK is not pointed at it here (a
    session-long environment would leak into other modules): users wrap it in
    sdk_pointed_at(). Layer conversions of builds go to a cache of its own."""
    base = tmp_path_factory.mktemp("sharedvm")
    node = vm_node_process(base / "state", base / "node.log", SHARED_VM_PREFIX,
                           SHARED_VM_FIRST_SLOT,
                           {**NO_READY_POOLS, "AENV_LAYER_CACHE": str(base / "layer-cache"),
                            "AENV_MEMORY_BUDGET_MB": str(SHARED_VM_BUDGET_MB)})
    with serving_vm_node(node, SHARED_VM_PREFIX, point_sdk=False):
        yield node


# --- helpers for tests that watch a guest process ------------------------------------------
# A background counter: /tmp/count goes up every 100 ms while the process runs.
# Run it with `commands.run(COUNTER, background=True, timeout=0)`: the SDK's default command
# timeout (60 s) is the process's lifetime in envd, which kills it then; a fork child or a
# resumed sandbox checked later than that would see a counter that stopped.
COUNTER = (
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count;"
    " sleep 0.1; done"
)


def counter_value(sbx: Any) -> int:
    return int(sbx.commands.run("cat /tmp/count").stdout.strip())


def wait_counting(sbx: Any) -> int:
    """The counter's value once it has started (COUNTER run in the background)."""
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(Exception):
            if (n := counter_value(sbx)) >= 2:
                return n
        assert time.monotonic() < deadline, "the background counter did not start"
        time.sleep(0.2)


def pid_alive(pid: int) -> bool:
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A loopback docker-registry without auth, one per test module that asks for it."""
    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


def ws_echo_server(port: int) -> Callable[[], None]:
    """A WebSocket echo server on a host port the process backend's sandboxes own (it
    stands in for a server in the sandbox); returns its stop()."""
    import asyncio
    import threading

    from websockets.asyncio.server import serve

    ready = threading.Event()
    stop: list[asyncio.Future[None]] = []

    async def echo(ws: Any) -> None:
        async for message in ws:
            await ws.send(message)

    async def server() -> None:
        async with serve(echo, "127.0.0.1", port):
            stop.append(asyncio.get_running_loop().create_future())
            ready.set()
            await stop[0]

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server(),), daemon=True)
    thread.start()
    assert ready.wait(10)

    def stopped() -> None:
        loop.call_soon_threadsafe(stop[0].set_result, None)
        thread.join(10)

    return stopped


# --- a process node whose proxy takes WS_CLIENTS WebSockets, and a sandbox on it -------------
# (the WebSocket relay's tests: test_ws_backpressure.py, test_ws_client_stream.py)
WS_CLIENTS = 32


@pytest.fixture(scope="module")
def ws_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("ws-node")
    node = NodeProcess(base / "state", base / "node.log")
    node.extra_args = ("--backend", "process")
    node.extra_env = {"AENV_PROXY_MAX_WEBSOCKETS": str(WS_CLIENTS)}
    node.start()
    yield node
    node.cleanup()


@pytest.fixture(scope="module")
def ws_sandbox_id(ws_node: NodeProcess) -> Iterator[str]:
    with ws_node.client() as api:
        created = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
        assert created.status_code == 201, created.text
        sid = created.json()["sandboxID"]
        yield sid
        api.delete(f"/sandboxes/{sid}")
