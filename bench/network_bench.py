"""Network benchmark: egress from inside a real guest (VM backend, official e2b SDK), direct and
through the node's egress proxy, in the same run, against a test host of tests/netlab.py.

- http_get_mib_s: HTTP GET of a 64 MiB file (16 MiB with --quick) by curl in the guest,
  (a) a sandbox with the default allow-all policy (kernel only), (b) a sandbox allowed only
  `example-allowed.test` (deny 0.0.0.0/0): its TCP 80 goes through the egress proxy.
- connect_p50_ms / first_byte_p50_ms: 100 (20) TCP connects to the test host's port 80 from a
  Python loop in the guest, in 5 rounds alternating between the two sandboxes; first byte =
  connect + `GET /` + the first byte of the answer (through the proxy, connect() ends at the
  proxy, the upstream connect is in the first byte).
- update_p50_ms: `Sandbox.update_network` round trips (50, 10), alternating a deny of test host
  B and allow-all; the call returns once the kernel sets and the proxy's table are replaced,
  and a probe from the guest after each update checks that the new rule is in force.
- proxy_rss_mib: the egress proxy's resident memory with 32 slot entries (the two sandboxes
  plus 30 entries set over its control socket: 32 real VMs do not fit this host).

Goals (issue 13): proxied throughput >= 0.7 of direct, proxied connect p50 within +2 ms of
direct, update p50 <= 100 ms. One JSON object per line. Root only (QEMU, namespaces, nft).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.netlab import ALLOWED_NAME, Internet, internet  # noqa: E402
from tests.node import conftest  # noqa: E402

NET_PREFIX, FIRST_SLOT = "anb", 29001  # 29001-29400: this bench's slots
LAB_PREFIX, LAB_SUBNET = "anbl", 42

PROBE = r'''
import json, socket, statistics, sys, time
host, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
connect, first = [], []
for _ in range(n):
    t0 = time.perf_counter()
    s = socket.create_connection((host, 80), timeout=10)
    t1 = time.perf_counter()
    s.sendall(f"GET / HTTP/1.0\r\nHost: {name}\r\n\r\n".encode())
    s.recv(1)
    t2 = time.perf_counter()
    s.close()
    connect.append((t1 - t0) * 1e3)
    first.append((t2 - t0) * 1e3)
print(json.dumps({"connect": connect, "first": first}))
'''


def emit(**fields: Any) -> None:
    print(json.dumps({"bench": "network", **fields}), flush=True)


def run(sbx: Any, command: str, user: str = "user", timeout: int = 600) -> str:
    return str(sbx.commands.run(command, user=user, timeout=timeout).stdout)


def prepare(sbx: Any, lab: Internet) -> None:
    run(sbx, f"printf '{lab.hosts_lines()}' >> /etc/hosts", user="root")
    sbx.files.write("/tmp/probe.py", PROBE)


def get_rate(sbx: Any, url: str) -> float:
    out = run(sbx, f"curl -s -o /dev/null -w '%{{size_download}} %{{time_total}}' {url}")
    size, seconds = out.split()
    return int(size) / float(seconds) / (1 << 20)


def probe(sbx: Any, host: str, n: int) -> dict[str, list[float]]:
    return dict(json.loads(run(sbx, f"python3 /tmp/probe.py {host} {ALLOWED_NAME} {n}")))


def probes(direct: Any, proxied: Any, host: str, n: int, rounds: int = 5
           ) -> dict[str, dict[str, float]]:
    """p50s of n connects per sandbox, taken in alternating rounds (host load drifts)."""
    samples: dict[str, dict[str, list[float]]] = {
        "direct": {"connect": [], "first": []}, "proxied": {"connect": [], "first": []}}
    for _ in range(rounds):
        for name, sbx in (("direct", direct), ("proxied", proxied)):
            for key, values in probe(sbx, host, max(1, n // rounds)).items():
                samples[name][key].extend(values)
    return {name: {k: statistics.median(v) for k, v in kinds.items()}
            for name, kinds in samples.items()}


def blocked(sbx: Any, url: str) -> bool:
    return run(sbx, f"curl -s -m 5 -o /dev/null {url}; echo $?").strip() != "0"


async def fill_proxy(node: conftest.NodeProcess, extra: int) -> dict[str, Any]:
    from agentenv.network.control import EgressControlClient, SlotEntry, SlotIdentity
    from agentenv.network.policy import EgressPolicy

    client = EgressControlClient(node.state_dir / "vm-backend" / "egress" / "control.sock")
    policy = EgressPolicy.from_wire({"allowOut": [ALLOWED_NAME, "*.example.test"],
                                     "denyOut": ["0.0.0.0/0"]})
    try:
        for i in range(extra):  # addresses of slots this bench never uses (index 29500+)
            source = f"10.12.{(2 * (29500 + i) + 1) >> 8 & 255}.{(2 * (29500 + i) + 1) & 255}"
            await client.set_slot(SlotEntry(source, SlotIdentity(f"bench{i}", "base", None, None,
                                                                 f"token{i}"), policy))
        return await client.ping()
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--state-dir", type=Path,
                        default=Path("/var/tmp/aenv-network-bench/state"),
                        help="kept between runs: the base template is built once")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("network_bench needs root (QEMU, network namespaces, nftables)")
    size = (16 << 20) if args.quick else (64 << 20)
    connects = 20 if args.quick else 100
    updates = 10 if args.quick else 50
    work = Path(tempfile.mkdtemp(prefix="aenv-netbench-"))
    args.state_dir.mkdir(parents=True, exist_ok=True)
    node = conftest.vm_node_process(args.state_dir, args.state_dir.parent / "node.log",
                                    NET_PREFIX, FIRST_SLOT,
                                    {"AENV_VM_POOL_LOW": "0", "AENV_VM_POOL_HIGH": "0"})
    with internet(LAB_PREFIX, LAB_SUBNET, work / "lab") as lab, \
            conftest.serving_vm_node(node, NET_PREFIX):
        from e2b import Sandbox

        direct = Sandbox.create(template="base", timeout=1800)
        proxied = Sandbox.create(template="base", timeout=1800, network={
            "allow_out": [ALLOWED_NAME], "deny_out": ["0.0.0.0/0"]})
        try:
            for sbx in (direct, proxied):
                prepare(sbx, lab)
            url = f"http://{ALLOWED_NAME}/bytes/{size}"
            get_rate(direct, url)  # warm both paths (TCG translation, ARP, page cache)
            get_rate(proxied, url)
            rates = {"direct": [], "proxied": []}  # type: dict[str, list[float]]
            for _ in range(1 if args.quick else 3):
                rates["direct"].append(get_rate(direct, url))
                rates["proxied"].append(get_rate(proxied, url))
            d, p = statistics.median(rates["direct"]), statistics.median(rates["proxied"])
            emit(metric="http_get_mib_s", size_mib=size >> 20, direct=round(d, 1),
                 proxied=round(p, 1), ratio=round(p / d, 3), goal=">= 0.7")

            p50 = probes(direct, proxied, lab.host_a, connects)
            pd, pp = p50["direct"], p50["proxied"]
            emit(metric="connect_p50_ms", n=connects, direct=round(pd["connect"], 2),
                 proxied=round(pp["connect"], 2),
                 delta=round(pp["connect"] - pd["connect"], 2), goal="delta <= 2")
            emit(metric="first_byte_p50_ms", n=connects, direct=round(pd["first"], 2),
                 proxied=round(pp["first"], 2), delta=round(pp["first"] - pd["first"], 2))

            target = lab.url(lab.host_b)
            times, wrong = [], 0
            for i in range(updates):
                deny = i % 2 == 0
                t0 = time.perf_counter()
                direct.update_network({"deny_out": [lab.host_b]} if deny else {})
                times.append((time.perf_counter() - t0) * 1e3)
                wrong += blocked(direct, target) != deny
            emit(metric="update_p50_ms", n=updates, p50=round(statistics.median(times), 1),
                 max=round(max(times), 1), not_in_force_after_return=wrong, goal="p50 <= 100")

            answer = asyncio.run(fill_proxy(node, 30))
            emit(metric="proxy_rss_mib", slots=answer.get("slots"),
                 rss=round(int(answer.get("rss_bytes", 0)) / (1 << 20), 1),
                 note="2 sandboxes + 30 table entries set over the control socket (no VMs)")
        finally:
            for sbx in (direct, proxied):
                with contextlib.suppress(Exception):
                    sbx.kill()


if __name__ == "__main__":
    main()
