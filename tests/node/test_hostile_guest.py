"""A guest whose root turns against the node (a real VM): whatever it sends the host is bounded.

Root in the attacking sandbox replaces envd with a server of its own whose answers never end,
runs a WebSocket server that sends one endless message, and writes to its serial console
without end. The node must stay small (its RSS within RSS_BOUND of where it started: a watchdog
kills it at once past that, so a failing run never takes the host's memory), answer pause,
resume, fork and a filesystem-only pause of that sandbox within a deadline with an error
naming it, keep the serial log within its cap, and serve another sandbox all along.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from . import conftest
from .conftest import NO_READY_POOLS, NodeProcess

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

NET_PREFIX = "ahg"  # unique: a test teardown deletes every {NET_PREFIX}-s* namespace
FIRST_SLOT = 31601  # 31601-31700: disjoint from the other VM test modules and benches
SERIAL_CAP = 1 << 20
RSS_BOUND = 200 << 20
#: seconds an operation on the attacking sandbox may take before the test calls it hung
DEADLINE = 120.0
WS_PORT = 8765

# Root's server on envd's port: it kills envd (init restarts it within a second, so the port
# is taken first, in a loop) and answers every request with a 200 whose body never ends: as
# fast as it can ("endless"), or a byte a second ("drip").
ENDLESS_ENVD = r'''
import os, socket, sys, threading, time
DRIP = sys.argv[1:] == ["drip"]
def envd_pids():
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"envd" in f.read():
                        yield int(entry)
            except OSError:
                pass
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
while True:
    for pid in envd_pids():
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    try:
        srv.bind(("0.0.0.0", 49983))
        break
    except OSError:
        time.sleep(0.02)
srv.listen(128)
CHUNK = b"x" * 65536
def answer(conn):
    try:
        conn.recv(65536)
        if DRIP:
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n")
            while True:
                conn.sendall(b"x")
                time.sleep(1)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
        while True:
            conn.sendall(CHUNK)
    except OSError:
        conn.close()
while True:
    conn, _ = srv.accept()
    threading.Thread(target=answer, args=(conn,), daemon=True).start()
'''

# A WebSocket server (stdlib only) whose one message announces 2^40 bytes and never ends.
ENDLESS_WEBSOCKET = r'''
import base64, hashlib, socket, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", PORT))
srv.listen(16)
CHUNK = b"y" * 65536
def serve(conn):
    try:
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(4096)
        key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n")
               if l.lower().startswith(b"sec-websocket-key:")][0]
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        conn.sendall(b"\x82\x7f" + (1 << 40).to_bytes(8, "big"))
        while True:
            conn.sendall(CHUNK)
    except OSError:
        conn.close()
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
'''.replace("PORT", str(WS_PORT))


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for pid {pid}")


class RssWatchdog:
    """Watches the node's RSS; past `start + bound` it records the peak and kills the node at
    once (SIGKILL), so a node that reads a guest whole never takes the host down."""

    def __init__(self, node: NodeProcess, bound: int) -> None:
        assert node.proc is not None
        self.node = node
        self.pid = node.proc.pid
        self.start = rss(self.pid)
        self.bound = bound
        self.peak = self.start
        self.tripped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                now = rss(self.pid)
            except (OSError, AssertionError):
                return
            self.peak = max(self.peak, now)
            if now > self.start + self.bound:
                self.tripped = True
                with contextlib.suppress(ProcessLookupError):
                    self.node.proc.kill()  # type: ignore[union-attr]
                return

    def check(self) -> None:
        assert not self.tripped, (
            f"the node's RSS went from {self.start >> 20} MiB to over "
            f"{(self.start + self.bound) >> 20} MiB: killed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def vm_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("hostile")
    node = conftest.vm_node_process(base / "state", base / "node.log", NET_PREFIX, FIRST_SLOT, {
        **NO_READY_POOLS, "AENV_SERIAL_LOG_MAX_BYTES": str(SERIAL_CAP)})
    with conftest.serving_vm_node(node, NET_PREFIX):
        yield node


@pytest.fixture(scope="module")
def bystander(vm_node: NodeProcess) -> Iterator[Any]:
    from e2b import Sandbox

    sbx = Sandbox.create(template="base", timeout=600)
    yield sbx
    with contextlib.suppress(Exception):
        sbx.kill()


@pytest.fixture(scope="module")
def attacker(vm_node: NodeProcess) -> Iterator[Any]:
    from e2b import Sandbox

    sbx = Sandbox.create(template="base", timeout=600)
    yield sbx
    with contextlib.suppress(Exception):
        sbx.kill()


@pytest.fixture
def watchdog(vm_node: NodeProcess) -> Iterator[RssWatchdog]:
    dog = RssWatchdog(vm_node, RSS_BOUND)
    yield dog
    dog.stop()
    dog.check()


def start_as_root(sbx: Any, name: str, script: str, arg: str = "") -> None:
    """Run `script` (python3) as root in `sbx`, detached from envd (it outlives envd)."""
    sbx.files.write(f"/tmp/{name}.py", script, user="root")
    sbx.commands.run(f"setsid -f python3 /tmp/{name}.py {arg} </dev/null >/tmp/{name}.log 2>&1",
                     user="root")


def vm_dirs(node: NodeProcess) -> set[str]:
    return {d.name for d in (node.state_dir / "vm-backend" / "runtime" / "vms").iterdir()}


def serial_logs(node: NodeProcess) -> list[Path]:
    return list((node.state_dir / "vm-backend" / "runtime" / "vms").glob("*/serial.log*"))


def test_serial_console_flood_is_capped(vm_node: NodeProcess, attacker: Any) -> None:
    """Root writes 8 MiB to ttyS0 (the cap is 1 MiB): the log and its rotated tail together stay
    within twice the cap at every look (the runtime trims a few times a second; a UART moves
    about 1 MB/s), and the tail holds what was written last."""
    written = 8 * SERIAL_CAP
    flood = threading.Thread(target=attacker.commands.run, args=(
        f"head -c {written} /dev/zero | tr '\\0' z > /dev/ttyS0",), kwargs={
        "user": "root", "timeout": DEADLINE})
    flood.start()
    largest = 0
    while flood.is_alive():
        by_vm: dict[Path, int] = {}
        for log in serial_logs(vm_node):
            with contextlib.suppress(FileNotFoundError):
                by_vm[log.parent] = by_vm.get(log.parent, 0) + log.stat().st_size
        largest = max([largest, *by_vm.values()])
        assert largest <= 2 * SERIAL_CAP, f"the serial logs of one VM hold {largest} bytes"
        flood.join(0.1)
    rotated = [log for log in serial_logs(vm_node) if log.name == "serial.log.1"]
    assert rotated and any(log.read_bytes().endswith(b"zzzz") for log in rotated)


def test_endless_websocket_message_is_refused(vm_node: NodeProcess, attacker: Any,
                                              watchdog: RssWatchdog) -> None:
    """A WebSocket server in the guest sends one message that never ends, through the node's
    sandbox proxy: the node closes with 1009 (message too big) and stays small."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    start_as_root(attacker, "endless_ws", ENDLESS_WEBSOCKET)
    url = vm_node.url.replace("http://", "ws://") + "/"
    headers = {"E2b-Sandbox-Id": attacker.sandbox_id, "E2b-Sandbox-Port": str(WS_PORT)}
    deadline = time.monotonic() + 30
    while True:
        try:
            ws = connect(url, additional_headers=headers, max_size=None, open_timeout=10,
                         close_timeout=5)
            break
        except Exception:
            assert time.monotonic() < deadline, "the guest's WebSocket server did not start"
            time.sleep(0.2)
    with ws, pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=DEADLINE)
    watchdog.check()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value


