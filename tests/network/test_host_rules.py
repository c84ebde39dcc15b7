"""The host side of runtime/network.py without VMs: a foreign forward chain that drops by
default (Docker's) gets accept rules for the slots, taken away again; walls and open ranges;
policy set updates of a slot; a missing `nft` is a clear error. Root (nftables, namespaces)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from ipaddress import IPv4Network

import pytest

from agentenv.network.policy import EgressPolicy
from agentenv.runtime import network as rtnet
from agentenv.runtime.errors import NetworkError

pytestmark = [pytest.mark.root]
PREFIX = "nhr"  # unique per module: the teardown removes {PREFIX}-s* namespaces


@pytest.fixture(autouse=True)
def _root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (nftables, network namespaces)")


def nft(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(["nft", *args], input=stdin, text=True, check=True,
                          capture_output=True).stdout


def test_docker_style_forward_drop_gets_accept_rules_and_loses_them() -> None:
    nft("-f", "-", stdin="table ip nhrdocker { chain FORWARD { type filter hook forward "
                         "priority filter; policy drop; }; }\n")
    try:
        asyncio.run(rtnet.setup_host(PREFIX, 15999))
        rules = nft("list", "chain", "ip", "nhrdocker", "FORWARD")
        assert f'iifname "{PREFIX}h*" oifname != "{PREFIX}h*" accept' in rules
        assert f'oifname "{PREFIX}h*" ct state established,related accept' in rules
        # Set up twice (a restart): still one pair of rules.
        asyncio.run(rtnet.setup_host(PREFIX, 15999))
        assert nft("list", "chain", "ip", "nhrdocker", "FORWARD").count("aenv-slots") == 2
        host = nft("list", "table", "ip", f"{PREFIX}_host")
        assert "redirect to :15999" in host
        assert f'iifname "{PREFIX}h*" meta l4proto {{ tcp, udp }} th dport 15999' in host
    finally:
        asyncio.run(rtnet.teardown_host(PREFIX))
        left = nft("list", "chain", "ip", "nhrdocker", "FORWARD")
        nft("delete", "table", "ip", "nhrdocker")
    assert "aenv-slots" not in left


def test_a_restart_keeps_the_redirects_of_adopted_slots_only() -> None:
    """setup_host again (a node restart): the redirect-set entries of the slots it is told
    survived are carried over (their name-filtered TCP 80/443 never leaves unfiltered while
    the node re-applies policies); the others' go."""
    try:
        asyncio.run(rtnet.setup_host(PREFIX, 15999))
        asyncio.run(rtnet._host_sources(PREFIX, "10.12.0.3", "web"))
        asyncio.run(rtnet._host_sources(PREFIX, "10.12.0.5", "all"))
        asyncio.run(rtnet._host_sources(PREFIX, "10.12.0.7", "web"))
        asyncio.run(rtnet.setup_host(PREFIX, 15999, keep_sources=["10.12.0.3", "10.12.0.5"]))
        table = f"{PREFIX}_host"
        assert asyncio.run(rtnet._host_set_elements(table, "web_src")) == ["10.12.0.3"]
        assert asyncio.run(rtnet._host_set_elements(table, "all_src")) == ["10.12.0.5"]
        asyncio.run(rtnet.setup_host(PREFIX, 15999))
        assert asyncio.run(rtnet._host_set_elements(table, "web_src")) == []
    finally:
        asyncio.run(rtnet.teardown_host(PREFIX))


def test_walls_and_open_ranges() -> None:
    walls = rtnet.walls()
    assert IPv4Network("10.0.0.0/8") in walls and IPv4Network("169.254.0.0/16") in walls
    opened = rtnet.walls(rtnet.parse_open_ranges("192.168.50.0/24"))
    assert not any(IPv4Network("192.168.50.7/32").subnet_of(w) for w in opened)
    assert any(IPv4Network("192.168.51.7/32").subnet_of(w) for w in opened)
    for bad, says in (("10.12.0.0/24", "uses itself"), ("198.18.0.0/24", "not inside"),
                      ("nope", "not an IPv4 CIDR")):
        with pytest.raises(NetworkError, match=says):
            rtnet.parse_open_ranges(bad)


def test_policy_update_replaces_set_elements_in_the_slot() -> None:
    async def scenario() -> tuple[dict[str, list[object]], dict[str, list[object]], str]:
        await rtnet.setup_host(PREFIX, 15999)
        slot = rtnet.NetworkSlot(3, PREFIX)
        await slot.create()
        try:
            await slot.set_policy(EgressPolicy.from_wire(
                {"allowOut": ["1.2.3.4", "a.test"], "denyOut": ["0.0.0.0/0", "5.6.0.0/16"]}))
            first = sets(slot)
            host_web = nft("list", "set", "ip", f"{PREFIX}_host", "web_src")
            await slot.set_policy(EgressPolicy.from_wire({"denyOut": ["9.9.9.9"]}))
            return first, sets(slot), host_web + nft("list", "set", "ip", f"{PREFIX}_host",
                                                     "web_src")
        finally:
            await slot.destroy()
            await rtnet.teardown_host(PREFIX)

    def sets(slot: rtnet.NetworkSlot) -> dict[str, list[object]]:
        out = subprocess.run(["ip", "netns", "exec", slot.netns_name, "nft", "-j", "list",
                              "sets"], capture_output=True, text=True, check=True).stdout
        return {item["set"]["name"]: item["set"].get("elem", [])
                for item in json.loads(out)["nftables"] if "set" in item}

    first, second, host = asyncio.run(scenario())
    assert first["allow"] == ["1.2.3.4"] and len(first["deny"]) == 1  # 0/0 covers 5.6/16
    assert first["dns"] == ["8.8.8.8"] and len(first["proxied"]) == 2  # 80, 443
    assert second["allow"] == [] and second["deny"] == ["9.9.9.9"] and second["proxied"] == []
    assert second["dns"] == []
    # The slot's source was in the host's web redirect set, and left it with the names.
    assert host.count("10.12.0.7") == 1


def test_missing_nft_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(NetworkError, match="nftables"):
        rtnet.require_tools()


def test_the_pool_skips_slots_whose_addresses_the_host_routes() -> None:
    """A host network inside 10.12/16 (here 10.12.40.13/29 on an interface of the host): the
    slots whose /31 holds its local address (.13, index 5126) or its broadcast address (.15,
    5127) would send their guests' replies to the host, or nowhere; the pool skips them (it
    checked only the slot's host address before: it took 5126)."""
    subprocess.run(["ip", "link", "add", "nhrnet", "type", "veth", "peer", "name", "nhrnetp"],
                   check=True)
    try:
        subprocess.run(["ip", "addr", "add", "10.12.40.13/29", "dev", "nhrnet"], check=True)
        subprocess.run(["ip", "link", "set", "nhrnet", "up"], check=True)

        async def take_two() -> list[int]:
            pool = rtnet.SlotPool(PREFIX, low=0, high=0, first_index=5125)
            try:
                return [(await pool.take()).index for _ in range(2)]
            finally:
                await pool.close()

        assert asyncio.run(take_two()) == [5125, 5128]
    finally:
        subprocess.run(["ip", "link", "del", "nhrnet"], check=False)
