"""Cost of the hardening (issue 18), before and after side by side in one run.

- `process` part: two process-backend nodes, one running the code before the hardening
  (`--before-rev`, default 381c5c7: the last commit before issues 13/18, exported with
  `git archive` into a temporary directory), one running this checkout. Interleaved rounds
  measure on both: create until ready (p50), a command through the sandbox proxy (envd
  Process/Start, p50 and the node's CPU per command) and a 16 MiB download through the proxy
  (MiB/s and the node's CPU per download). The proxy's hardening (origin-form only, limits,
  hop-by-hop, guard task) and admission control are what differ.
- `vm` part: this checkout twice on the VM backend, "plain" (QEMU as root, no -sandbox, no
  cgroups) and "hardened" (QEMU as aenv-vm under -sandbox, one cgroup per VM:
  `AENV_CGROUPS=on`, cgroup v2 or the v1 controllers of a hybrid host): create p50
  through the API, the proxied command p50 and 16 MiB download, and the host memory of an idle
  sandbox's QEMU (PSS, RSS, the cgroup's charge when there is one), in alternating rounds.

- `jail` part (issue 24): two runtimes in this process on the test guest, QEMU in a jail per
  VM (runtime/jail.py) against QEMU as the one shared VM user (AENV_QEMU_JAIL off, the code
  before the jail): create (a template snapshot restored to running), restore of a paused VM,
  a fork of 16 and the mean PSS of the 17 idle VMs, in alternating rounds. Goal: each within
  5% of the shared-uid figure.

Prints JSON lines: metric, value (after / hardened / jailed), baseline (before / plain /
shared-uid), ratio.

Usage (root): scripts/isolated.sh .venv/bin/python bench/hardening_bench.py [--quick]
  [--part process|vm|jail|all]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
#: the jail part's pause after each round's kills, before the other arm's round
SETTLE_S = 2.0
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from api_bench import free_port, run_command  # noqa: E402

MIB16 = 16 << 20


def emit(metric: str, value: float, unit: str, baseline: str, baseline_value: float,
         **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit,
                      "baseline": baseline, "baseline_value": round(baseline_value, 3),
                      "ratio": round(value / baseline_value, 3) if baseline_value else None,
                      **extra}), flush=True)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """CPU of a process and its children still alive (the node and its helpers)."""
    total = cpu_seconds(pid)
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            with contextlib.suppress(OSError):
                total += cpu_seconds(int(child))
    return total


class Node:
    """A node subprocess (`python -m agentenv.node`) with its own state dir and port."""

    def __init__(self, label: str, state: Path, args: list[str], env: dict[str, str]) -> None:
        self.label, self.state = label, state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(state.parent / f"{label}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentenv.node", *args, "--state-dir", str(state),
             "--port", str(self.port)], stdout=self.log, stderr=self.log,
            env={k: v for k, v in os.environ.items() if k != "AENV_API_KEY"} | env)
        self.sandboxes: list[str] = []

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1, trust_env=False).status_code == 200:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{self.label} node did not start: "
                                 f"{Path(self.log.name).read_text()[-3000:]}")
            time.sleep(0.2)
        key = (self.state / "secrets" / "api-key").read_text().strip()
        self.api = httpx.Client(base_url=self.url, headers={"X-API-KEY": key}, timeout=600,
                                trust_env=False)

    def create(self) -> tuple[str, float]:
        began = time.perf_counter()
        answer = self.api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 900})
        took = (time.perf_counter() - began) * 1000
        answer.raise_for_status()
        sid = answer.json()["sandboxID"]
        self.sandboxes.append(sid)
        return sid, took

    def kill(self, sid: str) -> None:
        self.api.delete(f"/sandboxes/{sid}")
        self.sandboxes.remove(sid)

    def proxied(self, sid: str) -> httpx.Client:
        token = self.api.get(f"/sandboxes/{sid}").json().get("envdAccessToken")
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}
        if token:
            headers["X-Access-Token"] = token
        return httpx.Client(base_url=self.url, headers=headers, timeout=600, trust_env=False)

    def close(self) -> None:
        for sid in list(self.sandboxes):
            with contextlib.suppress(Exception):
                self.kill(sid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def download_mib_s(client: httpx.Client, path: str) -> float:
    began = time.perf_counter()
    size = 0
    with client.stream("GET", "/files", params={"path": path}) as answer:
        answer.raise_for_status()
        for chunk in answer.iter_raw():
            size += len(chunk)
    assert size == MIB16, size
    return 16 / (time.perf_counter() - began)


def measure_round(node: Node, client: httpx.Client, commands: int,
                  into: dict[str, list[float]]) -> None:
    """Proxied commands (each timed) and one 16 MiB download, with the node's CPU for each."""
    cpu0 = tree_cpu(node.proc.pid)
    for _ in range(commands):
        began = time.perf_counter()
        run_command(client, "true")
        into["command_ms"].append((time.perf_counter() - began) * 1000)
    cpu1 = tree_cpu(node.proc.pid)
    into["command_cpu_ms"].append((cpu1 - cpu0) / commands * 1000)
    into["download_mib_s"].append(download_mib_s(client, "/tmp/blob16"))
    into["download_cpu_ms"].append((tree_cpu(node.proc.pid) - cpu1) * 1000)


