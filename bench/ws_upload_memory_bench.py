"""Node memory for clients' large WebSocket messages, before and after the fragment relay of
the client's side (relay/websocket.py), side by side in one run.

Two process-backend nodes: "before" runs `--before-rev` (default: main, exported with `git
archive`), "after" this checkout. On each, N clients open a WebSocket through the node's
sandbox proxy to a guest stand-in on loopback and each send one 16 MiB message at once:

- `never_reads`: the guest answers the handshake and never reads (the worst case: a relay
  that gathers holds every message); measured once the clients are blocked (no byte moved for
  3 s) or have sent everything.
- `reads`: the guest reads everything; measured until every message arrived (also its time).

Figures: the node's peak RSS growth (sampled every 20 ms) over its RSS before the clients
sent, in MiB, and per connection. Prints JSON lines (metric, value = after, baseline_value =
before, ratio).

Usage: scripts/isolated.sh .venv/bin/python bench/ws_upload_memory_bench.py [--clients N]
  [--before-rev REV]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from tests.node.conftest import NodeProcess  # noqa: E402
from tests.node.test_hostile_guest import rss  # noqa: E402
from tests.node.test_ws_client_stream import MESSAGE, _frame_head, _guest, _open  # noqa: E402

from hardening_bench import before_tree  # noqa: E402


class Peak:
    """The peak RSS of a process, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = rss(pid)
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError, AssertionError):
                self.peak = max(self.peak, rss(self.pid))

    def growth_mib(self) -> float:
        self._stop.set()
        self._thread.join()
        return (self.peak - self.start) / (1 << 20)


def measure(node: NodeProcess, sid: str, clients: int, reading: bool) -> dict[str, float]:
    payload = memoryview(_frame_head(MESSAGE, b"\0\0\0\0") + bytes(MESSAGE))
    sent = [0] * clients
    with _guest(reading) as guest:
        socks = [_open(node, sid, guest.server_address[1]) for _ in range(clients)]
        assert node.proc is not None
        peak = Peak(node.proc.pid)
        began = time.monotonic()

        def send_all(i: int) -> None:
            with contextlib.suppress(OSError):
                for start in range(0, len(payload), 64 << 10):
                    socks[i].sendall(payload[start:start + (64 << 10)])
                    sent[i] = start + (64 << 10)

        for sock in socks:
            sock.settimeout(None)
        senders = [threading.Thread(target=send_all, args=(i,), daemon=True)
                   for i in range(clients)]
        for sender in senders:
            sender.start()
        took = 0.0
        try:
            deadline = time.monotonic() + 300
            if reading:
                while sum(guest.received.values()) < clients * MESSAGE:
                    assert time.monotonic() < deadline, "the messages never all arrived"
                    time.sleep(0.05)
                took = time.monotonic() - began
            else:
                last: list[int] = []
                quiet = 0
                while quiet < 15 and time.monotonic() < deadline:
                    time.sleep(0.2)
                    now = list(sent)
                    quiet = quiet + 1 if now == last else 0
                    last = now
            growth = peak.growth_mib()
        finally:
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.shutdown(2)
                sock.close()
    return {"growth_mib": growth, "per_conn_mib": growth / clients, "seconds": took}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--before-rev", default="main")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aenv-wsmem-"))
    nodes: dict[str, NodeProcess] = {}
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        with before_tree(args.before_rev) as old_src:
            for label, src in (("before", old_src), ("after", REPO / "src")):
                node = NodeProcess(work / label / "state", work / f"{label}.log",
                                   extra_env={"PYTHONPATH": f"{src}:{REPO}",
                                              "AENV_PROXY_MAX_WEBSOCKETS": str(args.clients)})
                (work / label).mkdir()
                node.start()
                nodes[label] = node
                with node.client() as api:
                    created = api.post("/v2/sandboxes", json={"templateID": "base",
                                                              "timeout": 3600})
                    created.raise_for_status()
                    sid = created.json()["sandboxID"]
                results[label] = {}
                for reading in (False, True):
                    scenario = "reads" if reading else "never_reads"
                    results[label][scenario] = measure(node, sid, args.clients, reading)
                    time.sleep(2)  # the node closes the sessions
                node.cleanup()
        for scenario in ("never_reads", "reads"):
            a, b = results["after"][scenario], results["before"][scenario]
            for key, unit in (("growth_mib", "MiB"), ("per_conn_mib", "MiB"),
                              ("seconds", "s")):
                if key == "seconds" and scenario == "never_reads":
                    continue
                out: dict[str, Any] = {
                    "metric": f"ws_upload_{scenario}_{key}", "clients": args.clients,
                    "message_mib": round(MESSAGE / (1 << 20), 2), "value": round(a[key], 2),
                    "unit": unit, "baseline": args.before_rev,
                    "baseline_value": round(b[key], 2),
                    "ratio": round(a[key] / b[key], 3) if b[key] else None}
                print(json.dumps(out), flush=True)
    finally:
        for node in nodes.values():
            node.cleanup()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.pop("AENV_API_KEY", None)
    main()
