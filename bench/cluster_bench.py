"""Control-plane benchmark, one suite per part (`--suite NAME`, default: all of them).

Suite `gateway` (bench/gateway_suite.py): the gateway against the same requests sent straight to
the node, side by side: proxied `commands.run("true")` p50, 16 MiB download, create p50, and
1,000 concurrent streams held through one gateway.

Suite `scheduler`: a real redis-server (private, unix socket, AOF) and `aenv scheduler` as its
own process (every call authenticated, as in a cluster), with 100 registered nodes that keep heartbeating every 2 s (each listing its
bindings, so reconciliation runs as in production) and 10,000 bindings:

- schedule_record_per_s: Schedule + RecordAssignment pairs per second, CONCURRENCY callers over
  one channel; baseline: the same count of bare Redis round trips of the binding write (the Lua
  script RecordAssignment runs) from the bench process, i.e. the store's own rate.
- lookup_p99_ms / lookup_p50_ms: Lookup of random existing bindings one at a time; baseline:
  the bare Redis HGET of the binding from the bench process.
- lookup_per_s: Lookup throughput with CONCURRENCY callers; baseline: concurrent bare HGETs.

Goals (issue 14): >= 2,000 schedules/s, Lookup p99 <= 2 ms. Prints one JSON object per line
(`goal_met` where the issue sets a goal). `--quick` shortens the timed phases.
Run it inside scripts/isolated.sh beside other work. `--before-rev REV [--rounds N]` runs REV's
own copy of this bench alternating with this checkout's and prints the after/before ratio of
each figure (`--before-rev` again: several revisions in the same rounds, e.g. the stop and
main; issue 23: the tenancy checks may cost no more than 5%). `--checks-cost [--rounds N]`
runs this tree's scheduler suite with each method's caller check on and taken out (the price of
the checks alone, where --before-rev also sees everything else added since REV).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

NODES = 100
BINDINGS = 10_000
CONCURRENCY = 32


def emit(metric: str, value: float, unit: str, baseline: str, baseline_value: float,
         **extra: Any) -> None:
    ratio = value / baseline_value if baseline_value else float("nan")
    print(json.dumps({
        "metric": metric, "value": round(value, 3), "unit": unit, "baseline": baseline,
        "baseline_value": round(baseline_value, 3), "ratio": round(ratio, 3), **extra,
    }), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (load-independent cost, unlike wall time)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Processes:
    """Processes the bench started, stopped in reverse order at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=out)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def wait_until(what: str, probe: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def connects(address: tuple[str, int] | str) -> bool:
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    try:
        with socket.socket(family) as s:
            s.settimeout(0.2)
            s.connect(address)
        return True
    except OSError:
        return False


# --- suite: scheduler --------------------------------------------------------------------------


async def timed_loop(concurrency: int, seconds: float, op: Callable[[int], Awaitable[None]]
                     ) -> float:
    """Run `op(i)` from `concurrency` workers for `seconds`; returns completed ops per second."""
    done = 0
    counter = iter(range(1 << 62))
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await op(next(counter))
            done += 1

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - began)


