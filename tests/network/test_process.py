"""The egress proxy as a process and its control socket, as the node drives them (no root: port
0 on loopback, the control socket in a temporary directory)."""

from __future__ import annotations

import asyncio
import json
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentenv.network.control import EgressControlClient, EgressControlError, SlotEntry
from agentenv.network.policy import EgressPolicy
from agentenv.network.process import EgressProxyProcess
from tests.network.lab import identity


def entry(n: int, network: dict[str, object] | None = None) -> SlotEntry:
    return SlotEntry(f"10.12.0.{2 * n + 1}", identity(n), EgressPolicy.from_wire(network or {}))


def test_process_lifecycle_and_control(tmp_path: Path) -> None:
    async def scenario() -> None:
        proc = EgressProxyProcess(tmp_path / "ctl" / "egress.sock", 0, bind="127.0.0.1",
                                  log_path=tmp_path / "egress.log")
        first = await proc.start()
        try:
            assert proc.is_alive() and first["ok"] and first["slots"] == 0
            assert first["port"] > 0 and 1 << 20 < first["rss_bytes"] < 100 << 20
            mode = stat.S_IMODE((tmp_path / "ctl" / "egress.sock").stat().st_mode)
            assert mode & 0o077 == 0  # the node's alone
            client = proc.client
            await client.set_slot(entry(1, {"denyOut": ["0.0.0.0/0"], "allowOut": ["a.test"]}))
            await client.set_slot(entry(2))
            assert (await client.ping())["slots"] == 2
            await client.remove_slot("10.12.0.5")
            await client.remove_slot("10.12.0.5")  # unknown: still ok
            assert (await client.ping())["slots"] == 1
            await client.sync([entry(3), entry(4), entry(5)])
            assert (await client.ping())["slots"] == 3
            with pytest.raises(EgressControlError, match="source 'x' is not an IPv4 address"):
                await client.remove_slot("x")
            # A refused request leaves the connection usable.
            assert (await client.ping())["slots"] == 3
            # A connection from an unknown source (loopback here) is reset at once.
            def attempt() -> None:  # the reset may already meet connect()
                with socket.create_connection(("127.0.0.1", first["port"]), timeout=5) as sock:
                    sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                    if not sock.recv(1):
                        raise ConnectionError("closed")

            with pytest.raises(ConnectionError):
                attempt()
            assert (await client.ping())["unknown_source"] == 1
        finally:
            assert await proc.stop() == 0  # SIGTERM: a clean exit
        assert not proc.is_alive()
        assert not (tmp_path / "ctl" / "egress.sock").exists()
        with pytest.raises(EgressControlError):
            await EgressControlClient(tmp_path / "ctl" / "egress.sock", timeout=1).ping()
        events = [json.loads(line).get("event") for line in
                  (tmp_path / "egress.log").read_text().splitlines()]
        assert events[0] == "started" and events[-1] == "stopped" and "unknown_source" in events

    asyncio.run(scenario())


def _refused(port: int, count: int) -> None:
    """`count` connections from loopback (an unknown source: each reset, each an event)."""
    for _ in range(count):
        try:  # (the reset may already meet connect())
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: " + b"a" * 200 + b"\r\n\r\n")
                sock.recv(1)
        except OSError:
            pass  # reset: refused


def test_what_a_client_causes_at_will_is_logged_within_limits(tmp_path: Path) -> None:
    log_path = tmp_path / "egress.log"

    async def scenario() -> None:
        proc = EgressProxyProcess(tmp_path / "egress.sock", 0, bind="127.0.0.1",
                                  log_path=log_path, extra_args=("--log-burst", "5"))
        port = (await proc.start())["port"]
        try:
            await asyncio.to_thread(_refused, port, 300)
            assert (await proc.client.ping())["unknown_source"] == 300  # counted, every one
        finally:
            assert await proc.stop() == 0

    asyncio.run(scenario())
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    written = [line for line in lines if line.get("event") == "unknown_source"]
    summaries = [line for line in lines if line.get("event") == "log_suppressed"]
    # 5 lines whole in the window (60 s), then one summary with the count (at the stop).
    assert len(written) == 5
    assert [(s["key"], s["suppressed"]) for s in summaries] == \
        [("127.0.0.1", {"unknown_source": 295})]


def test_the_log_file_is_kept_within_its_cap(tmp_path: Path) -> None:
    log_path = tmp_path / "egress.log"
    log_path.write_bytes((b"x" * 99 + b"\n") * 2600)  # 260 KB a previous run left

    async def scenario() -> None:
        proc = EgressProxyProcess(tmp_path / "egress.sock", 0, bind="127.0.0.1",
                                  log_path=log_path, extra_args=("--log-max-bytes", "65536"))
        await proc.start()
        try:
            rotated = tmp_path / "egress.log.1"
            deadline = time.monotonic() + 30
            while not rotated.exists():
                assert time.monotonic() < deadline, "the log was not rotated"
                await asyncio.sleep(0.05)
            assert rotated.stat().st_size == 32768  # the tail: half the cap
            assert log_path.stat().st_size < 32768
        finally:
            assert await proc.stop() == 0
        last = log_path.read_text().splitlines()[-1]  # appended at the new start, no hole
        assert json.loads(last)["event"] == "stopped"

    asyncio.run(scenario())


