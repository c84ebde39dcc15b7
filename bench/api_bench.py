"""Node server benchmark: API and proxy cost, each measured beside a baseline in the same run.

`--backend vm` (the default): create-run-kill latency of QEMU sandboxes
through the E2B API, one at a time and 8 concurrent, and sustained creates/s, in the same run
(1) with the node's ready pool (`--pool-low/--pool-high`; sequential creates start once the pool
is refilled), (2) the same node restarted without a pool, and (3) the baselines: the runtime's
bare restore of the same snapshot, and the bare `/init` on a VM the bench pre-restored and
warmed itself (what a pooled create leaves to do, so the API's overhead shows). It also prints
where a pooled create's time goes (node log timings and the create-op histogram) and what a
pool fill costs per VM. `--suite pause` (part of `all`): a filesystem-only pause and its
connect (a cold boot from the disk) against a memory pause and its connect, p50 of each and the
disk each pause snapshot keeps. `--suite observe` (not in `all`): create, pause and resume p50
with lifecycle events, a webhook to a receiver taking 5 s per delivery and metrics sampled every
second, against all of them off (node/events.py, node/webhooks.py, node/observer.py).
`--backend process`:

- proxy_*: the same envd request through the node's proxy (E2b-Sandbox-Id routing) and straight
  to the sandbox's envd port (baseline). The ratio is the proxy's overhead.
- create_to_ready_ms: `POST /v2/sandboxes` until the 201 (envd ready, /init done), against the
  baseline of doing the process backend's raw work by hand (copy the template, start envd, poll
  /health) without the API and orchestrator.
- api_list_rps: `GET /v2/sandboxes` with live sandboxes against `GET /health` (the cheapest route).

Prints one JSON object per line. `--quick` keeps it under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def emit(metric: str, value: float, unit: str, baseline: str, baseline_value: float) -> None:
    ratio = value / baseline_value if baseline_value else float("nan")
    print(
        json.dumps(
            {
                "metric": metric,
                "value": round(value, 3),
                "unit": unit,
                "baseline": baseline,
                "baseline_value": round(baseline_value, 3),
                "ratio": round(ratio, 3),
            }
        ),
        flush=True,
    )


def p50_ms(fn: Callable[[], Any], n: int) -> float:
    fn()  # warm
    times = []
    for _ in range(n):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def start_request(cmd: str) -> bytes:
    payload = json.dumps(
        {"process": {"cmd": "/bin/bash", "args": ["-c", cmd]}, "stdin": False}
    ).encode()
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def stdout_of(stream: bytes) -> str:
    """The stdout of a whole envd Process/Start answer (Connect envelopes)."""
    pos, out = 0, b""
    while pos < len(stream):
        size = int.from_bytes(stream[pos + 1 : pos + 5], "big")
        message = json.loads(stream[pos + 5 : pos + 5 + size])
        pos += 5 + size
        stdout = message.get("event", {}).get("data", {}).get("stdout")
        if stdout:
            out += base64.b64decode(stdout)
    return out.decode()


def run_command(client: httpx.Client, cmd: str) -> str:
    answer = client.post(
        "/process.Process/Start",
        content=start_request(cmd),
        headers={"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"},
    )
    return stdout_of(answer.content)


def process_main(args: argparse.Namespace) -> None:
    rounds = 30 if args.quick else 200
    creates = 5 if args.quick else 20
    transfer_mib = 16 if args.quick else 64

    work = Path(tempfile.mkdtemp(prefix="aenv-api-bench-"))
    work.chmod(0o711)  # QEMU runs as aenv-vm: it must reach the state dir
    state = work / "state"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "node.log", "wb")  # noqa: SIM115 - lives as long as the node
    node = subprocess.Popen(
        [sys.executable, "-m", "agentenv.node", "--backend", "process", "--state-dir",
         str(state), "--port", str(port)],
        stdout=log,
        stderr=log,
    )
    sandboxes: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or node.poll() is not None:
                raise SystemExit(f"node did not start: {(work / 'node.log').read_text()[-2000:]}")
            time.sleep(0.05)
        key = (state / "secrets" / "api-key").read_text().strip()
        api = httpx.Client(base_url=url, headers={"X-API-KEY": key}, timeout=60, trust_env=False)

        # create until ready, against the backend's raw work done by hand
        def create() -> None:
            sandboxes.append(api.post("/v2/sandboxes", json={"timeout": 600}).json()["sandboxID"])

        created_ms = p50_ms(create, creates)
        template = state / "process-backend" / "templates" / "base"

        poller = httpx.Client(timeout=2, trust_env=False)

        def raw_start() -> None:
            root = work / f"raw{len(list(work.glob('raw*')))}"
            subprocess.run(["cp", "-a", "--reflink=auto", str(template), str(root)], check=True)
            envd_port = free_port()
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "agentenv.guest.envd",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(envd_port),
                    "--root",
                    str(root),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                while True:  # poll like the orchestrator does: one client, short sleeps
                    try:
                        if poller.get(f"http://127.0.0.1:{envd_port}/health").is_success:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.01)
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                shutil.rmtree(root)

        emit(
            "create_to_ready_ms",
            created_ms,
            "ms",
            "copy+envd start by hand",
            p50_ms(raw_start, creates),
        )

        sid = sandboxes[0]
        detail = api.get(f"/sandboxes/{sid}").json()
        token = detail["envdAccessToken"]
        run_json = json.loads(
            (state / "process-backend" / "sandboxes" / sid / "run.json").read_text()
        )
        direct = httpx.Client(
            base_url=f"http://127.0.0.1:{run_json['envd_port']}",
            headers={"X-Access-Token": token},
            timeout=60,
            trust_env=False,
        )
        proxied = httpx.Client(
            base_url=url,
            headers={"X-Access-Token": token, "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"},
            timeout=60,
            trust_env=False,
        )
        emit(
            "proxy_health_p50_ms",
            p50_ms(lambda: proxied.get("/health"), rounds),
            "ms",
            "envd direct",
            p50_ms(lambda: direct.get("/health"), rounds),
        )
        assert run_command(proxied, "echo ok") == "ok\n"
        emit(
            "proxy_command_p50_ms",
            p50_ms(lambda: run_command(proxied, "true"), rounds // 2),
            "ms",
            "envd direct",
            p50_ms(lambda: run_command(direct, "true"), rounds // 2),
        )

        blob = os.urandom(1 << 20) * transfer_mib

        def upload(client: httpx.Client) -> float:
            began = time.perf_counter()
            answer = client.post(
                "/files",
                params={"path": "/tmp/blob"},
                content=iter([blob[i : i + (1 << 20)] for i in range(0, len(blob), 1 << 20)]),
                headers={"Content-Type": "application/octet-stream"},
            )
            answer.raise_for_status()
            return transfer_mib / (time.perf_counter() - began)

        def download(client: httpx.Client) -> float:
            began = time.perf_counter()
            size = 0
            with client.stream("GET", "/files", params={"path": "/tmp/blob"}) as answer:
                for chunk in answer.iter_raw():
                    size += len(chunk)
            assert size == len(blob), size
            return transfer_mib / (time.perf_counter() - began)

        emit("proxy_upload_MiBps", upload(proxied), "MiB/s", "envd direct", upload(direct))
        direct_down = download(direct)
        emit("proxy_download_MiBps", download(proxied), "MiB/s", "envd direct", direct_down)

        async def async_download() -> float:
            # what the proxy's own upstream client (httpx.AsyncClient) reads from envd alone
            async with httpx.AsyncClient(
                base_url=str(direct.base_url), headers={"X-Access-Token": token}, timeout=60
            ) as client:
                began = time.perf_counter()
                async with client.stream("GET", "/files", params={"path": "/tmp/blob"}) as answer:
                    async for _ in answer.aiter_raw():
                        pass
                return transfer_mib / (time.perf_counter() - began)

        emit(
            "httpx_async_download_MiBps",
            asyncio.run(async_download()),
            "MiB/s",
            "envd direct (sync httpx)",
            direct_down,
        )

        def rps(fn: Callable[[], Any], seconds: float) -> float:
            count, began = 0, time.perf_counter()
            while time.perf_counter() - began < seconds:
                fn()
                count += 1
            return count / (time.perf_counter() - began)

        span = 2.0 if args.quick else 5.0
        emit(
            "api_list_rps",
            rps(lambda: api.get("/v2/sandboxes"), span),
            "req/s",
            "GET /health",
            rps(lambda: api.get("/health"), span),
        )
    finally:
        try:
            for sid in sandboxes:
                httpx.delete(f"{url}/sandboxes/{sid}", headers={"X-API-KEY": key}, timeout=30)
        except (httpx.HTTPError, NameError):
            pass
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


# --- VM backend -------------------------------------------------------------------------------

#: Guest assets and debootstrap tarballs the tests keep; used when present (else the state dir's).
TEST_ASSETS = Path("/var/cache/aenv-test/guest/state")
TEST_DEBIAN = Path("/var/cache/aenv-test/guest")
NODE_PREFIX, NODE_FIRST_SLOT = "avb", 26001  # the bench node's network slots
BARE_PREFIX, BARE_FIRST_SLOT = "avr", 32401  # the baseline runtime's (32001-32400: tests/node/test_ready_pool.py; SlotPool indices end at 32767)


class VmNode:
    """`aenv serve --backend vm` on a kept state directory (the base template is built on the
    first run only) and a free loopback port."""

    def __init__(self, state_dir: Path, pool_low: int = 0, pool_high: int = 0,
                 extra_env: dict[str, str] | None = None) -> None:
        self.state_dir = state_dir
        self.pool_low, self.pool_high = pool_low, max(pool_high, pool_low)
        self.extra_env = extra_env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = state_dir / "bench-node.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def key(self) -> str:
        return (self.state_dir / "secrets" / "api-key").read_text().strip()

    @property
    def blockd_socket(self) -> Path:
        return self.state_dir / "vm-backend" / "blockd" / "blockd.sock"

    def start(self, timeout: float = 1800) -> float:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "AENV_API_KEY"}
        env |= {"AENV_VM_NETWORK_PREFIX": NODE_PREFIX, "AENV_VM_FIRST_SLOT": str(NODE_FIRST_SLOT),
                "AENV_VM_POOL_LOW": str(self.pool_low), "AENV_VM_POOL_HIGH": str(self.pool_high),
                **self.extra_env}
        if TEST_ASSETS.is_dir() and "AENV_VM_ASSETS_DIR" not in env:
            env |= {"AENV_VM_ASSETS_DIR": str(TEST_ASSETS),
                    "AENV_VM_DEBIAN_CACHE": str(TEST_DEBIAN)}
        began = time.monotonic()
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agentenv.node", "--backend", "vm", "--state-dir",
                 str(self.state_dir), "--port", str(self.port)], stdout=log, stderr=log, env=env)
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1, trust_env=False).is_success:
                    return time.monotonic() - began
            if self.proc.poll() is not None or time.monotonic() - began > timeout:
                raise SystemExit(f"node did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.1)

    def log_lines(self, msg: str) -> list[dict[str, Any]]:
        """This run's JSON log lines whose message is `msg`."""
        found = []
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            for raw in f:
                with contextlib.suppress(ValueError):
                    line = json.loads(raw)
                    if isinstance(line, dict) and line.get("msg") == msg:
                        found.append(line)
        return found

    def pooled_now(self) -> int:
        """VMs parked in the ready pools (from the node's log: parked - taken - discarded)."""
        return (len(self.log_lines("ready pool VM parked"))
                - len(self.log_lines("sandbox VM from the ready pool"))
                - len(self.log_lines("pooled VM failed at create: restoring instead"))
                - len(self.log_lines("ready pool VM discarded")))

    def wait_pooled(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.pooled_now() < count:
            if time.monotonic() > deadline:
                raise SystemExit(f"the ready pool did not reach {count} VMs in {timeout:.0f} s")
            time.sleep(0.1)

    def stop(self, timeout: float = 900) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def remove_network(prefix: str) -> None:
    from agentenv.runtime.network import remove_leftovers

    asyncio.run(remove_leftovers(prefix))


async def run_async(client: httpx.AsyncClient, base: str, headers: dict[str, str], cmd: str) -> str:
    """envd Process/Start of `bash -c cmd`; returns its stdout once the process ended."""
    answer = await client.post(
        base + "/process.Process/Start", content=start_request(cmd),
        headers={"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
                 **headers})
    answer.raise_for_status()
    return stdout_of(answer.content)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def measure(op: Callable[[], Any], total: int, concurrency: int
                  ) -> tuple[list[dict[str, float]], float]:
    """Run `op` (an async function returning phase timings) `total` times, `concurrency` at a
    time; returns every run's timings and the wall time."""
    results: list[dict[str, float]] = []
    queue = iter(range(total))

    async def worker() -> None:
        for _ in queue:
            results.append(await op())

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - began


def create_op_mean_ms(url: str, key: str) -> tuple[float, int]:
    """Sum (ms) and count of the orchestrator's create operations (Prometheus histogram)."""
    text = httpx.get(url + "/metrics", headers={"X-API-KEY": key}, timeout=10,
                     trust_env=False).text
    total, count = 0.0, 0
    for line in text.splitlines():
        if 'op="create"' in line and 'outcome="ok"' in line:
            if line.startswith("aenv_node_sandbox_operation_seconds_sum"):
                total = float(line.rsplit(" ", 1)[1]) * 1e3
            elif line.startswith("aenv_node_sandbox_operation_seconds_count"):
                count = int(float(line.rsplit(" ", 1)[1]))
    return total, count


class Phase:
    """One node configuration's API measurements (the same ops for pool on and off)."""

    def __init__(self, node: VmNode) -> None:
        self.node = node
        self.api = httpx.AsyncClient(base_url=node.url, headers={"X-API-KEY": node.key},
                                     timeout=120, trust_env=False,
                                     limits=httpx.Limits(max_connections=64))
        self.envd = httpx.AsyncClient(timeout=120, trust_env=False)

    async def op(self) -> dict[str, float]:
        t0 = time.perf_counter()
        answer = await self.api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
        answer.raise_for_status()
        body = answer.json()
        t1 = time.perf_counter()
        headers = {"E2b-Sandbox-Id": body["sandboxID"], "E2b-Sandbox-Port": "49983",
                   "X-Access-Token": body["envdAccessToken"]}
        assert await run_async(self.envd, self.node.url, headers, "echo ok") == "ok\n"
        t2 = time.perf_counter()
        (await self.api.delete(f"/sandboxes/{body['sandboxID']}")).raise_for_status()
        t3 = time.perf_counter()
        return {"create": (t1 - t0) * 1e3, "run": (t2 - t1) * 1e3, "kill": (t3 - t2) * 1e3,
                "total": (t3 - t0) * 1e3}

    async def sequential(self, count: int, refill_to: int) -> list[dict[str, float]]:
        """`count` ops one at a time; with a pool, each starts once the pool is back at
        `refill_to` (the latency of a create that finds a VM ready)."""
        out = []
        for _ in range(count):
            if refill_to:
                await asyncio.to_thread(self.node.wait_pooled, refill_to)
            out.append(await self.op())
        return out

    async def close(self) -> None:
        await self.api.aclose()
        await self.envd.aclose()


async def vm_measurements(pool_node: VmNode, work: Path, quick: bool) -> None:
    from agentenv.blockd.client import AsyncBlockdClient
    from agentenv.node.vm_backend import SLOT_COOLDOWN
    from agentenv.runtime.config import RuntimeConfig
    from agentenv.runtime.vm import Runtime
    from agentenv.snapshot.record import SnapshotRecord

    sequential, rounds_c8, sustained = (3, 1, 8) if quick else (20, 2, 32)
    low = pool_node.pool_low
    meta = json.loads((pool_node.state_dir / "templates" / "base" / "template.json").read_text())
    record = SnapshotRecord.load(Path(meta["record_dir"]))
    envd = httpx.AsyncClient(timeout=120, trust_env=False)

    # The baselines: the runtime alone, configured like the node's, restoring the same
    # snapshot with disks on the node's own blockd; envd called straight at the VM's address.
    # bare_op is a create without a pool; bare_pooled_op is what a pooled create leaves to do
    # (the /init with the sandbox's identity on a VM restored and warmed beforehand).
    config = RuntimeConfig(state_dir=work / "runtime", accel=record.mode,
                           network_prefix=BARE_PREFIX, slot_first_index=BARE_FIRST_SLOT,
                           blockd_socket=pool_node.blockd_socket, slot_reuse_delay=SLOT_COOLDOWN)
    blockd: Any = None
    runtime: Any = None
    plain_node: VmNode | None = None

    async def run_and_kill(vm: Any, token: str, t0: float, t1: float) -> dict[str, float]:
        """Time `echo ok` in `vm` and its kill; `t0`..`t1` was its create."""
        try:
            assert await run_async(envd, vm.envd_url, {"X-Access-Token": token},
                                   "echo ok") == "ok\n"
            t2 = time.perf_counter()
        finally:
            await runtime.kill(vm)
        t3 = time.perf_counter()
        return {"create": (t1 - t0) * 1e3, "run": (t2 - t1) * 1e3, "kill": (t3 - t2) * 1e3,
                "total": (t3 - t0) * 1e3}

    async def bare_op() -> dict[str, float]:
        token = os.urandom(16).hex()
        t0 = time.perf_counter()
        vm = await runtime.restore(record, access_token=token)
        return await run_and_kill(vm, token, t0, time.perf_counter())

    async def bare_pooled_op() -> dict[str, float]:
        from agentenv.node.ready_pool import ReadyPool, ReadyPoolConfig

        pool = ReadyPool(runtime, ReadyPoolConfig(low=1, high=1), work / "pool")
        pool.start()
        key = str(Path(record.device_state).parent)
        try:
            pool.want(key, record, pinned=True)
            assert await pool.wait_ready(key, 1, 120), "the bench's own pool did not fill"
            vm = pool.take(key)
            await pool.drop(key)
            assert vm is not None
            token = os.urandom(16).hex()
            t0 = time.perf_counter()
            await runtime.envd_init(vm, {"E2B_SANDBOX_ID": "bench"}, token)
            return await run_and_kill(vm, token, t0, time.perf_counter())
        finally:
            await pool.close()

    def emit_pair(metric: str, a: list[float], base: str, b: list[float], q: float = 0.5) -> None:
        if q == 0.5:
            emit(metric, statistics.median(a), "ms", base, statistics.median(b))
        else:
            emit(metric, percentile(a, q), "ms", base, percentile(b, q))

    pooled = Phase(pool_node)
    try:
        # 1. The node with its ready pool (the default configuration).
        await asyncio.to_thread(pool_node.wait_pooled, low)
        await pooled.op()  # warm the API path and the connections once
        sum0, n0 = await asyncio.to_thread(create_op_mean_ms, pool_node.url, pool_node.key)
        taken0 = len(pool_node.log_lines("sandbox VM from the ready pool"))
        seq_pool = await pooled.sequential(sequential, low)
        sum1, n1 = await asyncio.to_thread(create_op_mean_ms, pool_node.url, pool_node.key)
        handovers = pool_node.log_lines("sandbox VM from the ready pool")[taken0:]
        await asyncio.to_thread(pool_node.wait_pooled, low)
        c8_pool, _ = await measure(pooled.op, 8 * rounds_c8, 8)
        await asyncio.to_thread(pool_node.wait_pooled, low)
        taken_before = len(pool_node.log_lines("sandbox VM from the ready pool"))
        _, pool_wall = await measure(pooled.op, sustained, 8)
        pool_hits = len(pool_node.log_lines("sandbox VM from the ready pool")) - taken_before
        parked = pool_node.log_lines("ready pool VM parked")
        await pooled.close()
        pool_node.stop()

        # 2. The same node restarted without a pool (same state dir, same template).
        plain_node = VmNode(pool_node.state_dir, 0, 0)
        plain_node.port = pool_node.port
        plain_node.url = pool_node.url
        await asyncio.to_thread(plain_node.start)
        plain = Phase(plain_node)
        try:
            await plain.op()
            seq_plain = await plain.sequential(sequential, 0)
            c8_plain, _ = await measure(plain.op, 8 * rounds_c8, 8)
            _, plain_wall = await measure(plain.op, sustained, 8)
        finally:
            await plain.close()

        # 3. The bare runtime (the node is still up: its blockd serves the disks).
        blockd = AsyncBlockdClient(plain_node.blockd_socket)
        runtime = Runtime(config, blockd=blockd)
        await runtime.start(kernel_for_probe=Path(record.machine.kernel))
        await bare_op()
        seq_bare = [await bare_op() for _ in range(sequential)]
        seq_bare_pooled = [await bare_pooled_op() for _ in range(sequential)]
        c8_bare, _ = await measure(bare_op, 8 * rounds_c8, 8)
        _, bare_wall = await measure(bare_op, sustained, 8)
        plain_node.stop()

        def col(rows: list[dict[str, float]], phase: str) -> list[float]:
            return [r[phase] for r in rows]

        restore = "runtime.restore (envd /init done)"
        emit_pair("vm_create_p50_ms", col(seq_pool, "create"),
                  "bare /init on a pre-restored warmed VM", col(seq_bare_pooled, "create"))
        emit_pair("vm_create_p99_ms", col(seq_pool, "create"),
                  "bare /init on a pre-restored warmed VM", col(seq_bare_pooled, "create"), 0.99)
        emit_pair("vm_create_pool_vs_restore_p50_ms", col(seq_pool, "create"), restore,
                  col(seq_bare, "create"))
        emit_pair("vm_create_nopool_p50_ms", col(seq_plain, "create"), restore,
                  col(seq_bare, "create"))
        emit_pair("vm_create_nopool_p99_ms", col(seq_plain, "create"), restore,
                  col(seq_bare, "create"), 0.99)
        emit("vm_api_create_overhead_ms",
             statistics.median(col(seq_pool, "create"))
             - statistics.median(col(seq_bare_pooled, "create")), "ms",
             "bare /init on a warmed VM p50", statistics.median(col(seq_bare_pooled, "create")))
        emit("vm_api_create_overhead_nopool_ms",
             statistics.median(col(seq_plain, "create"))
             - statistics.median(col(seq_bare, "create")), "ms",
             "runtime.restore p50", statistics.median(col(seq_bare, "create")))
        emit_pair("vm_create_run_kill_p50_ms", col(seq_pool, "total"),
                  "runtime restore + envd command + kill", col(seq_bare, "total"))
        emit_pair("vm_create_run_kill_nopool_p50_ms", col(seq_plain, "total"),
                  "runtime restore + envd command + kill", col(seq_bare, "total"))
        emit_pair("vm_first_command_p50_ms", col(seq_pool, "run"),
                  "first command after runtime.restore", col(seq_bare, "run"))
        base8 = "runtime restore + envd command + kill, 8 concurrent"
        emit_pair("vm_create_run_kill_c8_p50_ms", col(c8_pool, "total"), base8,
                  col(c8_bare, "total"))
        emit_pair("vm_create_run_kill_c8_nopool_p50_ms", col(c8_plain, "total"), base8,
                  col(c8_bare, "total"))
        emit_pair("vm_create_c8_p50_ms", col(c8_pool, "create"), "runtime.restore, 8 concurrent",
                  col(c8_bare, "create"))
        emit_pair("vm_create_c8_nopool_p50_ms", col(c8_plain, "create"),
                  "runtime.restore, 8 concurrent", col(c8_bare, "create"))
        loop = "runtime restores/s (same loop: restore, command, kill; 8 in flight)"
        emit("vm_sustained_creates_per_s", sustained / pool_wall, "creates/s", loop,
             sustained / bare_wall)
        emit("vm_sustained_creates_nopool_per_s", sustained / plain_wall, "creates/s", loop,
             sustained / bare_wall)
        # Where a pooled create's time goes (node log timings and the create op histogram).
        if handovers:
            init = [h["timings_ms"]["envd_init_ms"] for h in handovers]
            op_mean = (sum1 - sum0) / max(1, n1 - n0)
            api_mean = statistics.fmean(col(seq_pool, "create"))
            print(json.dumps({"breakdown": "pooled create (means, ms)",
                              "api_create": round(api_mean, 1),
                              "orchestrator_op": round(op_mean, 1),
                              "backend_envd_init": round(statistics.fmean(init), 1),
                              "backend_outbound": round(statistics.fmean(
                                  h["timings_ms"]["outbound_ms"] for h in handovers), 1),
                              "orchestrator_rest": round(op_mean - statistics.fmean(init), 1),
                              "http_and_api": round(api_mean - op_mean, 1),
                              "pool_hits_of_sequential": f"{len(handovers)}/{sequential}",
                              "pool_hits_of_sustained": f"{pool_hits}/{sustained}"}),
                  flush=True)
        if parked:
            print(json.dumps({"breakdown": "pool fill per VM (means, ms, background)",
                              "restore": round(statistics.fmean(p["restore_ms"] for p in parked), 1),
                              "warm": round(statistics.fmean(p["warm_ms"] for p in parked), 1)}),
                  flush=True)
    finally:
        if runtime is not None:
            await runtime.close()
        if blockd is not None:
            await blockd.close()
        if plain_node is not None:
            plain_node.stop()
        await envd.aclose()


def pause_record_dir(node: VmNode, sandbox_id: str) -> Path:
    """The snapshot directory of a paused sandbox's pause (its row in the node's SQLite)."""
    import sqlite3

    conn = sqlite3.connect(node.state_dir / "node.db")
    try:
        [(doc,)] = conn.execute("SELECT doc FROM sandboxes WHERE id = ?", (sandbox_id,))
    finally:
        conn.close()
    return Path(json.loads(doc)["pause_snapshot"]["data"]["record_dir"])


def allocated_bytes(directory: Path) -> int:
    """Disk the files of a snapshot directory take (sparse files count what they hold)."""
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


async def pause_measurements(node: VmNode, quick: bool) -> None:
    """A filesystem-only pause (`{"memory": false}`) and its connect (a cold boot from the disk)
    against a memory pause and its connect (a restore), in the same run: each round makes two
    sandboxes that write 16 MiB to their disk; one pauses with memory, the other filesystem-only;
    each is connected again, and its boot id must have changed only after the latter."""
    rounds = 2 if quick else 5
    api = httpx.AsyncClient(base_url=node.url, headers={"X-API-KEY": node.key}, timeout=600,
                            trust_env=False)
    envd = httpx.AsyncClient(timeout=120, trust_env=False)
    rows: dict[str, list[float]] = {k: [] for k in (
        "mem_pause", "mem_connect", "mem_bytes", "fs_pause", "fs_connect", "fs_bytes")}

    async def timed(method: str, url: str, body: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        answer = await api.request(method, url, json=body)
        answer.raise_for_status()
        return (time.perf_counter() - t0) * 1e3

    async def one(memory: bool) -> None:
        """A sandbox writes 16 MiB, pauses (with memory or not), is connected again."""
        mode = "mem" if memory else "fs"
        answer = await api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 900})
        answer.raise_for_status()
        body = answer.json()
        sid = body["sandboxID"]
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                   "X-Access-Token": body["envdAccessToken"]}

        async def run(cmd: str) -> str:
            for attempt in range(30):
                try:
                    return await run_async(envd, node.url, headers, cmd)
                except httpx.HTTPError:
                    if attempt == 29:
                        raise
                    await asyncio.sleep(1)
            raise AssertionError("unreachable")

        try:
            await run("head -c 16M /dev/urandom > /home/user/data.bin")
            boot = await run("cat /proc/sys/kernel/random/boot_id")
            rows[f"{mode}_pause"].append(await timed(
                "POST", f"/sandboxes/{sid}/pause", {} if memory else {"memory": False}))
            rows[f"{mode}_bytes"].append(allocated_bytes(pause_record_dir(node, sid)))
            rows[f"{mode}_connect"].append(await timed(
                "POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 900}))
            now = await run("cat /proc/sys/kernel/random/boot_id")
            assert (now == boot) == memory, f"boot id after a {mode} pause: {now!r}"
            assert (await run("wc -c < /home/user/data.bin")).strip() == str(16 << 20)
        finally:
            await api.delete(f"/sandboxes/{sid}")

    try:
        for _ in range(rounds):  # one sandbox per mode and round, the same work before each
            await one(True)
            await one(False)
    finally:
        await api.aclose()
        await envd.aclose()
    med = {k: statistics.median(v) for k, v in rows.items()}
    emit("vm_pause_filesystem_p50_ms", med["fs_pause"], "ms", "memory pause p50",
         med["mem_pause"])
    emit("vm_connect_filesystem_cold_boot_p50_ms", med["fs_connect"], "ms",
         "connect of a memory pause (restore) p50", med["mem_connect"])
    print(json.dumps({"metric": "vm_pause_snapshot_bytes", "filesystem": int(med["fs_bytes"]),
                      "memory": int(med["mem_bytes"]),
                      "ratio": round(med["fs_bytes"] / med["mem_bytes"], 3),
                      "note": "allocated bytes of the pause's own snapshot directory (not the template's "
                      "layers), p50, after 16 MiB written to the disk", "rounds": rounds}), flush=True)


class SlowReceiver:
    """A webhook receiver on loopback that takes `delay` seconds to answer each POST."""

    def __init__(self, delay: float) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from threading import Thread

        self.received = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                time.sleep(delay)
                outer.received += 1
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


#: events and metrics off, then on (events, metrics sampled every second, a webhook whose
#: receiver takes 5 s per delivery, for every event type)
OBSERVE_OFF = {"AENV_EVENTS_RETENTION_DAYS": "0", "AENV_METRICS_INTERVAL": "0"}
OBSERVE_ON = {"AENV_EVENTS_RETENTION_DAYS": "7", "AENV_METRICS_INTERVAL": "1"}


async def lifecycle_rounds(node: VmNode, rounds: int, hook_url: str | None
                           ) -> dict[str, list[float]]:
    """create, pause (memory), connect (a restore), kill: `rounds` times, one at a time."""
    api = httpx.AsyncClient(base_url=node.url, headers={"X-API-KEY": node.key}, timeout=600,
                            trust_env=False)
    rows: dict[str, list[float]] = {"create": [], "pause": [], "resume": []}
    try:
        if hook_url is not None:
            from agentenv.api.event_models import TYPES

            (await api.post("/events/webhooks", json={
                "name": "slow", "url": hook_url, "events": list(TYPES),
                "signatureSecret": "bench"})).raise_for_status()
        for _ in range(rounds):
            t0 = time.perf_counter()
            answer = await api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
            answer.raise_for_status()
            rows["create"].append((time.perf_counter() - t0) * 1e3)
            sid = answer.json()["sandboxID"]
            try:
                await asyncio.sleep(2)  # a sample or two of the running sandbox
                t0 = time.perf_counter()
                (await api.post(f"/sandboxes/{sid}/pause", json={})).raise_for_status()
                rows["pause"].append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                (await api.post(f"/v2/sandboxes/{sid}/connect",
                                json={"timeout": 600})).raise_for_status()
                rows["resume"].append((time.perf_counter() - t0) * 1e3)
            finally:
                await api.delete(f"/sandboxes/{sid}")
    finally:
        await api.aclose()
    return rows


def observe_measurements(state_dir: Path, quick: bool) -> None:
    """Issue 28: create/pause/resume p50 with events, a slow webhook and metrics sampling on,
    against all of them off, on the same node state in one run (off, on, off again: the
    baseline is both off phases together, so drift over the run shows in neither alone)."""
    rounds = 3 if quick else 15
    receiver = SlowReceiver(5.0)
    phases: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    try:
        for phase in ("off", "on", "off"):
            node = VmNode(state_dir, extra_env=OBSERVE_ON if phase == "on" else OBSERVE_OFF)
            node.start()
            try:
                rows = asyncio.run(lifecycle_rounds(
                    node, rounds, receiver.url if phase == "on" else None))
            finally:
                node.stop()
            for op, values in rows.items():
                phases[phase].setdefault(op, []).extend(values)
    finally:
        receiver.close()
    for op in ("create", "pause", "resume"):
        emit(f"vm_{op}_p50_ms_observed", statistics.median(phases["on"][op]), "ms",
             f"{op} p50 with events, webhooks and metrics sampling off",
             statistics.median(phases["off"][op]))
    print(json.dumps({"metric": "slow_webhook_deliveries", "value": receiver.received,
                      "rounds": rounds}), flush=True)


def vm_main(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        raise SystemExit("the VM backend needs root (network namespaces, nftables, blockd)")
    work = Path(tempfile.mkdtemp(prefix="aenv-api-bench-vm-"))
    work.chmod(0o711)  # QEMU runs as aenv-vm: it must reach the state dir
    # The pause suite alone runs without a ready pool: parked VMs would only take CPU from it.
    pool = (0, 0) if args.suite == "pause" else (args.pool_low, args.pool_high)
    node = VmNode(args.state_dir, *pool)
    if args.suite == "observe":
        try:
            observe_measurements(args.state_dir, args.quick)
        finally:
            remove_network(NODE_PREFIX)
            shutil.rmtree(work, ignore_errors=True)
        return
    try:
        started = node.start()
        print(json.dumps({"info": "vm node ready", "seconds": round(started, 1),
                          "state_dir": str(args.state_dir)}), file=sys.stderr, flush=True)
        if args.suite in ("all", "create"):
            asyncio.run(vm_measurements(node, work, args.quick))
        if args.suite in ("all", "pause"):
            if node.proc is None:  # vm_measurements stopped it
                node.start()
            asyncio.run(pause_measurements(node, args.quick))
    finally:
        node.stop()
        remove_network(NODE_PREFIX)
        remove_network(BARE_PREFIX)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, under a minute")
    parser.add_argument("--backend", choices=["vm", "process"], default="vm",
                        help="vm: QEMU sandboxes from the base template (root); process: envd "
                        "processes (the node's development backend)")
    parser.add_argument("--state-dir", type=Path, default=Path("/var/tmp/aenv-api-bench"),
                        help="vm: the node's state directory, kept between runs (the base "
                        "template is built on the first one)")
    parser.add_argument("--pool-low", type=int, default=2,
                        help="vm: the ready pool's low watermark for the pooled phase")
    parser.add_argument("--pool-high", type=int, default=4,
                        help="vm: the ready pool's high watermark for the pooled phase")
    parser.add_argument("--suite", choices=["all", "create", "pause", "observe"], default="all",
                        help="vm: create = the create/run/kill measurements, pause = memory vs "
                        "filesystem-only pause and connect, all = both; observe = create/pause/"
                        "resume with events, a slow webhook and metrics sampling on vs off")
    args = parser.parse_args()
    if args.backend == "process":
        process_main(args)
    else:
        vm_main(args)


if __name__ == "__main__":
    main()