async def scheduler_suite_async(
    address: str, secret: str, redis_url: str, prefix: str, quick: bool, pids: dict[str, int]
) -> None:
    import redis.asyncio as aioredis

    from agentenv.cluster_keys import node_key
    from agentenv.control.scheduler.store import _RECORD, Binding
    from agentenv.scheduling.client import Credentials, SchedulerClient, pb

    timed = 3.0 if quick else 10.0
    lookups = 2000 if quick else 10000
    # Calls as the gateway makes them (its token on each call); heartbeats as each node.
    client = SchedulerClient(address, Credentials.gateway(secret), timeout=30)
    raw = aioredis.Redis.from_url(redis_url)
    record_script = raw.register_script(_RECORD)
    owned: dict[str, list[str]] = {f"node-{n:03d}": [] for n in range(NODES)}
    failures: list[str] = []

    def status(node_id: str) -> pb.NodeStatus:
        msg = pb.NodeStatus(
            node_id=node_id, address=f"127.0.0.1:{20000 + int(node_id[-3:])}",
            cpu_total=1 << 20, cpu_free=1 << 20, memory_total_mib=1 << 30,
            memory_free_mib=1 << 30, disk_free_bytes=1 << 40,
            templates=["base"] if node_id.endswith(("0", "5")) else [],
        )
        for sid in owned[node_id]:
            msg.sandboxes.add(sandbox_id=sid, state="running")
        return msg

    async def heartbeats() -> None:
        # Each node every 2 s, spread over the interval, as real nodes would.
        while True:
            for node_id in owned:
                try:
                    await client.heartbeat(status(node_id), credentials=node_credentials[node_id])
                except Exception as exc:  # keep beating; count what failed
                    failures.append(repr(exc))
                await asyncio.sleep(2.0 / NODES)

    node_credentials = {node_id: Credentials.node(node_key(secret, node_id), node_id)
                        for node_id in owned}
    for node_id in owned:
        await client.heartbeat(status(node_id), credentials=node_credentials[node_id])
    ids = [f"sbx-{i:06d}" for i in range(BINDINGS)]
    sem = asyncio.Semaphore(CONCURRENCY)

    async def prefill(i: int) -> None:
        node_id = f"node-{i % NODES:03d}"
        async with sem:
            await client.record_assignment(ids[i], node_id, vcpus=1, memory_mib=1)
        owned[node_id].append(ids[i])

    beating = asyncio.create_task(heartbeats())
    try:
        began = time.perf_counter()
        await asyncio.gather(*(prefill(i) for i in range(BINDINGS)))
        prefill_s = time.perf_counter() - began

        # Schedule + RecordAssignment (the gateway's create path minus the node).
        fresh = itertools.count()
        async def schedule_record(i: int) -> None:
            placed = await client.schedule(template_id="base", vcpus=1, memory_mib=1)
            sid = f"new-{next(fresh):07d}"
            await client.record_assignment(sid, placed.node_id, vcpus=1, memory_mib=1)
            owned[placed.node_id].append(sid)

        async def bare_record(i: int) -> None:
            node_id = f"node-{i % NODES:03d}"
            binding = Binding(f"raw-{i:07d}", node_id, "", int(time.time() * 1000), 1, 1)
            # One binding per script call: what one writer alone gets from Redis.
            await record_script(args=[prefix + "baseline:", binding.sandbox_id, node_id,
                                      binding.encode()])

        await timed_loop(CONCURRENCY, 0.5, schedule_record)  # warm
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        wall0 = time.perf_counter()
        rate = await timed_loop(CONCURRENCY, timed, schedule_record)
        pairs = rate * (time.perf_counter() - wall0)
        cpu = {name: (cpu_seconds(pid) - cpu0[name]) / pairs * 1e6 for name, pid in pids.items()}
        raw_rate = await timed_loop(CONCURRENCY, timed / 2, bare_record)
        emit("schedule_record_per_s", rate, "pairs/s", "bare Redis binding writes/s",
             raw_rate, concurrency=CONCURRENCY, nodes=NODES,
             bindings=BINDINGS, goal=2000, goal_met=rate >= 2000,
             prefill_records_per_s=round(BINDINGS / prefill_s, 1),
             scheduler_cpu_us_per_pair=round(cpu["scheduler"], 1),
             redis_cpu_us_per_pair=round(cpu["redis"], 1),
             # what one idle core of the scheduler process would sustain
             scheduler_core_capacity_per_s=round(1e6 / cpu["scheduler"]))

        # Lookup latency, one at a time (p99 is what a proxied request waits for).
        rng = random.Random(7)
        lat: list[float] = []
        base: list[float] = []
        key = prefix + "bindings"
        for _ in range(lookups):
            sid = ids[rng.randrange(BINDINGS)]
            t0 = time.perf_counter()
            found = await client.lookup(sid)
            t1 = time.perf_counter()
            await raw.hget(key, sid)
            t2 = time.perf_counter()
            assert found is not None, sid
            lat.append((t1 - t0) * 1000)
            base.append((t2 - t1) * 1000)
        p99, base_p99 = percentile(lat, 0.99), percentile(base, 0.99)
        emit("lookup_p99_ms", p99, "ms", "bare Redis HGET p99", base_p99, samples=lookups,
             goal=2.0, goal_met=p99 <= 2.0)
        emit("lookup_p50_ms", statistics.median(lat), "ms", "bare Redis HGET p50",
             statistics.median(base), samples=lookups)

        async def lookup(i: int) -> None:
            await client.lookup(ids[i % BINDINGS])

        async def bare_lookup(i: int) -> None:
            await raw.hget(key, ids[i % BINDINGS])

        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        wall0 = time.perf_counter()
        lookup_rate = await timed_loop(CONCURRENCY, timed / 2, lookup)
        done = lookup_rate * (time.perf_counter() - wall0)
        lookup_cpu = (cpu_seconds(pids["scheduler"]) - cpu0["scheduler"]) / done * 1e6
        bare_rate = await timed_loop(CONCURRENCY, timed / 2, bare_lookup)
        emit("lookup_per_s", lookup_rate, "lookups/s", "bare Redis HGET/s", bare_rate,
             concurrency=CONCURRENCY,
             # one unary RPC + one Redis read: about the floor of any RPC of the scheduler
             scheduler_cpu_us_per_lookup=round(lookup_cpu, 1))

        # What the nodes' heartbeats alone cost the scheduler (100 nodes, every 2 s).
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        await asyncio.sleep(4.0)
        emit("heartbeat_cpu_share", (cpu_seconds(pids["scheduler"]) - cpu0["scheduler"]) / 4.0,
             "core", "none", 0.0, nodes=NODES,
             sandboxes_per_heartbeat=round(sum(map(len, owned.values())) / NODES),
             heartbeat_failures=len(failures), first_failure=failures[0] if failures else "",
             beating=not beating.done())
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await client.close()
        await raw.aclose()


