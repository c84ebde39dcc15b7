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

`--agents`: the issue 31 benchmark, an agent-like load on one node, everything on against
everything off in one run. Two groups side by side, each of `--trajectories` (N) running
sandboxes taking `--steps` steps as in `--rollout` plus `--held-paused` (M) sandboxes that
were created, given one step and paused through the API (as a client pauses a trajectory it
will come back to), held paused over the whole measured part:
- `on`: `idlePauseAfter` = `--idle-after`, and cold-memory reclaim in the guest (DAMON,
  `ColdMemory(minAgeSeconds=--reclaim-after)`, docs/templates.md §7) set through envd's
  `POST /aenv/reclaim` right after the create;
- `off`: no idle pause, reclaim off (`ColdMemory.off()`, the same way).
The base template (its configured `memoryMB` and `cpuCount`, printed) for every sandbox.
After the measured part, two held paused sandboxes of each group are resumed (`connect`) and
take a step.

Figures of `--agents`, each group's, `on` against `off` (the baseline):
- host memory per running sandbox: the mean over the measured part (from the moment every
  trajectory is set up until the last step), sampled every second, of the PSS of the
  group's trajectories' QEMU processes (an idle-paused trajectory has none: 0), over N;
- host memory per paused sandbox: the same for the held paused ones (0 while they stay
  paused), and, separately, the bytes their pause snapshots hold on the host's disk
  (allocated, per sandbox): memory layers, disk layers, the rest (device state, records);
- memory requested/used = (N + M) x memoryMB / the mean of the summed QEMU PSS of all the
  group's sandboxes (running and paused); `_running`: N x memoryMB / the trajectories' PSS
  alone; `_with_node`: the denominator plus half of the node's own processes' PSS (the node,
  blockd and everything below the node except the QEMUs); `_running_with_node`: N x
  memoryMB / (the trajectories' PSS + that half);
- CPU requested/used = (N + M) x cpuCount x the measured part's wall seconds / the CPU
  seconds (user + system) the group's QEMU processes used in it (read from /proc every
  0.2 s per process, by pid and start time; a QEMU's last < 0.2 s before it exits is not
  seen, so this slightly undercounts); `_running`: N x cpuCount x seconds / the same;
- step latency p50, p99, mean; failures per group (creates, steps, pauses, the resume
  checks; the goal is zero);
- beside them: the node's processes' PSS and CPU seconds (everything below the node,
  reaped children included), and the host's MemTotal - MemAvailable against before the
  node started (both groups together).
