"""code-interpreter-v1 benchmark (issue 29): create to first result, pooled and cold, against a
pooled base create plus one command; run_code round trips against commands.run of the same
work. Starts its own VM node (ready pool of 1 per template) through tests/node's fixtures
helpers; needs root and QEMU. Prints one JSON object per line.

    flock /tmp/aenv-vmtest.lock python bench/code_interpreter_bench.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.node import conftest

PREFIX, FIRST_SLOT = "acb", 22401  # 22401-22800
CELL = ("import pandas as pd, matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
        "df = pd.DataFrame({'a': range(100)})\ndf.plot()\nplt.savefig('/tmp/p.png')\n"
        "print(df['a'].sum())")


def emit(metric: str, values: list[float], baseline: str | None = None,
         baseline_values: list[float] | None = None) -> None:
    line: dict[str, Any] = {"metric": metric, "unit": "ms", "n": len(values),
                            "p50": round(pct(values, 0.5), 1), "p99": round(pct(values, 0.99), 1)}
    if baseline and baseline_values:
        line |= {"baseline": baseline, "baseline_p50": round(pct(baseline_values, 0.5), 1),
                 "baseline_p99": round(pct(baseline_values, 0.99), 1),
                 "ratio_p50": round(pct(values, 0.5) / pct(baseline_values, 0.5), 2)}
    print(json.dumps(line), flush=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def parked(node: conftest.NodeProcess) -> float:
    text = httpx.get(node.url + "/metrics", headers={"X-API-KEY": node.api_key},
                     trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("aenv_node_ready_pool_vms"))


def wait_parked(node: conftest.NodeProcess, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while parked(node) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ready pools hold {parked(node)} VMs, not {count}")
        time.sleep(0.2)


def run(node: conftest.NodeProcess, rounds: int, calls: int) -> None:
    from e2b import Sandbox as BaseSandbox
    from e2b_code_interpreter import Sandbox

    pooled, cold, base_cmd = [], [], []
    # where a pooled create-to-first-result goes: the create, the first run_code, a second one
    parts: dict[str, list[float]] = {"create": [], "first": [], "second": [],
                                     "base_create": [], "base_first": []}
    for _ in range(rounds):
        wait_parked(node, 2)
        t0 = time.perf_counter()
        first = Sandbox.create(timeout=300)
        t1 = time.perf_counter()
        assert first.run_code("1 + 1").text == "2"
        t2 = time.perf_counter()
        pooled.append((t2 - t0) * 1000)
        parts["create"].append((t1 - t0) * 1000)
        parts["first"].append((t2 - t1) * 1000)
        t0 = time.perf_counter()
        first.run_code("1 + 1")
        parts["second"].append((time.perf_counter() - t0) * 1000)
        # the pool is empty now: the next create restores the boot snapshot
        t0 = time.perf_counter()
        second = Sandbox.create(timeout=300)
        assert second.run_code("1 + 1").text == "2"
        cold.append((time.perf_counter() - t0) * 1000)
        first.kill()
        second.kill()
        wait_parked(node, 2)
        t0 = time.perf_counter()
        base = BaseSandbox.create(timeout=300)
        t1 = time.perf_counter()
        base.commands.run("true")
        t2 = time.perf_counter()
        base_cmd.append((t2 - t0) * 1000)
        parts["base_create"].append((t1 - t0) * 1000)
        parts["base_first"].append((t2 - t1) * 1000)
        base.kill()
    emit("create_to_first_result_pooled", pooled, "pooled base create + commands.run('true')",
         base_cmd)
    emit("pooled_create_alone", parts["create"], "pooled base create alone",
         parts["base_create"])
    emit("first_run_code_after_pooled_create", parts["first"],
         "first commands.run('true') after a pooled base create", parts["base_first"])
    emit("second_run_code", parts["second"])
    emit("create_to_first_result_cold", cold, "pooled base create + commands.run('true')",
         base_cmd)

    sbx = Sandbox.create(timeout=600)
    try:
        sbx.run_code("1")
        sbx.commands.run("true")
        trivial = [timed(lambda: sbx.run_code("1")) for _ in range(calls)]
        true = [timed(lambda: sbx.commands.run("true")) for _ in range(calls)]
        emit("run_code_trivial", trivial, "commands.run('true')", true)
        cells = [timed(lambda: sbx.run_code(CELL)) for _ in range(max(3, calls // 10))]
        script = [timed(lambda: sbx.commands.run(f"python3 -c {shlex.quote(CELL)}"))
                  for _ in range(max(3, calls // 10))]
        emit("run_code_pandas_matplotlib", cells, "commands.run('python3 -c <same code>')",
             script)
    finally:
        sbx.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="aenv-cibench-"))
    with conftest.code_interpreter_node(base, PREFIX, FIRST_SLOT) as node:
        run(node, args.rounds, args.calls)


if __name__ == "__main__":
    main()