def scheduler_suite(args: argparse.Namespace, work: Path, procs: Processes) -> None:
    redis_server = shutil.which("redis-server")
    if not redis_server:
        raise SystemExit("redis-server is missing (apt-get install redis-server)")
    sock = work / "redis.sock"
    redis_proc = procs.start([redis_server, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm",
                 "700", "--dir", str(work), "--appendonly", "yes", "--appendfsync",
                 args.appendfsync, "--save", "", "--daemonize", "no"], work / "redis.log")
    wait_until("redis-server", lambda: connects(str(sock)))
    redis_url = f"unix://{sock}"
    port = free_port()
    address = f"127.0.0.1:{port}"
    prefix = "bench:"
    secret = secrets.token_urlsafe(32)
    secret_file = work / "cluster-secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    # --scheduler-checks off: the same scheduler with each method's caller check taken out
    # (the request parsed and timed as the checked handler does), to price the checks alone.
    launcher = (["-c", UNCHECKED_SCHEDULER] if args.scheduler_checks == "off"
                else ["-m", "agentenv.cli.main"])
    sched_proc = procs.start([sys.executable, *launcher, "scheduler", "--listen", address,
                 "--cluster-secret-file", str(secret_file),
                 "--redis", redis_url, "--redis-prefix", prefix, "--log-level", "warning"],
                work / "scheduler.log")
    wait_until("the scheduler", lambda: connects(("127.0.0.1", port)))
    print(json.dumps({"suite": "scheduler", "load_avg_1m": round(os.getloadavg()[0], 2),
                      "cpus": os.cpu_count(), "appendfsync": args.appendfsync}), flush=True)
    asyncio.run(scheduler_suite_async(address, secret, redis_url, prefix, args.quick,
                                      {"scheduler": sched_proc.pid, "redis": redis_proc.pid}))


