"""Network slots: envd reachable from the host, outbound on/off, no sandbox reaches another."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from agentenv.runtime.harness import sh
from agentenv.snapshot.record import SnapshotRecord

from .conftest import Env

pytestmark = [pytest.mark.qemu, pytest.mark.root]

EXT_NS = "aet-ext"
EXT_HOST_IF = "aetx0"
SERVER_IP = "198.18.0.2"


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def outside_server() -> Iterator[str]:
    """An HTTP server in a namespace of its own, reachable from the host through a veth
    (standing in for 'the internet'; nothing leaves this machine)."""
    subprocess.run(["ip", "netns", "del", EXT_NS], capture_output=True)
    _ip("netns", "add", EXT_NS)
    server = None
    try:
        _ip("link", "add", EXT_HOST_IF, "type", "veth", "peer", "name", "ext0", "netns", EXT_NS)
        _ip("addr", "add", "198.18.0.1/30", "dev", EXT_HOST_IF)
        _ip("link", "set", EXT_HOST_IF, "up")
        _ip("-n", EXT_NS, "addr", "add", f"{SERVER_IP}/30", "dev", "ext0")
        _ip("-n", EXT_NS, "link", "set", "ext0", "up")
        _ip("-n", EXT_NS, "link", "set", "lo", "up")
        _ip("-n", EXT_NS, "route", "add", "default", "via", "198.18.0.1")
        server = subprocess.Popen(
            ["ip", "netns", "exec", EXT_NS, sys.executable, "-m", "http.server", "8080",
             "--bind", SERVER_IP], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 40
        while not _answers(f"http://{SERVER_IP}:8080/"):
            assert server.poll() is None, "test server exited"
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.1)
        yield SERVER_IP
    finally:
        if server is not None:
            server.terminate()
            server.wait(5)
        subprocess.run(["ip", "link", "del", EXT_HOST_IF], capture_output=True)
        subprocess.run(["ip", "netns", "del", EXT_NS], capture_output=True)


# busybox-static's wget crashes in getaddrinfo without NSS files; nc takes a numeric address.
PROBE = ("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port} 2>&1 | head -1 "
         "| grep -q 'HTTP/1' && echo REACHED || echo BLOCKED")


def test_outbound_on_off(env: Env, idle: SnapshotRecord, outside_server: str) -> None:
    rt = env.runtime
    vm = env.loop.run(rt.restore(idle))
    try:
        assert "REACHED" in env.loop.run(sh(vm, PROBE.format(host=outside_server, port=8080)))
        env.loop.run(rt.set_outbound(vm, False))
        assert "BLOCKED" in env.loop.run(sh(vm, PROBE.format(host=outside_server, port=8080)))
        # envd stays reachable from the host while outbound is off.
        assert "hello" in env.loop.run(sh(vm, "echo hello"))
        env.loop.run(rt.set_outbound(vm, True))
        assert "REACHED" in env.loop.run(sh(vm, PROBE.format(host=outside_server, port=8080)))
    finally:
        env.loop.run(rt.kill(vm))
    # A sandbox restored with outbound off.
    vm = env.loop.run(rt.restore(idle, outbound=False))
    try:
        assert "BLOCKED" in env.loop.run(sh(vm, PROBE.format(host=outside_server, port=8080)))
    finally:
        env.loop.run(rt.kill(vm))


def test_sandboxes_cannot_reach_each_other(env: Env, idle: SnapshotRecord) -> None:
    rt = env.runtime
    a = env.loop.run(rt.restore(idle))
    b = env.loop.run(rt.restore(idle))
    try:
        assert a.slot is not None and b.slot is not None
        assert a.slot.netns_name != b.slot.netns_name
        # Both answer the host on the same guest address, each in its own slot.
        assert env.loop.run(sh(a, "hostname")) == env.loop.run(sh(b, "hostname"))
        for target in (b.slot.guest_address, b.slot.host_address, a.slot.host_address):
            assert "BLOCKED" in env.loop.run(sh(a, PROBE.format(host=target, port=49983))), target
    finally:
        env.loop.run(rt.kill(a))
        env.loop.run(rt.kill(b))


def test_slots_are_torn_down(env: Env) -> None:
    rt = env.runtime
    slot = env.loop.run(rt.slots.take())
    assert subprocess.run(["ip", "netns", "exec", slot.netns_name, "ip", "link", "show", "tap0"],
                          capture_output=True).returncode == 0
    env.loop.run(slot.destroy())
    assert subprocess.run(["ip", "link", "show", slot.host_veth],
                          capture_output=True).returncode != 0
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert slot.netns_name not in names
