"""The node's own networks are walled where they are not private (network/walls.py), found by
the red team in a real VM: the walls were fixed lists, so on a cluster network in public address
space a guest reached the node's neighbours (other nodes' APIs, blockd's P2P port, Redis). The
networks of the interfaces carrying the host's default routes are walled, and the operator's
AENV_NET_WALL_RANGES too, in the slot's own rules and in the egress proxy alike. Real
namespaces (a lab of the test's own); root."""

from __future__ import annotations

import os
from collections.abc import Iterator
from ipaddress import IPv4Network

import pytest

from agentenv.network import walls as walls_mod
from agentenv.network.walls import WallError, configured_wall_ranges, uplink_networks
from tests.network.lab import INET_OTHER, INET_SERVER, Lab, http_get, run
from tests.network.test_egress_proxy import request_is_reset

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)")

NEIGHBOUR = "198.18.0.4"  # INET_OTHER: the lab's "neighbour on the node's network"


@pytest.fixture
def uplink_ns() -> Iterator[str]:
    ns = "aenv-wall-uplink"
    run("ip", "netns", "del", ns, check=False)
    run("ip", "netns", "add", ns)
    try:
        yield ns
    finally:
        run("ip", "netns", "del", ns, check=False)


def test_the_uplinks_public_networks_are_found(uplink_ns: str) -> None:
    assert uplink_networks(uplink_ns) == ()  # no default route: nothing to add
    run("ip", "-n", uplink_ns, "-batch", "-", stdin=(
        "link add up0 type veth peer name up0p\n"  # (no dummy module on every kernel)
        "addr add 198.51.100.7/24 dev up0\n"
        "addr add 10.1.2.3/24 dev up0\n"  # private: walled anyway
        "link set up0 up\n"
        "link set up0p up\n"
        "route add default via 198.51.100.1 dev up0\n"
        "link add side0 type veth peer name side0p\n"  # not an uplink: left alone
        "addr add 203.0.113.9/24 dev side0\n"
        "link set side0 up\n"))
    assert uplink_networks(uplink_ns) == (IPv4Network("198.51.100.0/24"),)


def test_configured_ranges_are_checked() -> None:
    assert configured_wall_ranges(" 198.18.0.0/15, 203.0.113.7 ") == (
        IPv4Network("198.18.0.0/15"), IPv4Network("203.0.113.7/32"))
    with pytest.raises(WallError, match="AENV_NET_WALL_RANGES"):
        configured_wall_ranges("not-a-network")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    # the slots' rules (made here) and the egress proxy (a child: the environment) both read it
    saved = os.environ.get(walls_mod.WALL_RANGES_ENV)
    os.environ[walls_mod.WALL_RANGES_ENV] = f"{NEIGHBOUR}/32"
    walls_mod.extra_walls.cache_clear()
    try:
        with Lab(tmp_path_factory.mktemp("walls"), slots=1, prefix="epwall", port=15073,
                 tls=False) as lab:
            yield lab
    finally:
        if saved is None:
            os.environ.pop(walls_mod.WALL_RANGES_ENV, None)
        else:
            os.environ[walls_mod.WALL_RANGES_ENV] = saved
        walls_mod.extra_walls.cache_clear()


def test_a_walled_neighbour_is_refused_directly_and_through_the_proxy(lab: Lab) -> None:
    slot = lab.slots[0]
    assert INET_OTHER == NEIGHBOUR
    lab.set_policy(slot, {})  # the default policy: every public address is allowed
    with lab.connect(slot, INET_SERVER, 80) as sock:  # a control
        assert http_get(sock, "example-allowed.test", "/")[0] == 200
    with pytest.raises(OSError):  # the slot's own rules: refused at once
        lab.connect(slot, NEIGHBOUR, 80, timeout=5)
    lab.set_policy(slot, {}, mode="all")  # every TCP connection through the egress proxy
    request_is_reset(lab, slot, NEIGHBOUR, 80)
    lab.set_policy(slot, {})
