"""blockd NBD throughput against nbdkit, and device create latency.

blockd serves a 10-layer overlaybd stack (plus a writable upper); nbdkit's file plugin serves
a flat raw export of the same disk, side by side in the same run. fio (nbd ioengine, the same
job settings for both servers: one job, bs and iodepth per case) measures 4 KiB random read and
write IOPS at queue depth 1 and 16, and 1 MiB sequential read MB/s twice: on the fresh stack
(`seqread_1m_qd4_fresh`, before any write) and after the random-write cases
(`seqread_1m_qd4`: the upper then holds tens of thousands of 4 KiB extents, so a 1 MiB read
gathers ~250 pieces).

With `--devices N` (N > 1) it also serves N devices at once: N fio processes run 4 KiB random
read and write at QD16 against N blockd devices, then against N nbdkit processes (one per
device, as nbdkit would be deployed), and prints the aggregate IOPS with the ratio, the server
CPU per I/O, and blockd's per-thread CPU from /proc (`threads`: how many threads did the
work). `--native 0` runs blockd with AENV_BLOCKD_NATIVE=0 (the Python data path).

    python bench/nbd_bench.py [--quick] [--devices N] [--native 0|1]

Prints one JSON object per line: metric, value, unit, baseline, baseline_value, ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentenv.blockd.client import BlockdClient
from agentenv.blockd.errors import BlockdUnavailable
from agentenv.storage.builder import LayerBuilder
from agentenv.storage.export import export_raw
from agentenv.storage.image import Image

MiB = 1 << 20


def build_stack(folder: Path, size: int, layers: int) -> list[Path]:
    """Bottom layer: the whole disk; nine more layers each rewrite ~5% of it in 64 KiB pieces."""
    rng = random.Random(7)
    paths = []
    for n in range(layers):
        path = folder / f"l{n:02d}.lsmt"
        with LayerBuilder(path, size) as builder:
            if n == 0:
                for offset in range(0, size, 4 * MiB):
                    builder.add(offset, os.urandom(4 * MiB))
            else:
                pieces = sorted(rng.sample(range(size // (64 * 1024)), size // (64 * 1024) // 20))
                for piece in pieces:
                    builder.add(piece * 64 * 1024, os.urandom(64 * 1024))
        paths.append(path)
    return paths


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread (name/tid) of a process, from /proc/PID/task/*/schedstat."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except FileNotFoundError:
            continue  # the thread ended
        out[f"{name}/{tid}"] = ns / 1e9
    return out


def fio_many(uris: list[str], rw: str, depth: int, runtime: float, root: Path,
             server_pids: list[int]) -> dict[str, object]:
    """One fio per URI at once; aggregate IOPS, server CPU per I/O, per-thread CPU."""
    cpu_before = sum(cpu_seconds(pid) for pid in server_pids)
    threads_before = thread_cpu(server_pids[0]) if len(server_pids) == 1 else {}
    procs = [subprocess.Popen(
        ["fio", "--name=bench", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", "--bs=4k",
         f"--iodepth={depth}", f"--runtime={runtime}", "--time_based", "--ramp_time=0.3",
         "--output-format=json", f"--output={root / f'fio{n}.json'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for n, uri in enumerate(uris)]
    # Serving threads end with their connection: sample them while fio runs.
    seen: dict[str, float] = {}
    while any(proc.poll() is None for proc in procs):
        if len(server_pids) == 1:
            for key, value in thread_cpu(server_pids[0]).items():
                seen[key] = max(seen.get(key, 0.0), value)
        time.sleep(0.1)
    for proc in procs:
        if proc.returncode != 0:
            raise RuntimeError(f"fio failed: {proc.args}")
    cpu = sum(cpu_seconds(pid) for pid in server_pids) - cpu_before
    iops = ios = 0.0
    for n in range(len(uris)):
        job = json.loads((root / f"fio{n}.json").read_text())["jobs"][0]
        side = job["write"] if "write" in rw else job["read"]
        iops += side["iops"]
        ios += side["total_ios"]
    threads = {k: round(v - threads_before.get(k, 0.0), 3) for k, v in seen.items()
               if v - threads_before.get(k, 0.0) > 0.01}
    return {"iops": iops, "cpu_us": cpu * 1e6 / max(1.0, ios), "threads": threads}


def bench_devices(client: BlockdClient, lowers: list[Path], flat: Path, root: Path,
                  devices: int, runtime: float, blockd_pid: int) -> None:
    """N devices at once against N nbdkit processes (see the module docstring)."""
    uris = []
    for n in range(devices):
        info = client.create(lowers=lowers, upper_dir=root / f"multi{n}")
        uris.append(f"nbd+unix:///{info.export}?socket={info.nbd}")
    kits, kuris = [], []
    try:
        for n in range(devices):
            sock = root / f"k{n}.sock"
            kits.append(subprocess.Popen(["nbdkit", "-f", "-U", str(sock), "file", str(flat)]))
            wait_for(sock, kits[-1])
            kuris.append(f"nbd+unix:///?socket={sock}")
        for rw, name in (("randread", "randread_4k_qd16"), ("randwrite", "randwrite_4k_qd16")):
            ours = fio_many(uris, rw, 16, runtime, root, [blockd_pid])
            base = fio_many(kuris, rw, 16, runtime, root, [k.pid for k in kits])
            metric = f"blockd_{name}_devices{devices}"
            emit(metric, ours["iops"], "IOPS", f"{devices} x nbdkit file", base["iops"])  # type: ignore[arg-type]
            emit(f"{metric}_server_cpu_per_io", ours["cpu_us"], "us",  # type: ignore[arg-type]
                 f"{devices} x nbdkit file", base["cpu_us"])  # type: ignore[arg-type]
            busy = ours["threads"]
            print(json.dumps({"metric": f"{metric}_thread_cpu_s", "threads": busy,
                              "busy_threads": sum(1 for v in busy.values()  # type: ignore[attr-defined]
                                                  if v > 0.1 * runtime)}), flush=True)
    finally:
        for kit in kits:
            kit.send_signal(signal.SIGTERM)
            kit.wait(20)


def fio(uri: str, rw: str, bs: str, depth: int, runtime: float, out: Path,
        server_pid: int) -> dict[str, float]:
    cpu_before = cpu_seconds(server_pid)
    subprocess.run(
        ["fio", "--name=bench", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
         f"--iodepth={depth}", f"--runtime={runtime}", "--time_based", "--ramp_time=0.3",
         "--output-format=json", f"--output={out}"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    cpu = cpu_seconds(server_pid) - cpu_before
    job = json.loads(out.read_text())["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    ios = max(1, side["total_ios"])
    return {"iops": side["iops"], "mbs": side["bw_bytes"] / 1e6, "cpu_us": cpu * 1e6 / ios}


def wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args} did not create {path}")
        time.sleep(0.02)


def emit(metric: str, value: float, unit: str, baseline: str | None = None,
         baseline_value: float | None = None) -> None:
    ratio = round(value / baseline_value, 3) if baseline_value else None
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit,
                      "baseline": baseline, "baseline_value":
                      None if baseline_value is None else round(baseline_value, 3),
                      "ratio": ratio}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small disk, short runs (< 60 s)")
    parser.add_argument("--inline-max", type=int, default=None,
                        help="blockd --inline-max (largest I/O served on the event loop)")
    parser.add_argument("--devices", type=int, default=1,
                        help="also measure this many devices at once (vs as many nbdkits)")
    parser.add_argument("--native", choices=("0", "1"), default=None,
                        help="AENV_BLOCKD_NATIVE for blockd (default: its own default)")
    args = parser.parse_args()
    if args.devices < 1:
        parser.error("--devices must be at least 1")
    size = (128 if args.quick else 512) * MiB
    runtime = 1.5 if args.quick else 5.0
    rounds = 2 if args.quick else 3
    root = Path(tempfile.mkdtemp(prefix="nbdb", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as aenv-vm: it must reach the state dir
    procs: list[subprocess.Popen[bytes]] = []
    try:
        lowers = build_stack(root, size, 10)
        flat = root / "flat.raw"
        with Image.create(lowers, None) as image:
            export_raw(image, flat)
        ctl = root / "ctl.sock"
        blockd = subprocess.Popen(
            [sys.executable, "-m", "agentenv.cli.main", "blockd", "--state-dir", str(root / "st"),
             "--socket", str(ctl), "--no-fuse", "--log-level", "warning",
             *([] if args.inline_max is None else ["--inline-max", str(args.inline_max)])],
            env={**os.environ, **({} if args.native is None else
                                  {"AENV_BLOCKD_NATIVE": args.native})})
        procs.append(blockd)
        ksock = root / "k.sock"
        nbdkit = subprocess.Popen(["nbdkit", "-f", "-U", str(ksock), "file", str(flat)])
        procs.append(nbdkit)
        wait_for(ctl, blockd)
        wait_for(ksock, nbdkit)
        client = BlockdClient(ctl)
        for _ in range(100):
            try:
                client.ping()
                break
            except BlockdUnavailable:
                time.sleep(0.05)

        started = time.perf_counter()
        info = client.create(lowers=lowers, upper_dir=root / "upper")
        cold_ms = (time.perf_counter() - started) * 1e3
        uri = f"nbd+unix:///{info.export}?socket={info.nbd}"
        kuri = f"nbd+unix:///?socket={ksock}"
        # Warm both page caches the same way before measuring.
        subprocess.run(["nbdcopy", uri, "null:"], check=True)
        subprocess.run(["nbdcopy", kuri, "null:"], check=True)

        cases = [("randread", "4k", 1, "randread_4k_qd1", "IOPS"),
                 ("randread", "4k", 16, "randread_4k_qd16", "IOPS"),
                 ("randwrite", "4k", 1, "randwrite_4k_qd1", "IOPS"),
                 ("randwrite", "4k", 16, "randwrite_4k_qd16", "IOPS"),
                 ("read", "1M", 4, "seqread_1m_qd4", "MB/s")]
        # The machine is shared: run blockd and nbdkit alternately, several rounds, and keep
        # each side's best round.
        # Server CPU per I/O (ramp time included, so a slight overestimate for both) does
        # not depend on what else the machine runs; the best round's is kept too.
        best: dict[tuple[str, str], float] = {}
        cpu: dict[tuple[str, str], float] = {}
        fresh = [("read", "1M", 4, "seqread_1m_qd4_fresh", "MB/s")]
        for phase in (fresh, cases):
            for _ in range(rounds):
                for rw, bs, depth, name, unit in phase:
                    key = "iops" if unit == "IOPS" else "mbs"
                    for side, target, pid in (("blockd", uri, blockd.pid),
                                              ("nbdkit", kuri, nbdkit.pid)):
                        result = fio(target, rw, bs, depth, runtime, root / "fio.json", pid)
                        best[(side, name)] = max(best.get((side, name), 0.0), result[key])
                        cpu[(side, name)] = min(cpu.get((side, name), 1e9), result["cpu_us"])
        for _rw, _bs, _depth, name, unit in fresh + cases:
            emit(f"blockd_{name}", best[("blockd", name)], unit, "nbdkit file (flat raw)",
                 best[("nbdkit", name)])
        for _rw, _bs, _depth, name, _unit in fresh + cases:
            emit(f"blockd_{name}_server_cpu_per_io", cpu[("blockd", name)], "us",
                 "nbdkit file (flat raw)", cpu[("nbdkit", name)])

        if args.devices > 1:
            bench_devices(client, lowers, flat, root, args.devices, runtime, blockd.pid)

        # Device creation: a new device (socket, upper over the 10 layers in the caller's
        # folder), as the runtime makes one per writable disk of a boot or restore.
        colds = []
        for n in range(5):
            started = time.perf_counter()
            client.create(lowers=lowers, upper_dir=root / f"cold{n}")
            colds.append((time.perf_counter() - started) * 1e3)
            time.sleep(0.1)

        emit("blockd_create_cold_ms", sorted(colds)[len(colds) // 2], "ms")
        emit("blockd_first_create_ms", cold_ms, "ms")
        client.close()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
