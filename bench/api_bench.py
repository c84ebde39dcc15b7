"""Node server benchmark: API and proxy cost, each measured beside a baseline in the same run.

`--backend vm` (the default): create-run-kill latency of QEMU sandboxes
through the E2B API, one at a time and 8 concurrent, and sustained creates/s, each beside the
runtime's bare restore of the same snapshot in the same run. `--backend process`:

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
    state = work / "state"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "node.log", "wb")  # noqa: SIM115 - lives as long as the node
    node = subprocess.Popen(
        [sys.executable, "-m", "agentenv.node", "--state-dir", str(state), "--port", str(port)],
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
BARE_PREFIX, BARE_FIRST_SLOT = "avr", 27001  # the baseline runtime's


class VmNode:
    """`aenv serve --backend vm` on a kept state directory (the base template is built on the
    first run only) and a free loopback port."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
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
        env |= {"AENV_VM_NETWORK_PREFIX": NODE_PREFIX, "AENV_VM_FIRST_SLOT": str(NODE_FIRST_SLOT)}
        if TEST_ASSETS.is_dir() and "AENV_VM_ASSETS_DIR" not in env:
            env |= {"AENV_VM_ASSETS_DIR": str(TEST_ASSETS),
                    "AENV_VM_DEBIAN_CACHE": str(TEST_DEBIAN)}
        began = time.monotonic()
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


async def vm_measurements(node: VmNode, work: Path, quick: bool) -> None:
    from agentenv.blockd.client import AsyncBlockdClient
    from agentenv.node.vm_backend import SLOT_COOLDOWN
    from agentenv.runtime.config import RuntimeConfig
    from agentenv.runtime.vm import Runtime
    from agentenv.snapshot.record import SnapshotRecord

    sequential, rounds_c8, sustained = (3, 1, 8) if quick else (30, 4, 48)
    meta = json.loads((node.state_dir / "templates" / "base" / "template.json").read_text())
    record = SnapshotRecord.load(Path(meta["record_dir"]))
    api = httpx.AsyncClient(base_url=node.url, headers={"X-API-KEY": node.key}, timeout=120,
                            trust_env=False, limits=httpx.Limits(max_connections=64))
    envd = httpx.AsyncClient(timeout=120, trust_env=False)

    async def api_op() -> dict[str, float]:
        t0 = time.perf_counter()
        answer = await api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
        answer.raise_for_status()
        body = answer.json()
        t1 = time.perf_counter()
        headers = {"E2b-Sandbox-Id": body["sandboxID"], "E2b-Sandbox-Port": "49983",
                   "X-Access-Token": body["envdAccessToken"]}
        assert await run_async(envd, node.url, headers, "echo ok") == "ok\n"
        t2 = time.perf_counter()
        (await api.delete(f"/sandboxes/{body['sandboxID']}")).raise_for_status()
        t3 = time.perf_counter()
        return {"create": (t1 - t0) * 1e3, "run": (t2 - t1) * 1e3, "kill": (t3 - t2) * 1e3,
                "total": (t3 - t0) * 1e3}

    # The baseline: the runtime alone, configured like the node's, restoring the same snapshot
    # with disks on the node's own blockd; envd called straight at the VM's address.
    config = RuntimeConfig(state_dir=work / "runtime", accel=record.mode,
                           network_prefix=BARE_PREFIX, slot_first_index=BARE_FIRST_SLOT,
                           blockd_socket=node.blockd_socket, slot_reuse_delay=SLOT_COOLDOWN)
    blockd = AsyncBlockdClient(node.blockd_socket)
    runtime = Runtime(config, blockd=blockd)
    await runtime.start(kernel_for_probe=Path(record.machine.kernel))

    async def bare_op() -> dict[str, float]:
        token = os.urandom(16).hex()
        t0 = time.perf_counter()
        vm = await runtime.restore(record, access_token=token)
        t1 = time.perf_counter()
        try:
            assert await run_async(envd, vm.envd_url, {"X-Access-Token": token},
                                   "echo ok") == "ok\n"
            t2 = time.perf_counter()
        finally:
            await runtime.kill(vm)
        t3 = time.perf_counter()
        return {"create": (t1 - t0) * 1e3, "run": (t2 - t1) * 1e3, "kill": (t3 - t2) * 1e3,
                "total": (t3 - t0) * 1e3}

    try:
        await api_op()  # warm both paths once (memory file, page cache, connections)
        await bare_op()
        seq_api, _ = await measure(api_op, sequential, 1)
        seq_bare, _ = await measure(bare_op, sequential, 1)
        for phase, label in (("create", "create"), ("total", "create_run_kill")):
            a = [r[phase] for r in seq_api]
            b = [r[phase] for r in seq_bare]
            base = "runtime.restore (envd /init done)" if phase == "create" else \
                "runtime restore + envd command + kill"
            emit(f"vm_{label}_p50_ms", statistics.median(a), "ms", base, statistics.median(b))
            emit(f"vm_{label}_p99_ms", percentile(a, 0.99), "ms", base, percentile(b, 0.99))
        overhead = statistics.median(r["create"] for r in seq_api) - statistics.median(
            r["create"] for r in seq_bare)
        emit("vm_api_create_overhead_ms", overhead, "ms", "runtime.restore p50",
             statistics.median(r["create"] for r in seq_bare))

        c8_api, _ = await measure(api_op, 8 * rounds_c8, 8)
        c8_bare, _ = await measure(bare_op, 8 * rounds_c8, 8)
        base = "runtime restore + envd command + kill, 8 concurrent"
        emit("vm_create_run_kill_c8_p50_ms", statistics.median(r["total"] for r in c8_api), "ms",
             base, statistics.median(r["total"] for r in c8_bare))
        emit("vm_create_run_kill_c8_p99_ms", percentile([r["total"] for r in c8_api], 0.99),
             "ms", base, percentile([r["total"] for r in c8_bare], 0.99))
        emit("vm_create_c8_p50_ms", statistics.median(r["create"] for r in c8_api), "ms",
             "runtime.restore, 8 concurrent", statistics.median(r["create"] for r in c8_bare))

        _, api_wall = await measure(api_op, sustained, 8)
        _, bare_wall = await measure(bare_op, sustained, 8)
        emit("vm_sustained_creates_per_s", sustained / api_wall, "creates/s",
             "runtime restores/s (same loop: restore, command, kill; 8 in flight)",
             sustained / bare_wall)
    finally:
        await runtime.close()
        await blockd.close()
        await api.aclose()
        await envd.aclose()


def vm_main(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        raise SystemExit("the VM backend needs root (network namespaces, nftables, blockd)")
    work = Path(tempfile.mkdtemp(prefix="aenv-api-bench-vm-"))
    node = VmNode(args.state_dir)
    try:
        started = node.start()
        print(json.dumps({"info": "vm node ready", "seconds": round(started, 1),
                          "state_dir": str(args.state_dir)}), file=sys.stderr, flush=True)
        asyncio.run(vm_measurements(node, work, args.quick))
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
    args = parser.parse_args()
    if args.backend == "process":
        process_main(args)
    else:
        vm_main(args)


if __name__ == "__main__":
    main()
