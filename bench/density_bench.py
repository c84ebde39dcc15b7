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

`--rollout`: an agent-like rollout instead, idle pause on against off in one run. Two groups of
`--trajectories` sandboxes run side by side on one node, each trajectory taking `--steps`
steps (a command, a file write, a burst of 20 small file writes, as a pip install does) with
a wait of `--wait-min`..`--wait-max` seconds before each (the policy thinking); one group's
sandboxes have `idlePauseAfter` = `--idle-after` (node/idle.py), the other's none. Reports
each group's host memory per live trajectory (the proportional set size of its QEMU
processes, sampled every second over the rollout; a paused trajectory has none) and its step
latencies (p50, p99), the idle group's against the other.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import NODE_PREFIX, VmNode, emit, percentile, remove_network, run_async


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


def qemu_memory_kib(manifests: Path, sandbox_id: str) -> tuple[int, int]:
    """(PSS, RSS) in KiB of the sandbox's QEMU process, (0, 0) when it has none (paused)."""
    try:
        pid = int(json.loads((manifests / f"{sandbox_id}.vm.json").read_text())["pid"])
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (OSError, ValueError, KeyError):
        return 0, 0
    fields = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:]
              if line.split()[-1] == "kB"}
    return fields.get("Pss", 0), fields.get("Rss", 0)


