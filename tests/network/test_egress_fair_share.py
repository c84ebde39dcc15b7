"""The egress proxy's per-slot share of its connections holds while connections live, not only
at admission: a slot that took every connection while it was alone gives back its longest idle
ones, one per connection another slot (under its share) opens once the cap is reached. In the
network lab (tests/network/lab.py); root."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from tests.network.lab import INET_SERVER, Lab, http_get
from tests.network.test_egress_proxy import counters, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)")

ALLOWED = "example-allowed.test"
MAX_CONNECTIONS = 24  # 3 slots: a share of 8 each (MIN_SLOT_SHARE)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    args = ("--max-connections", str(MAX_CONNECTIONS), "--max-per-slot", "1000")
    with Lab(tmp_path_factory.mktemp("share"), slots=3, prefix="epfs", port=15004, tls=False,
             proxy_args=args) as lab:
        yield lab


def _open(lab: Lab, slot: object, count: int) -> list[socket.socket]:
    """`count` connections through the proxy (each answered once, then left idle)."""
    socks = []
    for _ in range(count):
        sock = lab.connect(slot, INET_SERVER, 80)  # type: ignore[arg-type]
        assert http_get(sock, ALLOWED, "/")[0] == 200
        socks.append(sock)
    return socks


def _alive(sock: socket.socket) -> bool:
    try:
        return http_get(sock, ALLOWED, "/")[0] == 200
    except (ConnectionError, OSError):
        return False


def test_a_slot_alone_gives_back_what_it_took_when_others_come(lab: Lab) -> None:
    hog, second, third = lab.slots
    lab.set_policy(hog, {}, mode="all")  # alone: its share is every connection
    held = _open(lab, hog, MAX_CONNECTIONS)
    assert counters(lab)["slot_share"] == MAX_CONNECTIONS
    lab.set_policy(second, {}, mode="all")
    lab.set_policy(third, {}, mode="all")
    share = counters(lab)["slot_share"]
    assert share == MAX_CONNECTIONS // 3
    before = counters(lab).get("evicted", 0)  # (no such counter before: nothing was evicted)
    # The cap is reached: before, the newcomers were refused while the hog kept everything.
    mine = _open(lab, second, share)
    assert counters(lab)["evicted"] == before + share
    # The hog lost its longest idle connections (the first it opened), and keeps the rest.
    assert not any(_alive(sock) for sock in held[:share])
    assert all(_alive(sock) for sock in held[share:])
    # The newcomer at its share: its next connection is refused (nobody's to take).
    third_socks = _open(lab, third, share)  # taken from the hog too
    wait_for(lambda: counters(lab)["connections"] == MAX_CONNECTIONS)
    with pytest.raises((ConnectionError, OSError)):
        _open(lab, second, 1)
    for sock in held + mine + third_socks:
        sock.close()
