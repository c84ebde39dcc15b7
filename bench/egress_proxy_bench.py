"""Egress proxy: what going through it costs a slot, and what it costs the host.

From inside a real slot namespace (tests/network/lab.py: slots, host nft redirects, an
"internet" namespace with an HTTP server), side by side in one run:
- throughput of a 64 MiB HTTP GET (curl) direct (no redirect) and through the proxy (a name
  policy: the slot's port 80 is redirected, the Host header decides);
- connection setup p50: TCP connect, and connect + a small GET until the response arrives;
- the proxy's RSS idle, with 32 slots known, with 32 slots holding 4 open connections each,
  and its peak while a curl in each of the 32 slot namespaces downloads through it at once.
- the same through the proxy with the name bound to its addresses (a name policy: the name's
  answers looked up and checked) against a policy that allows the address itself (issue 24).
Goals (issue 13): proxied throughput >= 0.7 of direct; proxied connect p50 within +2 ms.

Usage (root): scripts/isolated.sh .venv/bin/python bench/egress_proxy_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.network.lab import INET_SERVER, Lab, http_get, identity  # noqa: E402

from agentenv.network.control import SlotEntry  # noqa: E402
from agentenv.network.policy import EgressPolicy  # noqa: E402

NAME = "example-allowed.test"
NAME_POLICY = {"denyOut": ["0.0.0.0/0"], "allowOut": [NAME]}
SIZE = 64 << 20


def emit(metric: str, value: float, unit: str, baseline: str | None = None,
         baseline_value: float | None = None, **extra: object) -> None:
    ratio = round(value / baseline_value, 3) if baseline_value else None
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit,
                      "baseline": baseline,
                      "baseline_value": None if baseline_value is None else round(baseline_value, 3),
                      "ratio": ratio, **extra}), flush=True)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def curl_mib_s(lab: Lab, netns: str, reps: int) -> float:
    """Best of `reps` 64 MiB GETs, MiB/s (curl in the slot namespace, body discarded)."""
    speeds = []
    for _ in range(reps):
        out = subprocess.run(
            ["ip", "netns", "exec", netns, "curl", "-sS", "-o", "/dev/null", "-H", f"Host: {NAME}",
             "-w", "%{speed_download} %{size_download}", f"http://{INET_SERVER}/blob?size={SIZE}"],
            capture_output=True, text=True, check=True).stdout.split()
        assert int(out[1]) == SIZE, out
        speeds.append(float(out[0]) / (1 << 20))
    return max(speeds)


def connect_ms(lab: Lab, slot, count: int) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """p50 of a TCP connect, of connect + GET / until the response, and the minimum of the
    latter (ms; the minimum shows the path's own cost when the host's other load is away)."""
    tcp, request = [], []
    for _ in range(count):
        started = time.perf_counter()
        sock = lab.connect(slot, INET_SERVER, 80)
        connected = time.perf_counter()
        status, _, _ = http_get(sock, NAME, "/")
        done = time.perf_counter()
        sock.close()
        assert status == 200
        tcp.append((connected - started) * 1000)
        request.append((done - started) * 1000)
    return statistics.median(tcp), statistics.median(request), min(request)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--copy", action="store_true",
                        help="the proxy copies bytes through itself instead of splice(2)")
    args = parser.parse_args()
    reps, count = (2, 40) if args.quick else (5, 100)
    with tempfile.TemporaryDirectory(prefix="egress-bench") as tmp, \
            Lab(Path(tmp), slots=32, prefix="epbench", port=15101, tls=True,
                proxy_args=("--copy",) if args.copy else ()) as lab:
        assert lab.proxy is not None and lab.proxy.pid is not None
        pid = lab.proxy.pid
        emit("egress_proxy_rss_idle", rss_mib(pid), "MiB", slots=0)
        direct, proxied = lab.slots[0], lab.slots[1]
        lab.set_policy(direct, {})  # known to the proxy (metadata), not redirected
        lab.set_policy(proxied, NAME_POLICY)  # port 80/443 redirected
        for slot in lab.slots[2:]:
            lab.set_policy(slot, NAME_POLICY)
        emit("egress_proxy_rss_32_slots", rss_mib(pid), "MiB", slots=32)

        # Interleaved, so that load from the other tenants of the host hits both alike.
        curl_mib_s(lab, lab.guest_ns(direct), 1)  # warm-up (the server's file, caches)
        direct_speed = proxied_speed = proxy_cpu = 0.0
        for _ in range(reps):
            direct_speed = max(direct_speed, curl_mib_s(lab, lab.guest_ns(direct), 1))
            before = cpu_seconds(pid)
            proxied_speed = max(proxied_speed, curl_mib_s(lab, lab.guest_ns(proxied), 1))
            proxy_cpu += cpu_seconds(pid) - before
        mode = "copy" if args.copy else "splice"
        emit("egress_get_64mib_proxied", proxied_speed, "MiB/s", "direct", direct_speed, mode=mode)
        # What the proxy itself spends (independent of the other tenants' load on the host).
        emit("egress_proxy_cpu_per_gib", proxy_cpu / (reps * SIZE / (1 << 30)), "s", mode=mode)

        d_tcp, d_req, d_min = connect_ms(lab, direct, count)
        before = cpu_seconds(pid)
        p_tcp, p_req, p_min = connect_ms(lab, proxied, count)
        emit("egress_proxy_cpu_per_connection", (cpu_seconds(pid) - before) / count * 1e6, "us")
        emit("egress_connect_p50_proxied", p_tcp, "ms", "direct", d_tcp,
             delta_ms=round(p_tcp - d_tcp, 3))
        emit("egress_connect_get_p50_proxied", p_req, "ms", "direct", d_req,
             delta_ms=round(p_req - d_req, 3))
        emit("egress_connect_get_min_proxied", p_min, "ms", "direct", d_min,
             delta_ms=round(p_min - d_min, 3))

        # Names bound to addresses (issue 24): the same proxied path, the name's answers
        # checked (the node's getaddrinfo, cached --resolve-ttl) against a policy that allows
        # the address itself (decided without a lookup): throughput and connection setup.
        by_address = {"denyOut": ["0.0.0.0/0"], "allowOut": [INET_SERVER, NAME]}
        unbound_speed = bound_speed = 0.0
        for _ in range(reps):
            lab.set_policy(proxied, by_address)
            unbound_speed = max(unbound_speed, curl_mib_s(lab, lab.guest_ns(proxied), 1))
            lab.set_policy(proxied, NAME_POLICY)
            bound_speed = max(bound_speed, curl_mib_s(lab, lab.guest_ns(proxied), 1))
        emit("egress_get_64mib_bound_name", bound_speed, "MiB/s", "address_allowed",
             unbound_speed, mode=mode)
        lab.set_policy(proxied, by_address)
        _, u_req, u_min = connect_ms(lab, proxied, count)
        lab.set_policy(proxied, NAME_POLICY)
        _, b_req, b_min = connect_ms(lab, proxied, count)
        emit("egress_connect_get_p50_bound_name", b_req, "ms", "address_allowed", u_req,
             delta_ms=round(b_req - u_req, 3))
        emit("egress_connect_get_min_bound_name", b_min, "ms", "address_allowed", u_min,
             delta_ms=round(b_min - u_min, 3))

        # A policy update: the control round trip (new connections see it once it returns).
        big = {"denyOut": ["0.0.0.0/0"], "allowOut": [
            *(f"198.{i // 256}.{i % 256}.0/24" for i in range(500)),
            *(f"host{i}.example.com" for i in range(498)), NAME]}
        client = lab.client()
        for label, network, distinct in (("small", NAME_POLICY, False),
                                         ("1000_entries_new", big, True),
                                         ("1000_entries_repeated", big, False)):
            times = []
            for i in range(count // 2):
                if distinct:  # a policy the proxy has not parsed yet
                    network = {**network, "allowOut": [*network["allowOut"][:-1], f"n{i}.test"]}
                wire = SlotEntry(proxied.guest_address, identity(proxied.index),
                                 EgressPolicy.from_wire(network))
                started = time.perf_counter()
                lab.loop.run_until_complete(client.set_slot(wire))
                times.append((time.perf_counter() - started) * 1000)
            emit(f"egress_control_set_p50_{label}", statistics.median(times), "ms", slots=32)
        lab.loop.run_until_complete(client.close())

        held = []
        for slot in lab.slots:
            for _ in range(4):
                held.append(lab.tls(slot, NAME) if slot is not direct else
                            lab.connect(slot, "169.254.169.254", 80))
        for sock in held[:: 4]:
            # One request on a few of them, so buffers and TLS state on the path are real.
            if sock.getpeername()[0] == INET_SERVER:
                http_get(sock, NAME, "/")
        time.sleep(0.5)
        stats = lab.control("ping")
        emit("egress_proxy_rss_32_slots_128_conns", rss_mib(pid), "MiB", slots=32,
             connections=stats["connections"])
        for sock in held:
            sock.close()

        # 32 sandboxes' worth of live traffic: every slot name-filtered, a curl in each slot
        # namespace downloading through the proxy at once; the proxy's RSS sampled meanwhile.
        lab.set_policy(direct, NAME_POLICY)
        size, rate = (8 << 20, "1M") if args.quick else (32 << 20, "2M")
        curls = [subprocess.Popen(
            ["ip", "netns", "exec", lab.guest_ns(slot), "curl", "-sS", "-o", "/dev/null",
             "--limit-rate", rate, "-H", f"Host: {NAME}", "-w", "%{size_download}",
             f"http://{INET_SERVER}/blob?size={size}"],
            stdout=subprocess.PIPE, text=True) for slot in lab.slots]
        peak, most = rss_mib(pid), 0
        while any(c.poll() is None for c in curls):
            peak = max(peak, rss_mib(pid))
            most = max(most, int(lab.control("ping")["connections"]))
            time.sleep(0.2)
        sizes = [int(c.communicate()[0] or 0) for c in curls]
        assert all(c.returncode == 0 for c in curls) and sizes == [size] * len(curls), sizes
        emit("egress_proxy_rss_peak_32_slots_32_curls", peak, "MiB", slots=32,
             connections_max=most, bytes_each=size, rate=rate)
        emit("egress_proxy_rss_after_32_curls", rss_mib(pid), "MiB", slots=32)


if __name__ == "__main__":
    main()