def report(results: dict[str, dict[str, list[float]]], after: str, before: str) -> None:
    a, b = results[after], results[before]
    p50 = statistics.median
    emit("create_p50", p50(a["create_ms"]), "ms", before, p50(b["create_ms"]), n=len(a["create_ms"]))
    emit("proxied_command_p50", p50(a["command_ms"]), "ms", before, p50(b["command_ms"]),
         n=len(a["command_ms"]))
    emit("proxied_command_node_cpu", p50(a["command_cpu_ms"]), "ms", before,
         p50(b["command_cpu_ms"]))
    emit("proxied_download_16mib", p50(a["download_mib_s"]), "MiB/s", before,
         p50(b["download_mib_s"]), best=round(max(a["download_mib_s"]), 1),
         baseline_best=round(max(b["download_mib_s"]), 1))
    emit("proxied_download_16mib_node_cpu", p50(a["download_cpu_ms"]), "ms", before,
         p50(b["download_cpu_ms"]))
    for key in ("qemu_pss_mib", "qemu_rss_mib"):
        if a.get(key) and b.get(key):
            emit(f"idle_vm_{key}", p50(a[key]), "MiB", before, p50(b[key]), n=len(a[key]))
    if a.get("cgroup_mib"):
        print(json.dumps({"metric": "idle_vm_cgroup_charge", "value":
                          round(p50(a["cgroup_mib"]), 1), "unit": "MiB", "mode": after}),
              flush=True)


def upload_blob(client: httpx.Client) -> None:
    client.post("/files", params={"path": "/tmp/blob16"}, content=os.urandom(MIB16),
                headers={"Content-Type": "application/octet-stream"}).raise_for_status()


def empty() -> dict[str, list[float]]:
    return {k: [] for k in ("create_ms", "command_ms", "command_cpu_ms", "download_mib_s",
                            "download_cpu_ms", "qemu_pss_mib", "qemu_rss_mib", "cgroup_mib")}


@contextlib.contextmanager
def before_tree(rev: str) -> Iterator[Path]:
    """This repository's `rev` exported (git archive) into a temporary directory."""
    tmp = Path(tempfile.mkdtemp(prefix="aenv-before-"))
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        yield tmp / "src"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def process_part(args: argparse.Namespace) -> None:
    rounds, commands = (5, 10) if args.quick else (15, 20)
    work = Path(tempfile.mkdtemp(prefix="aenv-hardening-"))
    work.chmod(0o711)
    nodes: dict[str, Node] = {}
    try:
        with before_tree(args.before_rev) as old_src:
            (work / "before").mkdir()
            (work / "after").mkdir()
            nodes["before"] = Node("before", work / "before" / "state", ["--backend", "process"],
                                   {"PYTHONPATH": str(old_src)})
            nodes["after"] = Node("after", work / "after" / "state", ["--backend", "process"],
                                  {"PYTHONPATH": str(REPO / "src")})
            for node in nodes.values():
                node.wait(120)
            results = {label: empty() for label in nodes}
            clients = {}
            for label, node in nodes.items():
                sid, _ = node.create()
                clients[label] = node.proxied(sid)
                assert run_command(clients[label], "echo ok") == "ok\n"
                upload_blob(clients[label])
            for i in range(rounds):
                order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
                for label in order:
                    node = nodes[label]
                    sid, took = node.create()
                    results[label]["create_ms"].append(took)
                    node.kill(sid)
                    measure_round(node, clients[label], commands, results[label])
            report(results, "after", "before")
    finally:
        for node in nodes.values():
            node.close()
        shutil.rmtree(work, ignore_errors=True)


