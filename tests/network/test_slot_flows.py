"""A guest's live flows are bounded (AENV_SLOT_MAX_FLOWS, runtime/network.py), found by the red
team in a real VM: every flow a guest opens is an entry of the host's one connection-tracking
table, shared by every slot and the node itself, and a guest sending SYNs as fast as it can
would fill it in about a minute (then the kernel drops every new flow on the host: other
sandboxes' egress, the node's own connections to envd). Past its limit a guest's new flows are
refused at once; as its flows end, new ones pass again. In the network lab; root."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.network.lab import INET_SERVER, Lab

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)")

MAX_FLOWS = 32


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with Lab(tmp_path_factory.mktemp("flows"), slots=2, prefix="epflow", port=15072, tls=False,
             slot_max_flows=MAX_FLOWS) as lab:
        yield lab


def test_a_guest_past_its_flows_is_refused_and_others_are_not(lab: Lab) -> None:
    hog, other = lab.slots
    held = [lab.connect(hog, INET_SERVER, 80) for _ in range(MAX_FLOWS)]
    try:
        refused = 0
        for _ in range(20):
            try:
                lab.connect(hog, INET_SERVER, 80, timeout=5).close()
            except OSError:
                refused += 1
        assert refused == 20
        lab.connect(other, INET_SERVER, 80).close()  # another slot's flows are its own
        for sock in held[:4]:
            sock.close()
        deadline = time.monotonic() + 30
        while True:  # the closed flows leave the count once conntrack sees them end
            try:
                held.append(lab.connect(hog, INET_SERVER, 80, timeout=5))
                break
            except OSError:
                assert time.monotonic() < deadline, "closed flows were never given back"
                time.sleep(0.2)
    finally:
        for sock in held:
            sock.close()
