"""Density benchmark: many idle running VM sandboxes and many more paused ones on one node.

Through the E2B API of a `--backend vm` node (base template): N idle running sandboxes, then M
sandboxes created and paused (create -> pause, a few in flight), all held at once. Reports the
host memory the node and its VMs use (MemTotal - MemAvailable, against the same figure before the
node started, and against what N guests of the template's size would take if their memory were
allocated), the disk used by the pause snapshots (against a full memory dump per sandbox), the
time taken, and the failures (there should be none). Then it checks a few of each (a command in
running ones, a resume of paused ones) and kills them all.

Prints one JSON object per line. Default 32 running + 500 paused (several minutes under TCG);
`--quick`: 4 + 16.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import NODE_PREFIX, VmNode, emit, remove_network, run_async


def host_used_mib() -> float:
    info: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def du_bytes(paths: list[Path]) -> int:
    if not paths:
        return 0
    total = 0
    for chunk in range(0, len(paths), 200):
        out = subprocess.run(["du", "-s", "--block-size=1", *map(str, paths[chunk:chunk + 200])],
                             capture_output=True, text=True).stdout
        total += sum(int(line.split()[0]) for line in out.splitlines() if line.strip())
    return total


async def run_density(node: VmNode, running_n: int, paused_n: int, in_flight: int) -> None:
    api = httpx.AsyncClient(base_url=node.url, headers={"X-API-KEY": node.key}, timeout=300,
                            trust_env=False, limits=httpx.Limits(max_connections=64))
    failures: list[str] = []
    running: list[dict[str, Any]] = []
    paused: list[dict[str, Any]] = []
    meta = json.loads((node.state_dir / "templates" / "base" / "template.json").read_text())
    template_dir = Path(meta["record_dir"])
    base_template = (await api.get("/templates/base")).json()
    guest_mib = int(base_template["memoryMB"])

    async def create() -> dict[str, Any]:
        answer = await api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 3600})
        if answer.status_code != 201:
            raise RuntimeError(f"create answered {answer.status_code}: {answer.text[:300]}")
        return dict(answer.json())

    async def pool(count: int, job: Any) -> float:
        todo = iter(range(count))

        async def worker() -> None:
            for _ in todo:
                try:
                    await job()
                except Exception as exc:  # counted and reported, the run goes on
                    failures.append(f"{type(exc).__name__}: {exc}")

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(in_flight)))
        return time.perf_counter() - began

    async def make_running() -> None:
        running.append(await create())

    async def make_paused() -> None:
        sbx = await create()
        answer = await api.post(f"/sandboxes/{sbx['sandboxID']}/pause")
        if answer.status_code != 204:
            await api.delete(f"/sandboxes/{sbx['sandboxID']}")
            raise RuntimeError(f"pause answered {answer.status_code}: {answer.text[:200]}")
        paused.append(sbx)

    try:
        running_s = await pool(running_n, make_running)
        print(json.dumps({"info": f"{len(running)} running in {running_s:.1f} s"}),
              file=sys.stderr, flush=True)
        paused_s = await pool(paused_n, make_paused)
        print(json.dumps({"info": f"{len(paused)} paused in {paused_s:.1f} s"}),
              file=sys.stderr, flush=True)
        await asyncio.sleep(5)  # let the paused VMs' QEMU processes finish exiting
        states: list[str] = []
        token = None
        while True:  # every page (the node pages by 100)
            page = await api.get("/v2/sandboxes", params={"nextToken": token} if token else {})
            page.raise_for_status()
            states += [item["state"] for item in page.json()]
            token = page.headers.get("x-next-token")
            if not token:
                break
        used = host_used_mib()

        snapshots = node.state_dir / "vm-backend" / "runtime" / "snapshots"
        snap_dirs = [p for p in snapshots.iterdir() if p.is_dir() and p != template_dir]
        paused_disk = du_bytes(snap_dirs)

        # A few of each still work: a command in running ones, a resume of paused ones.
        envd = httpx.AsyncClient(timeout=120, trust_env=False)
        checks = 0
        for sbx in random.sample(running, min(3, len(running))) + random.sample(
                paused, min(3, len(paused))):
            if sbx in paused:
                try:
                    answer = await api.post(f"/v2/sandboxes/{sbx['sandboxID']}/connect",
                                            json={"timeout": 300})
                except httpx.HTTPError as exc:
                    failures.append(f"resume of {sbx['sandboxID']}: {exc!r}")
                    continue
                if answer.status_code != 201:
                    failures.append(f"resume of {sbx['sandboxID']}: {answer.status_code}")
                    continue
            headers = {"E2b-Sandbox-Id": sbx["sandboxID"], "E2b-Sandbox-Port": "49983",
                       "X-Access-Token": sbx["envdAccessToken"]}
            try:
                if await run_async(envd, node.url, headers, "echo ok") == "ok\n":
                    checks += 1
                else:
                    failures.append(f"command in {sbx['sandboxID']} printed something else")
            except httpx.HTTPError as exc:
                failures.append(f"command in {sbx['sandboxID']}: {exc}")
        await envd.aclose()

        emit("density_running_sandboxes", states.count("running"), "sandboxes",
             "asked for", running_n)
        emit("density_paused_sandboxes", states.count("paused"), "sandboxes",
             "asked for", paused_n)
        emit("density_failures", len(failures), "failures", "operations",
             running_n + paused_n + 6)
        emit("density_host_mem_used_mib", used - BEFORE_MIB, "MiB",
             f"{running_n} running x {guest_mib} MiB guest memory", running_n * guest_mib)
        emit("density_mem_per_running_mib", (used - BEFORE_MIB) / max(1, running_n), "MiB",
             "guest memory size", guest_mib)
        emit("density_paused_disk_mib", paused_disk / 2**20, "MiB",
             f"{paused_n} full memory dumps", paused_n * guest_mib)
        emit("density_paused_disk_per_sandbox_mib", paused_disk / 2**20 / max(1, len(paused)),
             "MiB", "guest memory size", guest_mib)
        emit("density_paused_creates_per_s", len(paused) / paused_s, "sandboxes/s",
             "running creates/s (create only)", len(running) / running_s)
        emit("density_total_seconds", running_s + paused_s, "s", "running phase", running_s)
        if failures:
            print(json.dumps({"info": "failures", "first": failures[:5]}), file=sys.stderr)
    finally:
        kill_began = time.perf_counter()
        everyone = [s["sandboxID"] for s in running + paused]
        sem = asyncio.Semaphore(8)

        async def kill(sid: str) -> None:
            async with sem:
                with contextlib.suppress(httpx.HTTPError):
                    await api.delete(f"/sandboxes/{sid}")

        await asyncio.gather(*(kill(sid) for sid in everyone))
        print(json.dumps({"info": f"killed {len(everyone)} in "
                          f"{time.perf_counter() - kill_began:.1f} s"}), file=sys.stderr)
        await api.aclose()


BEFORE_MIB = 0.0


def main() -> None:
    global BEFORE_MIB
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 running + 16 paused")
    parser.add_argument("--running", type=int, default=32)
    parser.add_argument("--paused", type=int, default=500)
    parser.add_argument("--in-flight", type=int, default=4,
                        help="creates (and pauses) under way at once")
    parser.add_argument("--state-dir", type=Path, default=Path("/var/tmp/aenv-api-bench"),
                        help="the node's state directory, kept between runs (and shared with "
                        "api_bench.py: the base template is built once)")
    args = parser.parse_args()
    if args.quick:
        args.running, args.paused = 4, 16
    if os.geteuid() != 0:
        raise SystemExit("the VM backend needs root (network namespaces, nftables, blockd)")
    BEFORE_MIB = host_used_mib()
    work = Path(tempfile.mkdtemp(prefix="aenv-density-"))
    work.chmod(0o711)  # QEMU runs as aenv-vm: it must reach the state dir
    node = VmNode(args.state_dir)
    try:
        started = node.start()
        print(json.dumps({"info": "vm node ready", "seconds": round(started, 1)}),
              file=sys.stderr, flush=True)
        asyncio.run(run_density(node, args.running, args.paused, args.in_flight))
    finally:
        node.stop()
        remove_network(NODE_PREFIX)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