Defaults for `--agents`: 4 running + 8 held paused per group, 5 steps after waits of 5-15 s,
`idlePauseAfter` 2 s, reclaim after 30 s (the node's default, AENV_RECLAIM_MIN_AGE_SECONDS):
about 5 minutes on a 2-core host.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agentenv.envd_client import ColdMemory
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


@dataclass(frozen=True)
class Group:
    """One side of a rollout: what its sandboxes are created with."""

    name: str
    idle_after: int  # idlePauseAfter (0: off)
    cold: ColdMemory | None = None  # set in each guest after its create (None: the template's)
    held_paused: int = 0  # sandboxes created, given a step, paused and held beside the rest


def qemu_pid(manifests: Path, sandbox_id: str) -> int | None:
    """The pid of the sandbox's QEMU process, None when it has none (paused)."""
    try:
        return int(json.loads((manifests / f"{sandbox_id}.vm.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def proc_memory_kib(pid: int) -> tuple[int, int]:
    """(PSS, RSS) in KiB of a process, (0, 0) when it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    fields = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:]
              if line.split()[-1] == "kB"}
    return fields.get("Pss", 0), fields.get("Rss", 0)


def qemu_memory_kib(manifests: Path, sandbox_id: str) -> tuple[int, int]:
    """(PSS, RSS) in KiB of the sandbox's QEMU process, (0, 0) when it has none (paused)."""
    pid = qemu_pid(manifests, sandbox_id)
    return proc_memory_kib(pid) if pid else (0, 0)


TICK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> tuple[int, int, float, float] | None:
    """(parent pid, start time in ticks, own CPU s, CPU s of its reaped children) of a
    process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, from field 3 on
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return int(fields[1]), int(fields[19]), (utime + stime) / TICK, (cutime + cstime) / TICK


def process_tree(root: int) -> list[int]:
    """root and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))):
            children.setdefault(stat[0], []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def allocated_bytes(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


def pause_snapshot_bytes(owners: Path, sandbox_id: str) -> tuple[int, int, int]:
    """Bytes on the host's disk (allocated) of a paused sandbox's own snapshots: (memory
    layers, disk layers, the rest: device state, records). vm_backend/snapshots.py's
    SnapshotStore lists a sandbox's snapshot directories in <owners>/<id>.json."""
    memory = disk = rest = 0
    try:
        directories = [Path(d) for d in json.loads((owners / f"{sandbox_id}.json").read_text())]
    except (OSError, ValueError):
        return 0, 0, 0
    for directory in directories:
        try:
            record = json.loads((directory / "snapshot.json").read_text())
        except (OSError, ValueError):
            continue
        memory_files = {Path(layer["path"]) for layer in record.get("memory_layers", [])}
        disk_files = {Path(layer["path"]) for d in record.get("disks", [])
                      for layer in d.get("layers", [])}
        for file in directory.rglob("*"):
            if not file.is_file():
                continue
            size = allocated_bytes(file)
            if file in memory_files:
                memory += size
            elif file in disk_files:
                disk += size
            else:
                rest += size
    return memory, disk, rest


async def run_rollout(node: VmNode, args: argparse.Namespace, groups: list[Group],
                      prefix: str) -> None:
    """Trajectories of two groups side by side (the first against the second, its baseline),
    each group with its held paused sandboxes; see the module doc (--rollout, --agents)."""
    api = httpx.AsyncClient(base_url=node.url, headers={"X-API-KEY": node.key}, timeout=300,
                            trust_env=False)
    envd = httpx.AsyncClient(timeout=300, trust_env=False)
    manifests = node.state_dir / "vm-backend" / "sandboxes"
    rng = random.Random(args.seed)
    names = [g.name for g in groups]
    made: dict[str, list[dict[str, Any]]] = {g: [] for g in names}  # the trajectories
    held: dict[str, list[dict[str, Any]]] = {g: [] for g in names}  # held paused
    latencies: dict[str, list[float]] = {g: [] for g in names}
    failures: dict[str, list[str]] = {g: [] for g in names}
    ready = asyncio.Event()
    waiting = len(groups) * args.trajectories
    template = (await api.get("/templates/base")).json()
    memory_mib, vcpus = int(template["memoryMB"]), int(template["cpuCount"])

    def envd_headers(sbx: dict[str, Any]) -> dict[str, str]:
        return {"E2b-Sandbox-Id": sbx["sandboxID"], "E2b-Sandbox-Port": "49983",
                "X-Access-Token": sbx["envdAccessToken"]}

    async def step(sbx: dict[str, Any], n: int) -> None:
        headers = envd_headers(sbx)
        if await run_async(envd, node.url, headers, f"echo step {n}") != f"step {n}\n":
            raise RuntimeError("the step's command printed something else")
        wrote = await envd.post(node.url + "/files", params={"path": f"/tmp/step{n}.txt"},
                                content=b"x" * 4096, headers={
                                    **headers, "Content-Type": "application/octet-stream"})
        wrote.raise_for_status()
        burst = f"mkdir -p /tmp/pkg{n} && for i in $(seq 20); do echo $i > /tmp/pkg{n}/f$i; done"
        if await run_async(envd, node.url, headers, burst + " && echo ok") != "ok\n":
            raise RuntimeError("the step's burst of writes printed something else")

    async def create(group: Group) -> dict[str, Any]:
        """A sandbox of the group, set up: its cold-memory setting, a first step."""
        answer = await api.post("/v2/sandboxes", json={
            "templateID": "base", "timeout": 3600, "idlePauseAfter": group.idle_after})
        if answer.status_code != 201:
            raise RuntimeError(f"create answered {answer.status_code}: {answer.text[:200]}")
        sbx = dict(answer.json())
        try:
            if group.cold is not None:  # envd's POST /aenv/reclaim, through the node's proxy
                set_cold = await envd.post(node.url + "/aenv/reclaim", json=group.cold.wire(),
                                           headers=envd_headers(sbx))
                if set_cold.status_code != 200:
                    raise RuntimeError(f"/aenv/reclaim answered {set_cold.status_code}: "
                                       f"{set_cold.text[:200]}")
            await step(sbx, 0)
        except BaseException:
            await api.delete(f"/sandboxes/{sbx['sandboxID']}")
            raise
        return sbx

    async def hold_paused(group: Group, sem: asyncio.Semaphore) -> None:
        async with sem:
            try:
                sbx = await create(group)
                answer = await api.post(f"/sandboxes/{sbx['sandboxID']}/pause")
                if answer.status_code != 204:
                    await api.delete(f"/sandboxes/{sbx['sandboxID']}")
                    raise RuntimeError(f"pause answered {answer.status_code}: {answer.text[:200]}")
                held[group.name].append(sbx)
            except Exception as exc:
                failures[group.name].append(f"{group.name} held paused: {exc!r}")

    async def trajectory(group: Group, waits: list[float]) -> None:
        nonlocal waiting
        try:
            sbx = await create(group)  # set up, before the measured part
            made[group.name].append(sbx)
        except Exception as exc:
            failures[group.name].append(f"{group.name} setup: {exc!r}")
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
                failures[group.name].append(f"{group.name} step {n}: {exc!r}")
                continue
            latencies[group.name].append((time.perf_counter() - began) * 1000)

    # Memory, each second over the measured part, per group: (PSS, RSS) of the trajectories'
    # QEMUs, PSS of the held paused ones' QEMUs (none while they stay paused), and the node's
    # own processes (the node, blockd, its helpers: everything below it but the QEMUs).
    samples: dict[str, list[tuple[int, int, int]]] = {g: [] for g in names}
    node_pss: list[int] = []
    host_used: list[float] = []
    # CPU, every 0.2 s: seconds each QEMU used, by (pid, start time): (group, first seen, last)
    qemu_cpu: dict[tuple[int, int], list[Any]] = {}
    node_pid = node.proc.pid if node.proc else 0
    first_cpu_sample = True

    def memory_sample() -> None:
        qemus = 0
        for group in names:
            pss = rss = held_pss = 0
            for sbx in made[group]:
                one = qemu_memory_kib(manifests, sbx["sandboxID"])
                pss, rss = pss + one[0], rss + one[1]
            for sbx in held[group]:
                held_pss += qemu_memory_kib(manifests, sbx["sandboxID"])[0]
            samples[group].append((pss, rss, held_pss))
            qemus += pss + held_pss
        if node_pid:
            node_pss.append(sum(proc_memory_kib(p)[0] for p in process_tree(node_pid)) - qemus)
        host_used.append(host_used_mib() - BEFORE_MIB)

    def cpu_sample() -> None:
        nonlocal first_cpu_sample
        for group in names:
            for sbx in made[group] + held[group]:
                pid = qemu_pid(manifests, sbx["sandboxID"])
                if pid and (stat := proc_stat(pid)):
                    key = (pid, stat[1])
                    if key not in qemu_cpu:  # born in the measured part: all of its CPU counts
                        qemu_cpu[key] = [group, stat[2] if first_cpu_sample else 0.0, stat[2]]
                    qemu_cpu[key][2] = stat[2]
        first_cpu_sample = False

    def node_cpu_s() -> float:
        """CPU seconds of the node and everything below it, reaped children included."""
        total = 0.0
        for pid in process_tree(node_pid) if node_pid else []:
            if stat := proc_stat(pid):
                total += stat[2] + stat[3]
        return total

    async def sample(done: asyncio.Event) -> None:
        await ready.wait()
        last_memory = 0.0
        while not done.is_set():
            await asyncio.to_thread(cpu_sample)
            if time.monotonic() - last_memory >= 1.0:
                last_memory = time.monotonic()
                await asyncio.to_thread(memory_sample)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.2)

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
    done = asyncio.Event()
    try:
        sem = asyncio.Semaphore(args.in_flight)
        began = time.perf_counter()
        await asyncio.gather(*(hold_paused(g, sem) for n in range(args.held_paused)
                               for g in groups))
        if args.held_paused:
            print(json.dumps({"info": f"{sum(map(len, held.values()))} held paused in "
                              f"{time.perf_counter() - began:.1f} s"}),
                  file=sys.stderr, flush=True)
        before = await node_counts()
        sampler = asyncio.create_task(sample(done))
        runs = asyncio.gather(*(trajectory(g, plan) for plan in plans for g in groups))
        await ready.wait()
        began, node_cpu_before = time.perf_counter(), await asyncio.to_thread(node_cpu_s)
        await runs
        seconds = time.perf_counter() - began
        node_cpu = await asyncio.to_thread(node_cpu_s) - node_cpu_before
        done.set()
        await sampler
        after = await node_counts()
        delta = {key: after[key] - before[key] for key in after}
        pauses, resumes = delta["pauses"], delta["resumes"]

        # What the held paused sandboxes keep on the host's disk, before any resumes.
        held_snapshots = {g: [await asyncio.to_thread(pause_snapshot_bytes, manifests,
                                                      s["sandboxID"]) for s in held[g]]
                          for g in names}
        # A few held paused sandboxes of each group still resume and run a command.
        checked = 0
        for group in names:
            for sbx in held[group][:2]:
                try:  # a client's pause: traffic does not resume it, a connect does
                    answer = await api.post(f"/v2/sandboxes/{sbx['sandboxID']}/connect",
                                            json={"timeout": 300})
                    if answer.status_code != 201:
                        raise RuntimeError(f"connect answered {answer.status_code}: "
                                           f"{answer.text[:200]}")
                    await step(sbx, 99)
                    checked += 1
                except Exception as exc:
                    failures[group].append(f"{group} resume of a held paused one: {exc!r}")

        on, off = names
        mib: dict[str, dict[str, float]] = {}
        for group in groups:
            g, series = group.name, samples[group.name]
            live, paused_n = max(1, len(made[g])), len(held[g])
            used = {"pss": statistics.mean(s[0] for s in series) / 1024,
                    "rss": statistics.mean(s[1] for s in series) / 1024,
                    "held": statistics.mean(s[2] for s in series) / 1024}
            requested = memory_mib * (len(made[g]) + paused_n)
            node_share = (statistics.mean(node_pss) / 1024 / len(groups)) if node_pss else 0.0
            snaps = held_snapshots[g]
            cpu_s = sum(c[2] - c[1] for c in qemu_cpu.values() if c[0] == g)
            mib[g] = {
                "running_pss": used["pss"] / live, "running_rss": used["rss"] / live,
                "held_pss": used["held"] / max(1, paused_n),
                "held_memory_layers": sum(s[0] for s in snaps) / 2**20 / max(1, paused_n),
                "held_disk_layers": sum(s[1] for s in snaps) / 2**20 / max(1, paused_n),
                "held_rest": sum(s[2] for s in snaps) / 2**20 / max(1, paused_n),
                "mem_ratio": requested / max(1e-9, used["pss"] + used["held"]),
                "mem_ratio_running": memory_mib * len(made[g]) / max(1e-9, used["pss"]),
                "mem_ratio_with_node": requested / max(
                    1e-9, used["pss"] + used["held"] + node_share),
                "mem_ratio_running_with_node": memory_mib * len(made[g]) / max(
                    1e-9, used["pss"] + node_share),
                "cpu_ratio": vcpus * (len(made[g]) + paused_n) * seconds / max(1e-9, cpu_s),
                "cpu_ratio_running": vcpus * len(made[g]) * seconds / max(1e-9, cpu_s),
                "cpu_s": cpu_s,
            }
        if args.held_paused:  # --agents: what the benchmark asks for
            print(json.dumps({"info": "configured", "memoryMB": memory_mib, "cpuCount": vcpus,
                              "trajectories": len(made[on]), "held_paused": len(held[on]),
                              "groups": {g.name: {"idlePauseAfter": g.idle_after,
                                                  "coldMemory": g.cold.wire() if g.cold
                                                  else None} for g in groups}}),
                  file=sys.stderr, flush=True)
            base = f"with idle pause and reclaim off ({off})"
            for key, metric, unit in (
                    ("running_pss", "mem_per_running_pss_mib", "MiB"),
                    ("running_rss", "mem_per_running_rss_mib", "MiB"),
                    ("held_pss", "mem_per_paused_pss_mib", "MiB"),
                    ("held_memory_layers", "paused_memory_layers_per_sandbox_mib", "MiB"),
                    ("held_disk_layers", "paused_disk_layers_per_sandbox_mib", "MiB"),
                    ("held_rest", "paused_other_files_per_sandbox_mib", "MiB"),
                    ("mem_ratio", "mem_requested_per_used", "x"),
                    ("mem_ratio_running", "mem_requested_per_used_running", "x"),
                    ("mem_ratio_with_node", "mem_requested_per_used_with_node", "x"),
                    ("mem_ratio_running_with_node", "mem_requested_per_used_running_with_node",
                     "x"),
                    ("cpu_ratio", "cpu_requested_per_used", "x"),
                    ("cpu_ratio_running", "cpu_requested_per_used_running", "x"),
                    ("cpu_s", "qemu_cpu_seconds", "s")):
                emit(f"{prefix}_{metric}", mib[on][key], unit, base, mib[off][key])
            if node_pss:
                emit(f"{prefix}_node_processes_pss_mib", statistics.mean(node_pss) / 1024,
                     "MiB", "all QEMUs' PSS", sum(mib[g]["running_pss"] * len(made[g])
                                                  + mib[g]["held_pss"] * len(held[g])
                                                  for g in names))
            emit(f"{prefix}_node_cpu_seconds", node_cpu, "s", "all QEMUs' CPU seconds",
                 mib[on]["cpu_s"] + mib[off]["cpu_s"])
            emit(f"{prefix}_host_mem_used_mib", statistics.mean(host_used), "MiB",
                 "requested by both groups", memory_mib * sum(
                     len(made[g]) + len(held[g]) for g in names))
        else:
            emit(f"{prefix}_mem_per_trajectory_pss_mib", mib[on]["running_pss"], "MiB",
                 "without idle pause", mib[off]["running_pss"])
            emit(f"{prefix}_mem_per_trajectory_rss_mib", mib[on]["running_rss"], "MiB",
                 "without idle pause", mib[off]["running_rss"])
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            emit(f"{prefix}_step_latency_{name}_ms", percentile(latencies[on], q), "ms",
                 f"group {off}", percentile(latencies[off], q))
        emit(f"{prefix}_step_latency_mean_ms", statistics.mean(latencies[on]), "ms",
             f"group {off}", statistics.mean(latencies[off]))
        emit(f"{prefix}_idle_pauses", pauses, "pauses", "steps after a wait",
             len(latencies[on]))
        emit(f"{prefix}_idle_resumes", resumes, "resumes", "idle pauses", pauses)
        # what a step after an idle pause waits for: the resume (the node's own figure)
        for op in ("resume", "pause"):
            count = delta[f"{op}_count"]
            emit(f"{prefix}_node_{op}_mean_ms", delta[f"{op}_sum"] / count * 1000 if count
                 else 0.0, "ms", f"step latency p50 of group {off}",
                 percentile(latencies[off], 0.5))
        for g in names:
            emit(f"{prefix}_failures_{g}", len(failures[g]), "failures",
                 "steps, creates and checks",
                 args.trajectories * (args.steps + 1) + args.held_paused + min(
                     2, args.held_paused))
        emit(f"{prefix}_seconds", seconds, "s", "mean wait x steps",
             args.steps * (args.wait_min + args.wait_max) / 2)
        if checked:
            print(json.dumps({"info": f"{checked} held paused sandboxes resumed and ran a "
                              "step"}), file=sys.stderr)
        if any(failures.values()):
            print(json.dumps({"info": "failures", "first": [f for g in names
                                                            for f in failures[g][:5]]}),
                  file=sys.stderr)
    finally:
        done.set()
        for sbx in [s for g in names for s in made[g] + held[g]]:
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
    parser.add_argument("--agents", action="store_true",
                        help="running trajectories plus held paused sandboxes, idle pause and "
                        "reclaim on against off (see above)")
    parser.add_argument("--trajectories", type=int, default=4,
                        help="per group (--rollout, --agents)")
    parser.add_argument("--held-paused", type=int, default=8,
                        help="paused sandboxes held beside the trajectories, per group (--agents)")
    parser.add_argument("--reclaim-after", type=float, default=30.0,
                        help="minAgeSeconds of the `on` group's cold-memory reclaim (--agents; "
                        "0: off in both groups)")
    parser.add_argument("--steps", type=int, default=5,
                        help="steps after a wait (--rollout, --agents)")
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
        if args.agents:
            asyncio.run(run_rollout(node, args, [
                Group("on", args.idle_after, ColdMemory(minAgeSeconds=args.reclaim_after)
                      if args.reclaim_after else ColdMemory.off(), args.held_paused),
                Group("off", 0, ColdMemory.off(), args.held_paused)], "agents"))
        elif args.rollout:
            args.held_paused = 0
            asyncio.run(run_rollout(node, args, [Group("idle_pause", args.idle_after),
                                                 Group("no_idle_pause", 0)], "rollout"))
        else:
            asyncio.run(run_density(node, args.running, args.paused, args.in_flight))
    finally:
        node.stop()
        remove_network(NODE_PREFIX)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
