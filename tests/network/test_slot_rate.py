"""A slot's bandwidth each way is bounded where the node sets AENV_SLOT_RATE_MBIT (a token bucket
on each end of the slot's veth, runtime/network.py): one guest's bulk transfer cannot take the
host's link from the others, whatever path (direct or proxied) and however many flows it uses.
In the network lab (tests/network/lab.py); root. Only lower bounds on time are checked: a slow
machine makes a transfer slower, never faster."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

from tests.network.lab import INET_SERVER, Lab, http_get, read_response, run

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)")

RATE_MBIT = 8  # 1 MB/s each way
SIZE = 3 << 20  # 3 MiB: at least ~3 s at the rate, a fraction of a second unshaped


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with Lab(tmp_path_factory.mktemp("rate"), slots=2, prefix="eprate", port=15071, tls=False,
             slot_rate_mbit=RATE_MBIT) as lab:
        yield lab


def test_both_ends_of_a_slot_carry_the_bucket(lab: Lab) -> None:
    slot = lab.slots[0]
    for qdiscs in (run("tc", "-j", "qdisc", "show", "dev", slot.host_veth),
                   run("ip", "netns", "exec", slot.netns_name, "tc", "-j", "qdisc", "show",
                       "dev", "vpeer")):
        (root,) = [q for q in json.loads(qdiscs) if q.get("root")]
        assert root["kind"] == "tbf" and root["options"]["rate"] == RATE_MBIT * 125_000


def test_a_download_and_an_upload_take_the_slots_rate(lab: Lab) -> None:
    slot = lab.slots[0]
    with lab.connect(slot, INET_SERVER, 80) as sock:
        began = time.monotonic()
        status, _, body = http_get(sock, "example-allowed.test", f"/blob?size={SIZE}")
        down = time.monotonic() - began
        assert status == 200 and len(body) == SIZE
        began = time.monotonic()
        sock.sendall(f"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: {SIZE}\r\n\r\n".encode()
                     + b"u" * SIZE)
        status, _, answer = read_response(sock)
        up = time.monotonic() - began
        assert status == 200 and json.loads(answer)["length"] == SIZE
    floor = SIZE / (RATE_MBIT * 125_000) * 0.8  # the bucket's burst lets a little through early
    assert down >= floor and up >= floor, (down, up)