def test_start_fails_clearly_when_the_port_is_taken(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]

    async def scenario() -> None:
        proc = EgressProxyProcess(tmp_path / "egress.sock", port, bind="127.0.0.1",
                                  log_path=tmp_path / "egress.log")
        with pytest.raises(EgressControlError, match="exited with status"):
            await proc.start()
        assert not proc.is_alive()

    try:
        asyncio.run(scenario())
    finally:
        taken.close()
    assert "Address already in use" in (tmp_path / "egress.log").read_text()


def test_control_protocol_on_the_wire(tmp_path: Path) -> None:
    """Raw JSON lines, as control.py's docstring specifies them, several on one connection."""
    async def scenario() -> None:
        proc = EgressProxyProcess(tmp_path / "egress.sock", 0, bind="127.0.0.1")
        await proc.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(proc.control_path))
            requests = [
                {"op": "set", "slot": entry(1).to_wire()},
                {"op": "ping"},
                "not an object",
                {"op": "set", "slot": {**entry(2).to_wire(), "policy": {"denyOut": ["1.2.3.4/40"]}}},
                {"op": "set", "slot": {"source": "10.12.0.9", "identity": {"sandbox_id": "x"}}},
                {"op": "sync", "slots": [entry(1).to_wire(), entry(1).to_wire()]},
                {"op": "remove", "source": "10.12.0.3"},
            ]
            writer.write(b"".join(json.dumps(r).encode() + b"\n" for r in requests)
                         + b"{broken json\n")
            await writer.drain()
            answers = [json.loads(await reader.readline()) for _ in range(len(requests) + 1)]
            writer.close()
        finally:
            await proc.stop()
        assert answers[0] == {"ok": True, "cut": 0}
        assert answers[1]["ok"] and answers[1]["slots"] == 1
        assert answers[2] == {"ok": False, "error": "a request is a JSON object with an op"}
        assert not answers[3]["ok"] and "1.2.3.4/40" in answers[3]["error"]
        assert not answers[4]["ok"] and "identity" in answers[4]["error"]
        assert answers[5] == {"ok": False, "error": "sync: a source appears twice"}
        assert answers[6] == {"ok": True, "cut": 0}
        assert not answers[7]["ok"]

    asyncio.run(scenario())


def test_cli_runs_the_proxy(tmp_path: Path) -> None:
    sock_path = tmp_path / "egress.sock"
    proc = subprocess.Popen([sys.executable, "-m", "agentenv.cli.main", "egress-proxy",
                             "--control", str(sock_path), "--port", "0", "--bind", "127.0.0.1"],
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while True:  # the socket file exists a moment before it listens
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                answer = asyncio.run(EgressControlClient(sock_path).ping())
                break
            except EgressControlError:
                time.sleep(0.05)
        assert answer["ok"] and answer["slots"] == 0
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert b'"event": "started"' in err
    bad = subprocess.run([sys.executable, "-m", "agentenv.cli.main", "egress-proxy", "--control",
                          str(sock_path), "--port", "0", "--open-range", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "--open-range 'nope' is not an IPv4 CIDR" in bad.stderr


def test_a_restarted_node_adopts_the_running_proxy(tmp_path: Path) -> None:
    async def scenario() -> None:
        sock_path = tmp_path / "egress.sock"
        first = EgressProxyProcess(sock_path, 0, bind="127.0.0.1")
        started = await first.start()
        port = started["port"]
        await first.client.set_slot(entry(1))
        await first.client.close()
        # The node "crashes": `first` is dropped without stop(). A new node adopts.
        second = EgressProxyProcess(sock_path, port, bind="127.0.0.1")
        answer = await second.start(adopt=True)
        assert answer["pid"] == started["pid"] == second.pid and second.is_alive()
        assert answer["slots"] == 1  # its table (and connections) survived
        await second.client.sync([entry(2), entry(3)])
        assert (await second.client.ping())["slots"] == 2
        assert await second.stop() is None
        assert first.proc is not None
        assert first.proc.wait(5) == 0  # it ended on the SIGTERM (and is reaped here)
        assert not second.is_alive()
        # Nothing to adopt: it starts one.
        third = EgressProxyProcess(sock_path, 0, bind="127.0.0.1")
        fresh = await third.start(adopt=True)
        assert fresh["pid"] != started["pid"] and third.proc is not None
        assert await third.stop() == 0

    asyncio.run(scenario())