async def run_rollout(node: VmNode, args: argparse.Namespace) -> None:
    """Trajectories idle-paused by the node against ones that stay running, side by side."""
    api = httpx.AsyncClient(base_url=node.url, headers={"X-API-KEY": node.key}, timeout=300,
                            trust_env=False)
    envd = httpx.AsyncClient(timeout=300, trust_env=False)
    manifests = node.state_dir / "vm-backend" / "sandboxes"
    rng = random.Random(args.seed)
    groups = {"idle_pause": args.idle_after, "no_idle_pause": 0}
    made: dict[str, list[dict[str, Any]]] = {g: [] for g in groups}
    latencies: dict[str, list[float]] = {g: [] for g in groups}
    failures: list[str] = []
    ready = asyncio.Event()
    waiting = len(groups) * args.trajectories

    async def step(sbx: dict[str, Any], n: int) -> None:
        headers = {"E2b-Sandbox-Id": sbx["sandboxID"], "E2b-Sandbox-Port": "49983",
                   "X-Access-Token": sbx["envdAccessToken"]}
        if await run_async(envd, node.url, headers, f"echo step {n}") != f"step {n}\n":
            raise RuntimeError("the step's command printed something else")
        wrote = await envd.post(node.url + "/files", params={"path": f"/tmp/step{n}.txt"},
                                content=b"x" * 4096, headers={
                                    **headers, "Content-Type": "application/octet-stream"})
        wrote.raise_for_status()
        burst = f"mkdir -p /tmp/pkg{n} && for i in $(seq 20); do echo $i > /tmp/pkg{n}/f$i; done"
        await run_async(envd, node.url, headers, burst + " && echo ok")

    async def trajectory(group: str, waits: list[float]) -> None:
        nonlocal waiting
        try:
            answer = await api.post("/v2/sandboxes", json={
                "templateID": "base", "timeout": 3600, "idlePauseAfter": groups[group]})
            if answer.status_code != 201:
                raise RuntimeError(f"create answered {answer.status_code}: {answer.text[:200]}")
            sbx = answer.json()
            made[group].append(sbx)
            await step(sbx, 0)  # set up, before the measured part
        except Exception as exc:
            failures.append(f"{group} setup: {exc!r}")
            return
        finally:
            waiting -= 1
            if not waiting:
                ready.set()
        await ready.wait()  # every trajectory starts its waits at once
        for n, wait in enumerate(waits, 1):
            await asyncio.sleep(wait)  # the policy thinks
            began = time.perf_counter()
            try:
                await step(sbx, n)
            except Exception as exc:
                failures.append(f"{group} step {n}: {exc!r}")
                continue
            latencies[group].append((time.perf_counter() - began) * 1000)

    samples: dict[str, list[tuple[int, int]]] = {g: [] for g in groups}

    async def sample(done: asyncio.Event) -> None:
        await ready.wait()
        while not done.is_set():
            for group, sandboxes in made.items():
                pss = rss = 0
                for sbx in sandboxes:
                    one = await asyncio.to_thread(qemu_memory_kib, manifests, sbx["sandboxID"])
                    pss, rss = pss + one[0], rss + one[1]
                samples[group].append((pss, rss))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 1.0)

    async def node_counts() -> dict[str, float]:
        """The node's idle pause counters and its pause and resume durations."""
        text = (await api.get("/metrics")).text
        found = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                 for line in text.splitlines() if line and not line.startswith("#")}
        ops = "aenv_node_sandbox_operation_seconds_{}{{op=\"{}\",outcome=\"ok\"}}"
        return {"pauses": found.get("aenv_node_idle_pauses_total", 0.0),
                "resumes": found.get("aenv_node_idle_resumes_total", 0.0),
                **{f"{op}_{part}": found.get(ops.format(part, op), 0.0)
                   for op in ("pause", "resume") for part in ("sum", "count")}}

    # The same waits for both groups: trajectory i of each waits alike.
    plans = [[rng.uniform(args.wait_min, args.wait_max) for _ in range(args.steps)]
             for _ in range(args.trajectories)]
    before = await node_counts()
    done = asyncio.Event()
    sampler = asyncio.create_task(sample(done))
    began = time.perf_counter()
    try:
        await asyncio.gather(*(trajectory(g, plan) for plan in plans for g in groups))
        done.set()
        await sampler
        seconds = time.perf_counter() - began
        after = await node_counts()
        delta = {key: after[key] - before[key] for key in after}
        pauses, resumes = delta["pauses"], delta["resumes"]
        mib: dict[str, tuple[float, float]] = {}
        for group in groups:
            live = max(1, len(made[group]))
            pss = statistics.mean(s[0] for s in samples[group]) / 1024 / live
            rss = statistics.mean(s[1] for s in samples[group]) / 1024 / live
            mib[group] = (pss, rss)
        on, off = "idle_pause", "no_idle_pause"
        emit("rollout_mem_per_trajectory_pss_mib", mib[on][0], "MiB",
             "without idle pause", mib[off][0])
        emit("rollout_mem_per_trajectory_rss_mib", mib[on][1], "MiB",
             "without idle pause", mib[off][1])
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            emit(f"rollout_step_latency_{name}_ms", percentile(latencies[on], q), "ms",
                 "without idle pause", percentile(latencies[off], q))
        emit("rollout_step_latency_mean_ms", statistics.mean(latencies[on]), "ms",
             "without idle pause", statistics.mean(latencies[off]))
        emit("rollout_idle_pauses", pauses, "pauses", "steps after a wait",
             len(latencies[on]))
        emit("rollout_idle_resumes", resumes, "resumes", "idle pauses", pauses)
        # what a step after an idle pause waits for: the resume (the node's own figure)
        for op in ("resume", "pause"):
            count = delta[f"{op}_count"]
            emit(f"rollout_node_{op}_mean_ms", delta[f"{op}_sum"] / count * 1000 if count
                 else 0.0, "ms", "step latency p50 without idle pause",
                 percentile(latencies[off], 0.5))
        emit("rollout_failures", len(failures), "failures", "steps",
             2 * args.trajectories * (args.steps + 1))
        emit("rollout_seconds", seconds, "s", "mean wait x steps",
             args.steps * (args.wait_min + args.wait_max) / 2)
        if failures:
            print(json.dumps({"info": "failures", "first": failures[:5]}), file=sys.stderr)
    finally:
        done.set()
        sampler.cancel()
        for sbx in made["idle_pause"] + made["no_idle_pause"]:
            with contextlib.suppress(httpx.HTTPError):
                await api.delete(f"/sandboxes/{sbx['sandboxID']}")
        await api.aclose()
        await envd.aclose()


BEFORE_MIB = 0.0


def main() -> None:
    global BEFORE_MIB
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 running + 16 paused")
    parser.add_argument("--running", type=int, default=32)
    parser.add_argument("--paused", type=int, default=500)
    parser.add_argument("--in-flight", type=int, default=4,
                        help="creates (and pauses) under way at once")
    parser.add_argument("--rollout", action="store_true",
                        help="an agent-like rollout, idle pause on against off (see above)")
    parser.add_argument("--trajectories", type=int, default=4, help="per group (--rollout)")
    parser.add_argument("--steps", type=int, default=5, help="steps after a wait (--rollout)")
    parser.add_argument("--wait-min", type=float, default=5.0)
    parser.add_argument("--wait-max", type=float, default=15.0)
    parser.add_argument("--idle-after", type=int, default=2,
                        help="idlePauseAfter of the idle pause group (--rollout)")
    parser.add_argument("--seed", type=int, default=31)
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
        if args.rollout:
            asyncio.run(run_rollout(node, args))
        else:
            asyncio.run(run_density(node, args.running, args.paused, args.in_flight))
    finally:
        node.stop()
        remove_network(NODE_PREFIX)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
