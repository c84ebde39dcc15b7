"""Network slots: envd reachable from the host, outbound on/off, no sandbox reaches another."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from agentenv.snapshot.record import SnapshotRecord
from agentenv.testing.harness import sh

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


def test_two_runtimes_side_by_side(env: Env, idle: SnapshotRecord) -> None:
    """A second runtime on the host (another prefix, the same slot indices asked for: a
    benchmark next to a node) gets other addresses, and each VM answers at its own; a third
    with the first one's prefix is refused, naming the holder, and touches nothing of it."""
    import os

    from agentenv.blockd.client import AsyncBlockdClient
    from agentenv.runtime.config import RuntimeConfig
    from agentenv.runtime.errors import NetworkError
    from agentenv.runtime.network import teardown_host
    from agentenv.runtime.vm import Runtime

    rt = env.runtime
    socket_path = rt.blockd.socket_path
    other = Runtime(RuntimeConfig(state_dir=env.root / "state-other", network_prefix="aet2",
                                  envd_init_path="/cgi-bin/init", slot_pool_low=1,
                                  boot_timeout=300),
                    blockd=AsyncBlockdClient(socket_path))
    a = b = None
    try:
        env.loop.run(other.start(kernel_for_probe=env.guest.kernel))
        a = env.loop.run(rt.restore(idle))
        b = env.loop.run(other.restore(idle))  # its envd /init reached its own VM
        assert a.slot is not None and b.slot is not None
        assert a.slot.guest_address != b.slot.guest_address
        assert a.slot.host_address != b.slot.host_address
        # No address of the new runtime's slot is on two host interfaces.
        for address in (b.slot.host_address, *(s.host_address for s in rt.slots._free)):
            holders = subprocess.run(["ip", "-o", "-4", "addr", "show", "to", f"{address}/32"],
                                     capture_output=True, text=True).stdout.splitlines()
            assert len(holders) == 1, holders
        env.loop.run(sh(a, "echo first > /tmp/who"))
        env.loop.run(sh(b, "echo second > /tmp/who"))
        assert env.loop.run(sh(a, "cat /tmp/who")).strip() == "first"
        assert env.loop.run(sh(b, "cat /tmp/who")).strip() == "second"

        same = Runtime(RuntimeConfig(state_dir=env.root / "state-same", network_prefix="aet",
                                     envd_init_path="/cgi-bin/init", slot_pool_low=1),
                       blockd=AsyncBlockdClient(socket_path))
        with pytest.raises(NetworkError, match=f"'aet' is in use by another runtime.*pid {os.getpid()}"):
            env.loop.run(same.start(kernel_for_probe=env.guest.kernel))
        env.loop.run(same.blockd.close())
        # The first runtime's slot and host table are untouched.
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert a.slot.netns_name in names
        assert subprocess.run(["nft", "list", "table", "ip", "aet_host"],
                              capture_output=True).returncode == 0
        assert env.loop.run(sh(a, "cat /tmp/who")).strip() == "first"
    finally:
        if a is not None:
            env.loop.run(rt.kill(a))
        if b is not None:
            env.loop.run(other.kill(b))
        env.loop.run(other.close())
        env.loop.run(other.blockd.close())
        env.loop.run(teardown_host("aet2"))