#: `aenv scheduler` with ClusterAuth's per-method wrapper replaced by one that parses, calls and
#: times the method exactly as the checked one does, without looking at the caller.
UNCHECKED_SCHEDULER = """
import time
from agentenv.control.scheduler import auth

def unchecked(self, name, inner, parse):
    observe, perf_counter = self._observe, time.perf_counter

    async def call(raw, context):
        request = parse(raw)
        began = perf_counter()
        answer = await inner(request, context)
        observe(name, "OK", perf_counter() - began)
        return answer

    return call

auth.ClusterAuth._checked = unchecked
from agentenv.cli.main import main
main()
"""


def checks_cost(args: argparse.Namespace) -> None:
    """The scheduler suite of this tree with the caller checks on and off, alternating
    ROUNDS times; medians and on/off ratios (issue 23: the checks cost <= 5%)."""
    values: dict[str, dict[str, list[float]]] = {"on": {}, "off": {}}
    for round_ in range(args.rounds):
        for label in (("off", "on") if round_ % 2 == 0 else ("on", "off")):  # no order bias
            for figure in _run_tree(ROOT, args, "scheduler", ("--scheduler-checks", label)):
                metric = figure.get("metric")
                if metric in COMPARED:
                    values[label].setdefault(metric, []).append(float(figure["value"]))
                    if "scheduler_cpu_us_per_pair" in figure:
                        values[label].setdefault("scheduler_cpu_us_per_pair", []).append(
                            float(figure["scheduler_cpu_us_per_pair"]))
                    print(json.dumps({"checks": label, **figure}), flush=True)
    better = {**{m: more for m, (more, _) in COMPARED.items()}, "scheduler_cpu_us_per_pair": False}
    for metric, more_is_better in better.items():
        off, on = values["off"].get(metric), values["on"].get(metric)
        if not off or not on:
            continue
        b, a, ratio = _medians(off, on, more_is_better)
        print(json.dumps({"metric": metric, "checks_off": round(b, 3), "checks_on": round(a, 3),
                          "runs": len(on), "on_vs_off": round(ratio, 3), "goal": 0.95,
                          "goal_met": ratio >= 0.95}), flush=True)


def gateway_suite(args: argparse.Namespace, work: Path, procs: Processes) -> None:
    """bench/gateway_suite.py: gateway vs direct to the node, 1,000 streams held."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gateway_suite import gateway_suite as run_gateway_suite

    run_gateway_suite(args, work, procs)


#: suite name -> function(args, work dir, processes).
SUITES: dict[str, Callable[[argparse.Namespace, Path, Processes], None]] = {
    "scheduler": scheduler_suite,
    "gateway": gateway_suite,
}


#: the figures compared between trees, and whether more is better
# metric -> (more is better, field compared). The gateway's figures are compared as their ratio
# to the same request sent straight to the node in the same run (the gateway's overhead): the
# node's own time moves with the host's load far more than the gateway's share of it does.
COMPARED = {
    "schedule_record_per_s": (True, "value"), "lookup_p99_ms": (False, "value"),
    "lookup_per_s": (True, "value"), "proxied_run_true_p50_ms": (False, "ratio"),
    "create_p50_ms": (False, "ratio"), "download_16mib_mib_s": (True, "ratio"),
}


def _run_tree(tree: Path, args: argparse.Namespace, suite: str | None = None,
              extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One run of `tree`'s own bench (its code on PYTHONPATH), of `suite` (default
    args.suite) with `extra` arguments; its JSON lines."""
    argv = [sys.executable, str(tree / "bench" / "cluster_bench.py"), "--suite",
            suite or args.suite, "--appendfsync", args.appendfsync,
            *(["--quick"] if args.quick else []), *extra]
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the bench of {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = []
    for line in done.stdout.splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(line))
    return lines


