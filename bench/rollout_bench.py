"""RL rollout benchmark (issue 27): N trajectories of K steps on a VM node, through
agentenv.rollout and the official e2b AsyncSandbox.

Each step is a command and a file write, then a pause while "the policy thinks" (--think
seconds) and a resume. At step K/2 a trajectory branches --fork children (each takes one step
and ends): every other trajectory from its paused state, the others from their running one, so
both forks are measured in the same run; at the end it rolls back to its last pause. Side by side in
the same run, the baseline a user would otherwise write with plain create/kill: the same steps,
and instead of a fork, --fork fresh sandboxes that replay the steps so far; instead of a
rollback, a new sandbox that replays them all.

Reports one JSON line per metric: trajectories per minute (both modes), p50/p99 of step, pause,
resume, fork per child and rollback (and the baseline's branch and reset per sandbox), rollback
over a plain resume, peak host memory per live sandbox, errors and 429/503 retries.

    python bench/rollout_bench.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agentenv.rollout import RolloutPool, Trajectory
from api_bench import NODE_PREFIX, VmNode, remove_network


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, **extra}),
          flush=True)


def _used_mib() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) >> 10


class Run:
    """Timings, errors and the memory peak of one mode."""

    def __init__(self, pool: RolloutPool) -> None:
        self.pool = pool
        self.times: dict[str, list[float]] = defaultdict(list)
        self.errors: list[str] = []
        self.peak_per_sandbox = 0.0
        self._idle_mib = _used_mib()

    async def timed(self, what: str, work: Awaitable[Any], per: int = 1) -> Any:
        t0 = time.perf_counter()
        result = await work
        self.times[what].append((time.perf_counter() - t0) / per)
        return result

    async def sample_memory(self) -> None:
        while True:
            live = len(self.pool.live)
            if live:
                per = (_used_mib() - self._idle_mib) / live
                self.peak_per_sandbox = max(self.peak_per_sandbox, per)
            await asyncio.sleep(0.5)


async def _step(run: Run, t: Trajectory, i: int) -> None:
    await run.timed("step", t.step(f"echo {i} >> /home/user/log.txt && sha256sum "
                                   "/home/user/log.txt > /dev/null"))
    await run.timed("step", t.write(f"/home/user/step-{i}.txt", f"step {i}\n" * 64))


async def _think(run: Run, t: Trajectory, think: float) -> None:
    await run.timed("pause", t.pause())
    await asyncio.sleep(think)
    await run.timed("resume", t.resume())


async def rl_trajectory(run: Run, args: argparse.Namespace, paused_fork: bool) -> None:
    t = await run.pool.create()
    for i in range(args.steps):
        await _step(run, t, i)
        await _think(run, t, args.think)
        if i == args.steps // 2 - 1:
            if paused_fork:
                await run.timed("pause", t.pause())
            kind = "paused" if paused_fork else "running"
            children = await run.timed(f"fork_{kind}_per_child", t.branch(args.fork),
                                       per=args.fork)
            await asyncio.gather(*(_step(run, c, i + 1) for c in children))
            await asyncio.gather(*(c.close() for c in children))
            if paused_fork:
                await run.timed("resume", t.resume())
    await run.timed("pause", t.pause())
    await run.timed("resume", t.resume())
    await t.step("echo gone > /home/user/after.txt")
    await run.timed("rollback", t.rollback())
    await t.close()


async def _replayed(run: Run, steps: int) -> Trajectory:
    t = await run.pool.create()
    for i in range(steps):
        await _step(run, t, i)
    return t


async def baseline_trajectory(run: Run, args: argparse.Namespace, _: bool) -> None:
    t = await run.pool.create()
    for i in range(args.steps):
        await _step(run, t, i)
        await _think(run, t, args.think)
        if i == args.steps // 2 - 1:
            children = await run.timed("branch_per_sandbox", asyncio.gather(
                *(_replayed(run, i + 1) for _ in range(args.fork))), per=args.fork)
            await asyncio.gather(*(_step(run, c, i + 1) for c in children))
            await asyncio.gather(*(c.close() for c in children))
    await t.close()
    fresh = await run.timed("reset", _replayed(run, args.steps))
    await fresh.close()


async def measure(node: VmNode, args: argparse.Namespace, mode: str,
                  trajectory: Callable[[Run, argparse.Namespace, bool], Awaitable[None]]
                  ) -> Run:
    async with RolloutPool(api_url=node.url, api_key=node.key, timeout=600,
                           concurrency=args.concurrency) as pool:
        run = Run(pool)
        sampler = asyncio.create_task(run.sample_memory())
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(trajectory(run, args, n % 2 == 0)
                                          for n in range(args.trajectories)),
                                        return_exceptions=True)
        minutes = (time.perf_counter() - t0) / 60
        sampler.cancel()
        run.errors = [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, BaseException)]
        emit(f"{mode}_trajectories_per_min", args.trajectories / minutes, "1/min",
             trajectories=args.trajectories, steps=args.steps, fork=args.fork,
             think_s=args.think)
        for what, values in sorted(run.times.items()):
            ordered = sorted(values)
            emit(f"{mode}_{what}_p50_ms", statistics.median(ordered) * 1e3, "ms",
                 p99_ms=round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 1),
                 n=len(ordered))
        emit(f"{mode}_peak_host_mib_per_live_sandbox", run.peak_per_sandbox, "MiB")
        emit(f"{mode}_errors", len(run.errors), "count", first=run.errors[:3],
             retried=pool.retried)
        return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 trajectories of 4 steps, a fork of 2, 0.5 s of thinking")
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fork", type=int, default=4)
    parser.add_argument("--think", type=float, default=1.0, help="seconds paused per step")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--state-dir", type=Path, default=Path("/var/tmp/aenv-api-bench"),
                        help="the node's state directory, kept between runs (api_bench's)")
    args = parser.parse_args()
    if args.quick:
        args.trajectories, args.steps, args.fork, args.think = 4, 4, 2, 0.5
    node = VmNode(args.state_dir)
    try:
        started = node.start()
        print(json.dumps({"info": "vm node ready", "seconds": round(started, 1)}),
              file=sys.stderr, flush=True)
        rl = asyncio.run(measure(node, args, "rollout", rl_trajectory))
        base = asyncio.run(measure(node, args, "baseline", baseline_trajectory))
        paused = statistics.median(rl.times["fork_paused_per_child"])
        emit("fork_paused_over_running_per_child",
             paused / statistics.median(rl.times["fork_running_per_child"]), "ratio",
             goal="<= 1")
        emit("rollback_over_resume", statistics.median(rl.times["rollback"])
             / statistics.median(rl.times["resume"]), "ratio", goal="<= 1.2")
        emit("fork_paused_per_child_over_baseline_branch",
             paused / statistics.median(base.times["branch_per_sandbox"]), "ratio")
    finally:
        node.stop()
        remove_network(NODE_PREFIX)


if __name__ == "__main__":
    main()