def test_endless_envd_fails_that_sandbox_only(vm_node: NodeProcess, attacker: Any,
                                              bystander: Any, watchdog: RssWatchdog) -> None:
    """Root replaces envd with a server whose answers never end. A filesystem-only pause (its
    /aenv/sync), a fork (the child's /init) and a resume (its /init) each fail within the
    deadline with an error naming the sandbox; a memory pause needs no answer and works; the
    node stays small, another sandbox runs commands all along, and the attacker can be
    deleted."""
    sid = attacker.sandbox_id
    start_as_root(attacker, "endless_envd", ENDLESS_ENVD)
    # The node's proxy streams what the guest sends: reading the first MiB proves the server up.
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(httpx.HTTPError), httpx.stream(
                "GET", vm_node.url + "/health", headers={"E2b-Sandbox-Id": sid},
                timeout=10) as answer:
            got = b""
            for chunk in answer.iter_raw():
                got += chunk
                if len(got) >= 1 << 20:
                    break
            if got.startswith(b"xxxx") and len(got) >= 1 << 20:
                break
        assert time.monotonic() < deadline, "the endless server did not take envd's port"
        time.sleep(0.2)

    def timed(api: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
        t0 = time.monotonic()
        answer = api.request(method, path, timeout=DEADLINE, **kwargs)
        assert time.monotonic() - t0 < DEADLINE
        watchdog.check()
        return answer

    with vm_node.client() as api:
        sync = timed(api, "POST", f"/sandboxes/{sid}/pause", json={"memory": False})
        assert sync.status_code >= 400 and sid in sync.json()["message"], sync.text
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"

        fork = timed(api, "POST", f"/sandboxes/{sid}/fork", json={"count": 1})
        assert fork.status_code >= 400 or all("error" in child for child in fork.json()), \
            fork.text
        print("fork:", fork.status_code, fork.text[:500])

        assert timed(api, "POST", f"/sandboxes/{sid}/pause").status_code == 204
        resume = timed(api, "POST", f"/sandboxes/{sid}/connect", json={"timeout": 300})
        assert resume.status_code >= 400 and sid in resume.json()["message"], resume.text
        print("resume:", resume.status_code, resume.text[:500])
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"

        assert bystander.commands.run("echo alive").stdout.strip() == "alive"
        assert timed(api, "DELETE", f"/sandboxes/{sid}").status_code == 204
    print(f"node RSS {watchdog.start >> 20} MiB at the start, {watchdog.peak >> 20} MiB at most")


def paused_with_dripping_envd(node: NodeProcess) -> str:
    """A sandbox whose envd port answers a byte a second, paused; its id."""
    from e2b import Sandbox

    sbx = Sandbox.create(template="base", timeout=600)
    sid = sbx.sandbox_id
    start_as_root(sbx, "drip_envd", ENDLESS_ENVD, "drip")
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(httpx.HTTPError), httpx.stream(
                "GET", node.url + "/health", headers={"E2b-Sandbox-Id": sid},
                timeout=10) as answer:
            if answer.headers.get("content-length") == "100000":
                break
        assert time.monotonic() < deadline, "the dripping server did not take envd's port"
        time.sleep(0.2)
    with node.client() as api:
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
    return sid


def resume_in_background(node: NodeProcess, sid: str) -> tuple[threading.Thread, dict[str, Any],
                                                                set[str]]:
    """Start a resume of `sid` and return once its VM is starting: (thread, its outcome once
    joined, the VM directories from before)."""
    before = vm_dirs(node)
    outcome: dict[str, Any] = {}

    def resume() -> None:
        with node.client() as api, contextlib.suppress(httpx.HTTPError):
            outcome["answer"] = api.post(f"/sandboxes/{sid}/connect", json={"timeout": 300},
                                         timeout=DEADLINE)

    thread = threading.Thread(target=resume)
    thread.start()
    deadline = time.monotonic() + DEADLINE
    while not vm_dirs(node) - before:
        assert time.monotonic() < deadline, "the resume did not start a VM"
        time.sleep(0.05)
    return thread, outcome, before


def test_delete_ends_a_resume_held_by_a_dripping_guest(vm_node: NodeProcess,
                                                      watchdog: RssWatchdog) -> None:
    """envd's port answers /init a byte a second: a resume would wait for the whole restore
    timeout (30 s). Deleting the sandbox meanwhile ends the resume at once (its VM goes, the
    resume's caller gets a 404 naming the sandbox) instead of waiting for it."""
    sid = paused_with_dripping_envd(vm_node)
    try:
        resuming, outcome, before = resume_in_background(vm_node, sid)
        t0 = time.monotonic()
        with vm_node.client() as api:
            deleted = api.delete(f"/sandboxes/{sid}", timeout=DEADLINE)
        took = time.monotonic() - t0
        resuming.join(DEADLINE)
        assert deleted.status_code == 204, deleted.text
        # without the cancel the delete waits out the resume: the restore timeout, 30 s
        assert took < 15, f"the delete took {took:.1f} s"
        answer = outcome["answer"]
        assert answer.status_code == 404 and sid in answer.json()["message"], answer.text
        deadline = time.monotonic() + DEADLINE
        while vm_dirs(vm_node) - before:
            assert time.monotonic() < deadline, "the resume's VM was left behind"
            time.sleep(0.1)
    finally:
        with vm_node.client() as api, contextlib.suppress(httpx.HTTPError):
            api.delete(f"/sandboxes/{sid}")


def test_sigterm_is_honoured_while_a_resume_waits_on_its_guest(vm_node: NodeProcess) -> None:
    """Last (it stops the node): SIGTERM during a resume held by a dripping guest. The node
    ends the resume (the sandbox stays paused), pauses what runs and exits well before the
    resume's own 30 s timeout."""
    sid = paused_with_dripping_envd(vm_node)
    resuming, outcome, _ = resume_in_background(vm_node, sid)
    assert vm_node.proc is not None
    t0 = time.monotonic()
    vm_node.proc.send_signal(signal.SIGTERM)
    try:
        code = vm_node.proc.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - t0
    resuming.join(DEADLINE)
    assert code in (0, -15), f"the node did not exit within {DEADLINE:g} s"
    vm_node.proc = None
    assert took < 20, f"the node took {took:.1f} s to honour SIGTERM"
    # the caller's request ends with the server (uvicorn cancels it) or with the node's 503
    answer = outcome.get("answer")
    assert answer is None or answer.status_code >= 500, answer.text