def qemu_memory(node: Node, sid: str) -> tuple[float, float, float | None]:
    """PSS and RSS of the sandbox's QEMU (MiB), and its cgroup's charge if it has one."""
    from agentenv.testing.harness import pss_kib

    manifest = json.loads((node.state / "vm-backend" / "sandboxes" / f"{sid}.vm.json")
                          .read_text())
    pid = int(manifest["pid"])
    smaps = pss_kib(pid)
    charge = None
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and path not in ("/", ""):
            usage = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.usage_in_bytes"
            with contextlib.suppress(OSError):
                charge = int(usage.read_text()) / (1 << 20)
        elif controllers == "" and path not in ("/", ""):
            current = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.current"
            with contextlib.suppress(OSError):
                charge = int(current.read_text()) / (1 << 20)
    return smaps["Pss"] / 1024, smaps["Rss"] / 1024, charge


def vm_part(args: argparse.Namespace) -> None:
    from tests.node import conftest

    rounds, commands = (3, 5) if args.quick else (8, 10)
    modes = {
        "plain": {"AENV_QEMU_USER": "root", "AENV_QEMU_SANDBOX": "0", "AENV_CGROUPS": "off"},
        "hardened": {"AENV_CGROUPS": "on"},
    }
    work = Path(tempfile.mkdtemp(prefix="aenv-hardening-vm-", dir="/tmp"))
    work.chmod(0o711)
    nodes: dict[str, Node] = {}
    try:
        for i, (label, env) in enumerate(modes.items()):
            (work / label).mkdir()
            prefix, first = f"ahb{i}", 26401 + 200 * i
            nodes[label] = Node(label, work / label / "state", ["--backend", "vm"], {
                "AENV_VM_ASSETS_DIR": str(conftest.GUEST_STATE),
                "AENV_VM_DEBIAN_CACHE": str(conftest.DEBIAN_CACHE),
                "AENV_VM_NETWORK_PREFIX": prefix, "AENV_VM_FIRST_SLOT": str(first),
                **conftest.NO_READY_POOLS, **env})
            nodes[label].wait(1800)  # one at a time: each builds its base template
        results = {label: empty() for label in nodes}
        clients, idle = {}, {}
        for label, node in nodes.items():
            sid, _ = node.create()
            clients[label] = node.proxied(sid)
            upload_blob(clients[label])
            sid2, _ = node.create()  # an idle one for the memory figures
            idle[label] = sid2
        for i in range(rounds):
            order = list(nodes) if i % 2 == 0 else list(reversed(nodes))
            for label in order:
                node = nodes[label]
                sid, took = node.create()
                results[label]["create_ms"].append(took)
                node.kill(sid)
                measure_round(node, clients[label], commands, results[label])
                pss, rss, charge = qemu_memory(node, idle[label])
                results[label]["qemu_pss_mib"].append(pss)
                results[label]["qemu_rss_mib"].append(rss)
                if charge is not None:
                    results[label]["cgroup_mib"].append(charge)
        report(results, "hardened", "plain")
    finally:
        for node in nodes.values():
            node.close()
        import asyncio

        from agentenv.runtime.network import remove_leftovers

        for i in range(len(modes)):
            asyncio.run(remove_leftovers(f"ahb{i}"))
        shutil.rmtree(work, ignore_errors=True)


