"""envd throughput and footprint: `true` through the official e2b SDK, sequential and 8 concurrent,
and envd's idle RSS. Baseline (side by side): spawning the same chrooted shell command directly
with subprocess, i.e. what the command costs without envd and the SDK.

Usage: .venv/bin/python bench/envd_bench.py [--quick]   (as root: envd chroots into a busybox root)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.envd.conftest import make_busybox_root, start_envd  # noqa: E402


def emit(metric: str, value: float, unit: str, baseline: str, baseline_value: float | None) -> None:
    ratio = round(value / baseline_value, 3) if baseline_value else None
    print(json.dumps({"metric": metric, "value": round(value, 2), "unit": unit, "baseline": baseline,
                      "baseline_value": None if baseline_value is None else round(baseline_value, 2), "ratio": ratio}), flush=True)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def direct_spawns_per_second(root: Path, seconds: float) -> float:
    count, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        subprocess.run(["chroot", str(root), "/bin/sh", "-l", "-c", "true"], check=True)
        count += 1
    return count / (time.monotonic() - started)


def sdk_runs_per_second(sandbox, seconds: float, workers: int) -> float:
    counts = [0] * workers
    stop_at = time.monotonic() + seconds

    def worker(index: int) -> None:
        while time.monotonic() < stop_at:
            sandbox.commands.run("true")  # as the default user, like most SDK calls
            counts[index] += 1

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="short runs (under 60 s in all)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("envd_bench: run as root (envd chroots into a busybox root)")
    seconds = 4.0 if args.quick else 20.0
    from e2b import Sandbox

    workdir = Path(tempfile.mkdtemp(prefix="envd-bench-"))
    server = None
    try:
        root = make_busybox_root(workdir / "root")
        server = start_envd(root, workdir)
        time.sleep(1.0)
        emit("envd_idle_rss", rss_kib(server.process.pid) / 1024, "MiB", "python3 -c pass RSS", _bare_python_rss())
        sandbox = Sandbox.create(debug=True, sandbox_url=server.url)
        sandbox.commands.run("true")  # warm up (creates the default user)
        # Interleave short slices so that the baseline and envd see the same background load.
        rounds = 4 if args.quick else 10
        slice_seconds = seconds / rounds
        direct, sequential, concurrent = [], [], []
        for _ in range(rounds):
            direct.append(direct_spawns_per_second(root, slice_seconds))
            sequential.append(sdk_runs_per_second(sandbox, slice_seconds, 1))
            concurrent.append(sdk_runs_per_second(sandbox, slice_seconds, 8))
        baseline = sum(direct) / rounds
        emit("envd_true_sequential", sum(sequential) / rounds, "commands/s",
             "direct chroot sh -l -c true, sequential", baseline)
        emit("envd_true_concurrent8", sum(concurrent) / rounds, "commands/s",
             "direct chroot sh -l -c true, sequential", baseline)
        emit("envd_rss_after_load", rss_kib(server.process.pid) / 1024, "MiB", "python3 -c pass RSS", _bare_python_rss())
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _bare_python_rss() -> float:
    probe = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    time.sleep(0.5)
    value = rss_kib(probe.pid) / 1024
    probe.kill()
    probe.wait()
    return value


if __name__ == "__main__":
    main()