def _medians(base: list[float], new: list[float], more_is_better: bool
             ) -> tuple[float, float, float]:
    """(median of base, median of new, new against base, oriented so that < 1 is worse)."""
    b, a = statistics.median(base), statistics.median(new)
    return b, a, (a / b) if more_is_better else (b / a)


def compare_trees(args: argparse.Namespace) -> None:
    """This checkout against each --before-rev, alternating runs (this host is noisy): each
    figure's median per tree (the gateway's as ratios to direct: see COMPARED; the scheduler's
    CPU per pair beside them) and the after/before ratio, oriented so that < 1 is worse."""
    olds: dict[str, Path] = {}
    try:
        for rev in args.before_rev:
            olds[rev] = old = Path(tempfile.mkdtemp(prefix="aenv-cluster-bench-before-"))
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        values: dict[str, dict[str, list[float]]] = {rev: {} for rev in [*olds, "after"]}
        trees = [*olds.items(), ("after", ROOT)]
        for round_ in range(args.rounds):
            # the order turns each round: no tree always runs first or after the same one
            shift = round_ % len(trees)
            for label, tree in trees[shift:] + trees[:shift]:
                for line in _run_tree(tree, args):
                    if line.get("metric") in COMPARED:
                        field = COMPARED[line["metric"]][1]
                        values[label].setdefault(line["metric"], []).append(float(line[field]))
                        if "scheduler_cpu_us_per_pair" in line:
                            values[label].setdefault("scheduler_cpu_us_per_pair", []).append(
                                float(line["scheduler_cpu_us_per_pair"]))
                        print(json.dumps({"tree": "after" if label == "after" else "before",
                                          "rev": label, "round": round_ + 1,
                                          "load_avg_1m": round(os.getloadavg()[0], 2), **line}),
                              flush=True)
        compared = {**{m: (more, field) for m, (more, field) in COMPARED.items()},
                    "scheduler_cpu_us_per_pair": (False, "value")}
        for rev in olds:
            for metric, (more_is_better, field) in compared.items():
                before, after = values[rev].get(metric), values["after"].get(metric)
                if not before or not after:
                    continue
                b, a, ratio = _medians(before, after, more_is_better)
                goal = {} if metric == "scheduler_cpu_us_per_pair" else {
                    "goal": 0.95, "goal_met": ratio >= 0.95}
                print(json.dumps({"metric": metric, "compared": field,
                                  "before": round(b, 3), "after": round(a, 3),
                                  "before_rev": rev, "runs": len(after),
                                  "after_vs_before": round(ratio, 3), **goal}), flush=True)
    finally:
        for old in olds.values():
            shutil.rmtree(old, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="shorter timed phases")
    parser.add_argument("--appendfsync", choices=["always", "everysec"], default="everysec",
                        help="Redis AOF fsync policy (deploy/kubernetes uses everysec)")
    parser.add_argument("--before-rev", action="append", default=[], metavar="REV",
                        help="also run REV's own copy of this bench (its tree exported with git "
                             "archive), alternating with this checkout's, ROUNDS times each, and "
                             "print after/before ratios (issue 23: the checks cost <= 5%%); "
                             "given more than once, each REV in the same rounds")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of each tree (--before-rev) or arm (--checks-cost)")
    parser.add_argument("--checks-cost", action="store_true",
                        help="the scheduler suite of this tree with its caller checks on and off, "
                             "alternating ROUNDS times, and the on/off ratios")
    parser.add_argument("--scheduler-checks", choices=["on", "off"], default="on",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.before_rev:
        compare_trees(args)
        return
    if args.checks_cost:
        checks_cost(args)
        return
    for name, suite in SUITES.items():
        if args.suite not in ("all", name):
            continue
        work = Path(tempfile.mkdtemp(prefix=f"aenv-cluster-bench-{name}-"))
        procs = Processes()
        try:
            suite(args, work, procs)
        finally:
            procs.stop_all()
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