def jail_part(args: argparse.Namespace) -> None:
    """The jail per VM (runtime/jail.py) against QEMU as the one shared VM user (the same
    checkout, AENV_QEMU_JAIL off: the code before the jail), two runtimes in this process:
    create (a template snapshot restored to running), restore of a paused VM, a fork of 16 and
    the PSS of idle VMs, in alternating rounds."""
    from agentenv.blockd.client import AsyncBlockdClient
    from agentenv.blockd.launch import BlockdProcess
    from agentenv.runtime.config import RuntimeConfig
    from agentenv.runtime.vm import BootSpec, DiskSource, Runtime
    from agentenv.testing.guest import build_test_guest
    from agentenv.testing.harness import (
        LoopThread,
        blockd_in,
        close_runtime,
        make_ext4_layer,
        pss_kib,
        sh,
    )

    rounds, fork_count = (1, 4) if args.quick else (6, 16)
    guest = build_test_guest()
    work = Path(tempfile.mkdtemp(prefix="aenv-hardening-jail-", dir="/tmp"))
    work.chmod(0o711)
    setups: dict[str, tuple[LoopThread, Runtime, BlockdProcess, Any]] = {}
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for i, (label, jailed) in enumerate({"shared-uid": False, "jailed": True}.items()):
            root = work / label
            root.mkdir(mode=0o711)
            blockd = blockd_in(root)
            blockd.start()
            loop = LoopThread()
            runtime = Runtime(RuntimeConfig(
                state_dir=root / "state", network_prefix=f"ajb{i}", envd_init_path="/cgi-bin/init",
                slot_first_index=27001 + 200 * i, slot_pool_low=1, boot_timeout=300,
                qemu_jail=jailed), blockd=AsyncBlockdClient(blockd.socket))
            setups[label] = (loop, runtime, blockd, None)
            loop.run(runtime.start(kernel_for_probe=guest.kernel))
            layer = make_ext4_layer(root / "rootfs.layer", 64 << 20)
            vm = loop.run(runtime.boot(BootSpec(
                kernel=guest.kernel, initramfs=guest.initramfs, cmdline=guest.cmdline_base,
                disks=[DiskSource("rootfs", 64 << 20, layers=[layer])], memory_mib=256)))
            template = loop.run(runtime.pause(vm, wait_teardown=True))
            setups[label] = (loop, runtime, blockd, template)
            results[label] = {k: [] for k in ("create_ms", "restore_ms", "fork_ms", "idle_pss_mib")}
        for i in range(rounds):
            for label in (list(setups) if i % 2 == 0 else list(reversed(setups))):
                loop, runtime, _, template = setups[label]
                into = results[label]
                began = time.perf_counter()
                vm = loop.run(runtime.restore(template))
                into["create_ms"].append((time.perf_counter() - began) * 1000)
                loop.run(sh(vm, "echo ok"))
                paused = loop.run(runtime.pause(vm, wait_teardown=True))
                began = time.perf_counter()
                vm = loop.run(runtime.restore(paused))
                into["restore_ms"].append((time.perf_counter() - began) * 1000)
                began = time.perf_counter()
                _, children = loop.run(runtime.fork(vm, fork_count))
                into["fork_ms"].append((time.perf_counter() - began) * 1000)
                time.sleep(3)  # idle: the guests settle
                everyone = [vm, *children]
                into["idle_pss_mib"].append(statistics.mean(
                    pss_kib(x.pid)["Pss"] for x in everyone) / 1024)
                for x in everyone:
                    loop.run(runtime.kill(x))
                # the kernel's teardown of 17 VMs (and, jailed, of their mount, PID, IPC and
                # UTS namespaces) goes on after kill returns: without this pause it overlapped
                # the next arm's create and restore, and the bench timed the teardown of one
                # arm inside the other's create (2026-12-05: 1.08-1.09 here, 1.00 apart)
                time.sleep(SETTLE_S)
        p50 = statistics.median
        a, b = results["jailed"], results["shared-uid"]
        for key, unit in (("create_ms", "ms"), ("restore_ms", "ms"), ("fork_ms", "ms"),
                          ("idle_pss_mib", "MiB")):
            emit(f"jail_{key.rsplit('_', 1)[0]}" + ("_p50" if unit == "ms" else ""),
                 p50(a[key]), unit, "shared-uid", p50(b[key]), n=len(a[key]),
                 **({"fork_count": fork_count} if key == "fork_ms" else {}))
    finally:
        for i, (loop, runtime, blockd, _) in enumerate(setups.values()):
            close_runtime(loop, runtime, f"ajb{i}", blockd)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", choices=["process", "vm", "jail", "all"], default="all")
    parser.add_argument("--before-rev", default="381c5c7")
    args = parser.parse_args()
    if args.part in ("process", "all"):
        process_part(args)
    if args.part in ("vm", "all"):
        vm_part(args)
    if args.part in ("jail", "all"):
        jail_part(args)


if __name__ == "__main__":
    main()
