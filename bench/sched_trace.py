"""Where a process tree's time goes: scheduler run and wait time by kind of process (QEMU,
memfs, blockd, the runtime's Python, ...) from /proc/<pid>/task/*/schedstat, and the VM cgroups'
memory figures (usage, limit, failcnt, page cache, dirty, major faults) and cpu throttling,
sampled every `--interval` seconds until the root process exits. One JSON line per sample;
`--summary` prints, per interval of N samples, what each kind ran and waited.

The measurement behind runtime/cgroup.py's module doc (fork of 16 under cgroup v1):

    scripts/isolated.sh .venv/bin/pytest tests/runtime/test_lifecycle.py -k fork_16 &
    .venv/bin/python bench/sched_trace.py $! > trace.jsonl
    .venv/bin/python bench/sched_trace.py --summary 10 trace.jsonl
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from pathlib import Path
from typing import Any

CGROUP = Path("/sys/fs/cgroup")


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        pid, ppid = int(text.split()[0]), int(text[text.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(pid)
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += children.get(pid, [])
    return seen


def _kind(pid: int) -> str | None:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    for needle, kind in (("qemu-system", "qemu"), ("memfs", "memfs"), ("blockd", "blockd"),
                         ("python", "python")):
        if needle in cmd:
            return kind
    return "other"


def _schedstat(pid: int) -> tuple[int, int]:
    run = wait = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            fields = Path(path).read_text().split()
        except OSError:
            continue
        run, wait = run + int(fields[0]), wait + int(fields[1])
    return run, wait


def _groups() -> dict[str, Any]:
    """VM groups: children of `*-<8 hex>.slice` parents (memory, pids) and the flat v1 cpu
    groups `<stem>-<vm>` are recognised by their files."""
    out: dict[str, Any] = {}
    for parent in glob.glob(str(CGROUP / "memory/**/*-????????.slice"), recursive=True):
        for vm in sorted(p for p in Path(parent).iterdir() if p.is_dir()):
            try:
                stat = dict(line.split() for line in (vm / "memory.stat").read_text().splitlines())
                out[f"memory:{vm.name}"] = {
                    "usage_mib": int((vm / "memory.usage_in_bytes").read_text()) >> 20,
                    "limit_mib": int((vm / "memory.limit_in_bytes").read_text()) >> 20,
                    "failcnt": int((vm / "memory.failcnt").read_text()),
                    **{k: int(stat[k]) >> 20 for k in ("cache", "rss", "dirty", "writeback")},
                    "pgmajfault": int(stat["pgmajfault"])}
            except (OSError, KeyError, ValueError):
                continue
    for cpu_stat in glob.glob(str(CGROUP / "cpu/**/cpu.stat"), recursive=True):
        group = Path(cpu_stat).parent
        try:  # a group may go away while it is read
            if group == CGROUP / "cpu" or not (group / "cgroup.procs").read_text().strip():
                continue
            stat = dict(line.split() for line in Path(cpu_stat).read_text().splitlines())
            out[f"cpu:{group.relative_to(CGROUP / 'cpu')}"] = {
                "shares": int((group / "cpu.shares").read_text()),
                "nr_throttled": int(stat.get("nr_throttled", 0))}
        except (OSError, ValueError):
            continue
    return out


def sample(root: int, interval: float) -> None:
    while Path(f"/proc/{root}").exists():
        kinds: dict[str, list[int]] = {}
        for pid in _tree(root):
            kind = _kind(pid)
            if kind is None:
                continue
            run, wait = _schedstat(pid)
            entry = kinds.setdefault(kind, [0, 0, 0])
            entry[0] += run
            entry[1] += wait
            entry[2] += 1
        print(json.dumps({"t": round(time.time(), 2), "load": os.getloadavg()[0],
                          "sched": {k: {"run_s": v[0] / 1e9, "wait_s": v[1] / 1e9, "n": v[2]}
                                    for k, v in kinds.items()},
                          "cgroups": _groups()}), flush=True)
        time.sleep(interval)


def summary(path: Path, step: int) -> None:
    """Per interval: each kind's run and wait seconds (only where its process count did not
    change: a process that exited takes its counters with it)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for before, after in zip(rows[::step], rows[step::step], strict=False):
        line: dict[str, Any] = {"t": round(after["t"] - rows[0]["t"], 1), "load": after["load"]}
        for kind, now in after["sched"].items():
            then = before["sched"].get(kind)
            if then and then["n"] == now["n"]:
                line[kind] = {"n": now["n"], "run_s": round(now["run_s"] - then["run_s"], 2),
                              "wait_s": round(now["wait_s"] - then["wait_s"], 2)}
        memory = [g for k, g in after["cgroups"].items() if k.startswith("memory:")]
        if memory:
            line["memory"] = {"groups": len(memory),
                              "failcnt": sum(g["failcnt"] for g in memory),
                              "max_usage_mib": max(g["usage_mib"] for g in memory),
                              "cache_mib": sum(g["cache"] for g in memory)}
        print(json.dumps(line))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="root pid to sample, or with --summary a trace file")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--summary", type=int, metavar="N", default=0,
                        help="summarise a trace, N samples per interval")
    args = parser.parse_args()
    if args.summary:
        summary(Path(args.target), args.summary)
    elif not args.target.isdigit():
        parser.error(f"target must be a pid, not {args.target!r}")
    else:
        sample(int(args.target), args.interval)
