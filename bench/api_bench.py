"""Node server benchmark: API and proxy cost, each measured beside a baseline in the same run.

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


def run_command(client: httpx.Client, cmd: str) -> str:
    answer = client.post(
        "/process.Process/Start",
        content=start_request(cmd),
        headers={"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"},
    )
    data, pos, out = answer.content, 0, b""
    while pos < len(data):
        size = int.from_bytes(data[pos + 1 : pos + 5], "big")
        message = json.loads(data[pos + 5 : pos + 5 + size])
        pos += 5 + size
        stdout = message.get("event", {}).get("data", {}).get("stdout")
        if stdout:
            out += base64.b64decode(stdout)
    return out.decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, under a minute")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
