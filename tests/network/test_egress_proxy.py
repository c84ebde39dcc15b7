"""The egress proxy end to end: real slots, real nft redirects, real servers in an "internet"
namespace, clients inside the slot namespaces (tests/network/lab.py). Needs root; run it under
scripts/isolated.sh."""

from __future__ import annotations

import json
import os
import socket
import ssl
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.network.lab import (
    INET_HOST,
    INET_SERVER,
    INET_SOCKS,
    OTHER_PORT,
    Lab,
    blob,
    http_get,
    identity,
    socket_in,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)")

ALLOWED, DENIED = "example-allowed.test", "example-denied.test"
ONLY_ALLOWED = {"denyOut": ["0.0.0.0/0"], "allowOut": [ALLOWED]}
ONLY_DENIED_NAME = {"denyOut": ["0.0.0.0/0"], "allowOut": [DENIED]}
METRICS_PORT = 15002
MAX_PER_SLOT = 40
MAX_METADATA = 16  # the default


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    tmp = tmp_path_factory.mktemp("egress")
    args = ("--metrics-port", str(METRICS_PORT), "--max-per-slot", str(MAX_PER_SLOT),
            "--log-burst", "100000")  # the tests read the refusals' lines: every one written
    with Lab(tmp, slots=3, proxy_args=args) as lab:
        yield lab


def assert_reset(action: Callable[[], Any]) -> None:
    """`action` fails with a connection reset (not a timeout, not an answer)."""
    with pytest.raises((ConnectionResetError, ConnectionError, ssl.SSLError)) as info:
        action()
    assert not isinstance(info.value, TimeoutError)


def request_is_reset(lab: Lab, slot: Any, address: str, port: int, host: str = ALLOWED) -> None:
    """A connection the proxy resets before the client sends anything (decided by address, or
    no upstream): the reset may already meet the client's connect()."""

    def attempt() -> None:
        with lab.connect(slot, address, port) as sock:
            http_get(sock, host, "/")

    assert_reset(attempt)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def counters(lab: Lab) -> dict[str, Any]:
    answer = lab.control("ping")
    assert answer["ok"]
    return answer


def denied_reasons(lab: Lab) -> list[str]:
    return [line["reason"] for line in lab.proxy_log() if line.get("event") == "denied"]


def test_allowed_name_passes_bytes_unchanged(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, ONLY_ALLOWED)
    size = 8 << 20
    with lab.tls(slot, ALLOWED) as tls:
        status, _, body = http_get(tls, ALLOWED, f"/blob?size={size}")
        assert status == 200 and body == blob(size)
        status, _, body = http_get(tls, ALLOWED, "/seen")  # the same connection, kept alive
        seen = json.loads(body)
        assert seen["sni"] == ALLOWED and seen["tls"]
    with lab.connect(slot, INET_SERVER, 80) as plain:
        status, _, body = http_get(plain, ALLOWED, f"/blob?size={size}")
        assert status == 200 and body == blob(size)
        status, _, body = http_get(plain, ALLOWED, "/seen", {"X-Test": "1"})
        # Plain HTTP without rules: the request head arrives exactly as sent.
        assert json.loads(body)["headers"] == [["Host", ALLOWED], ["X-Test", "1"]]


def test_other_name_on_the_same_address_is_reset(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, ONLY_ALLOWED)
    before = counters(lab)["denied"]
    assert_reset(lambda: lab.tls(slot, DENIED))
    with lab.connect(slot, INET_SERVER, 80) as plain:
        assert_reset(lambda: http_get(plain, DENIED, "/"))
    # No name at all (TLS by address): only addresses decide, and 0.0.0.0/0 is denied.
    assert_reset(lambda: lab.tls(slot, INET_SERVER))
    assert counters(lab)["denied"] == before + 3
    assert f"policy: address in denyOut (name {DENIED} not in allowOut)" in denied_reasons(lab)


def test_keepalive_request_for_another_host_is_reset(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, ONLY_ALLOWED)
    with lab.connect(slot, INET_SERVER, 80) as plain:
        assert http_get(plain, ALLOWED, "/one")[0] == 200
        assert_reset(lambda: http_get(plain, DENIED, "/two"))


def test_update_flips_both_ways_and_cuts_live_connections(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, ONLY_ALLOWED)
    live = lab.tls(slot, ALLOWED)
    kept = lab.tls(slot, ALLOWED)
    try:
        assert http_get(live, ALLOWED, "/a")[0] == 200
        assert http_get(kept, ALLOWED, "/a")[0] == 200
        # An update that still allows it leaves it alone (the test can tell a cut from no cut).
        lab.set_policy(slot, {"denyOut": ["0.0.0.0/0"], "allowOut": [ALLOWED, "other.test"]})
        assert http_get(kept, ALLOWED, "/b")[0] == 200
        cut_before = counters(lab)["cut_by_update"]
        lab.set_policy(slot, ONLY_DENIED_NAME)
        assert counters(lab)["cut_by_update"] == cut_before + 2
        assert_reset(lambda: http_get(live, ALLOWED, "/c"))
        assert_reset(lambda: lab.tls(slot, ALLOWED))
        with lab.tls(slot, DENIED) as tls:
            assert json.loads(http_get(tls, DENIED, "/d")[2])["sni"] == DENIED
            lab.set_policy(slot, ONLY_ALLOWED)
            assert_reset(lambda: http_get(tls, DENIED, "/e"))
        with lab.tls(slot, ALLOWED) as tls:
            assert http_get(tls, ALLOWED, "/f")[0] == 200
    finally:
        live.close()
        kept.close()


def test_update_takes_effect_at_once(lab: Lab) -> None:
    slot = lab.slots[0]
    for _ in range(5):
        lab.set_policy(slot, ONLY_DENIED_NAME)
        assert_reset(lambda: lab.tls(slot, ALLOWED))
        lab.set_policy(slot, ONLY_ALLOWED)
        lab.tls(slot, ALLOWED).close()


def test_metadata_answers_each_slot_its_own_identity(lab: Lab) -> None:
    first, second = lab.slots[0], lab.slots[1]
    lab.set_policy(first, ONLY_ALLOWED)
    lab.set_policy(second, {})  # the default policy: no redirect but the metadata one
    for slot in (first, second):
        expected = identity(slot.index)
        with lab.connect(slot, "169.254.169.254", 80) as sock:
            status, headers, body = http_get(sock, "169.254.169.254", "/v1/identity")
            assert status == 200 and headers["content-type"] == "application/json"
            assert json.loads(body) == {
                "sandboxId": expected.sandbox_id, "templateId": expected.template_id,
                "snapshotId": expected.snapshot_id,
                "envdAccessTokenSha256": expected.envd_token_sha256,
                "instanceToken": expected.instance_token}
            assert json.loads(http_get(sock, "169.254.169.254", "/")[2]) == json.loads(body)
            status, _, text = http_get(sock, "169.254.169.254", "/v1/identity/sandboxId")
            assert (status, text) == (200, expected.sandbox_id.encode())
            assert http_get(sock, "169.254.169.254", "/v1/identity/nope")[0] == 404
            assert http_get(sock, "169.254.169.254", "/latest/meta-data")[0] == 404
    # Another sandbox in the slot (a restore, a pooled slot reused): the next request sees
    # its identity, and what the previous one had open is cut.
    live = lab.connect(second, "169.254.169.254", 80)
    try:
        assert (http_get(live, "169.254.169.254", "/v1/identity/sandboxId")[2]
                == identity(second.index).sandbox_id.encode())
        lab.set_policy(second, {}, n=7)
        assert_reset(lambda: http_get(live, "169.254.169.254", "/"))
    finally:
        live.close()
    with lab.connect(second, "169.254.169.254", 80) as sock:
        assert http_get(sock, "169.254.169.254", "/v1/identity/sandboxId")[2] == b"sbx-7"


def test_unknown_source_and_removed_slot_are_reset(lab: Lab) -> None:
    slot = lab.slots[2]
    request_is_reset(lab, slot, "169.254.169.254", 80, "169.254.169.254")
    lab.set_policy(slot, {})
    meta = lab.connect(slot, "169.254.169.254", 80)
    lab.set_policy(slot, ONLY_ALLOWED)
    tls = lab.tls(slot, ALLOWED)
    try:
        assert http_get(meta, "169.254.169.254", "/")[0] == 200
        assert http_get(tls, ALLOWED, "/")[0] == 200
        assert lab.control("remove", source=slot.guest_address) == {"ok": True, "cut": 2}
        assert_reset(lambda: http_get(meta, "169.254.169.254", "/"))
        assert_reset(lambda: http_get(tls, ALLOWED, "/"))
    finally:
        meta.close()
        tls.close()
    assert lab.control("remove", source=slot.guest_address) == {"ok": True, "cut": 0}


def test_header_rules_on_plain_http_and_tls_untouched(lab: Lab) -> None:
    """`http://` rules set headers on every plain-HTTP request; TLS to the same host is decided
    by the policy and spliced unchanged (a rule covering HTTPS is refused by the policy)."""
    slot = lab.slots[0]
    lab.set_policy(slot, {**ONLY_ALLOWED, "rules": {f"http://{ALLOWED}": [
        {"transform": {"headers": {"Authorization": "Bearer lab", "X-Injected": "yes"}}}]}})
    with lab.connect(slot, INET_SERVER, 80) as plain:
        for path in ("/1", "/2"):  # every request on a kept-alive connection
            seen = json.loads(http_get(plain, ALLOWED, path, {"authorization": "mine"})[2])
            assert seen["headers"] == [["Host", ALLOWED], ["Authorization", "Bearer lab"],
                                       ["X-Injected", "yes"]]
    with lab.tls(slot, ALLOWED) as tls:
        seen = json.loads(http_get(tls, ALLOWED, "/", {"authorization": "mine"})[2])
        assert seen["headers"] == [["Host", ALLOWED], ["authorization", "mine"]]
    assert_reset(lambda: lab.tls(slot, DENIED))


def test_other_ports_are_decided_by_address_only(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, {"denyOut": ["0.0.0.0/0"], "allowOut": [ALLOWED, "198.18.0.2"]},
                   mode="all")
    with lab.connect(slot, INET_SERVER, OTHER_PORT) as sock:  # by address: allowed
        assert http_get(sock, ALLOWED, "/")[0] == 200
    lab.set_policy(slot, ONLY_ALLOWED, mode="all")
    # A name opens 80/443 only; the Host header on another port is not even read.
    request_is_reset(lab, slot, INET_SERVER, OTHER_PORT)


def test_walls_hold_whatever_the_policy(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.set_policy(slot, {}, mode="all")
    with lab.connect(slot, INET_SERVER, OTHER_PORT) as sock:  # a control: the policy allows all
        assert http_get(sock, ALLOWED, "/")[0] == 200
    for address, port in ((INET_HOST, 22), (INET_HOST, METRICS_PORT), (slot.host_address, 80)):
        request_is_reset(lab, slot, address, port)
    assert "destination behind the walls" in denied_reasons(lab)
    lab.set_policy(slot, {})


def test_socks5_egress_proxy_and_fail_closed(lab: Lab) -> None:
    slot = lab.slots[0]
    socks = lab.start_socks()
    proxy = {"address": f"{INET_SOCKS}:1080", "username": "lab", "password": "secret"}
    lab.set_policy(slot, {"egressProxy": proxy})
    with lab.connect(slot, INET_SERVER, OTHER_PORT) as sock:
        assert json.loads(http_get(sock, ALLOWED, "/")[2])["client"] == INET_SOCKS
    with lab.connect(slot, INET_SERVER, 80) as sock:
        assert http_get(sock, ALLOWED, "/blob?size=1048576")[2] == blob(1 << 20)
    with lab.tls(slot, ALLOWED) as tls:
        assert json.loads(http_get(tls, ALLOWED, "/")[2])["client"] == INET_SOCKS
    # Names are still decided before the tunnel.
    lab.set_policy(slot, {**ONLY_ALLOWED, "egressProxy": proxy})
    assert_reset(lambda: lab.tls(slot, DENIED))
    # A live tunnelled connection is cut when the proxy setting changes.
    lab.set_policy(slot, {"egressProxy": proxy})
    live = lab.connect(slot, INET_SERVER, OTHER_PORT)
    try:
        assert json.loads(http_get(live, ALLOWED, "/")[2])["client"] == INET_SOCKS
        lab.set_policy(slot, {"allowOut": ["198.18.0.2"]}, mode="all")
        assert_reset(lambda: http_get(live, ALLOWED, "/"))
    finally:
        live.close()
    failed = counters(lab)["upstream_failed"]
    lab.set_policy(slot, {"egressProxy": {**proxy, "password": "wrong"}})
    request_is_reset(lab, slot, INET_SERVER, OTHER_PORT)
    lab.stop_process(socks)
    lab.set_policy(slot, {"egressProxy": proxy})
    request_is_reset(lab, slot, INET_SERVER, OTHER_PORT)  # no tunnel: no connection at all
    assert counters(lab)["upstream_failed"] == failed + 2
    lab.set_policy(slot, {})


def test_socks5_over_tls(lab: Lab) -> None:
    slot = lab.slots[0]
    assert lab.certs is not None
    socks = lab.start_socks()
    front = lab.start_tls_front(1443)
    try:
        proxy = {"address": f"{INET_SOCKS}:1443", "username": "lab", "password": "secret",
                 "tls": {"serverName": "socks.test", "caCert": lab.certs.ca.read_text()}}
        lab.set_policy(slot, {"egressProxy": proxy})
        with lab.connect(slot, INET_SERVER, 80) as sock:
            assert json.loads(http_get(sock, ALLOWED, "/")[2])["client"] == INET_SOCKS
            assert http_get(sock, ALLOWED, "/blob?size=3000000")[2] == blob(3_000_000)
        with lab.tls(slot, ALLOWED) as tls:  # TLS inside TLS: the guest's own, untouched
            assert json.loads(http_get(tls, ALLOWED, "/")[2])["sni"] == ALLOWED
        # Each request head is still decided on this path.
        lab.set_policy(slot, {**ONLY_ALLOWED, "egressProxy": proxy})
        with lab.connect(slot, INET_SERVER, 80) as sock:
            assert http_get(sock, ALLOWED, "/one")[0] == 200
            assert_reset(lambda: http_get(sock, DENIED, "/two"))
        # A proxy whose certificate does not verify is no proxy: fail closed.
        lab.set_policy(slot, {"egressProxy": {**proxy, "tls": {"serverName": "other.test",
                                                                "caCert": lab.certs.ca.read_text()}}})
        request_is_reset(lab, slot, INET_SERVER, OTHER_PORT)
    finally:
        front.close()
        lab.stop_process(socks)
        lab.set_policy(slot, {})


def test_metadata_connection_cap_per_slot(lab: Lab) -> None:
    """The metadata service has a cap of its own per slot (egress connections do not count)."""
    slot = lab.slots[1]
    lab.set_policy(slot, {})
    wait_for(lambda: counters(lab)["metadata_connections"] == 0)  # earlier tests' are gone
    socks = [lab.connect(slot, "169.254.169.254", 80) for _ in range(MAX_METADATA)]
    try:
        wait_for(lambda: counters(lab)["metadata_connections"] == MAX_METADATA)
        request_is_reset(lab, slot, "169.254.169.254", 80, "169.254.169.254")
        assert http_get(socks[0], "169.254.169.254", "/")[0] == 200
    finally:
        for sock in socks:
            sock.close()


def test_control_protocol_errors_name_the_problem(lab: Lab) -> None:
    assert lab.control("nope") == {"ok": False, "error": "unknown op 'nope' (ping, set, remove, sync)"}
    bad = lab.control("set", slot={"source": "10.12.0.99", "identity": {
        "sandbox_id": "x", "template_id": "t", "snapshot_id": None, "envd_token_sha256": None,
        "instance_token": "i"}, "policy": {"allowOut": ["10.0.0.0/33"]}})
    assert not bad["ok"] and "10.0.0.0/33" in bad["error"]
    bad = lab.control("set", slot={"source": "not-an-ip", "identity": {}})
    assert not bad["ok"] and "not-an-ip" in bad["error"]
    assert not lab.control("sync", slots="x")["ok"]
    assert counters(lab)["slots"] >= 1


def test_metrics(lab: Lab) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'aenv_egress_connections_total{verdict="denied"}' in text
    assert "aenv_egress_slots " in text and "aenv_egress_rss_bytes " in text


def test_restart_and_sync(lab: Lab) -> None:
    slot = lab.slots[0]
    lab.stop_proxy()
    assert not (lab.tmp / "egress.sock").exists()
    first = lab.start_proxy()
    assert first["slots"] == 0
    request_is_reset(lab, slot, "169.254.169.254", 80, "169.254.169.254")
    from agentenv.network.control import SlotEntry
    from agentenv.network.policy import EgressPolicy
    entries = [SlotEntry(s.guest_address, identity(s.index), EgressPolicy.from_wire(ONLY_ALLOWED))
               for s in lab.slots[:2]]
    client = lab.client()
    lab.loop.run_until_complete(client.sync(entries))
    lab.loop.run_until_complete(client.close())
    lab.redirect(slot, "web")
    assert counters(lab)["slots"] == 2
    with lab.tls(slot, ALLOWED) as tls:
        assert http_get(tls, ALLOWED, "/")[0] == 200
    assert_reset(lambda: lab.tls(slot, DENIED))


def test_proxy_log_is_json_lines(lab: Lab) -> None:
    lines = lab.proxy_log()
    assert lines and all("event" in line or "msg" in line for line in lines)
    assert not [line for line in lines if line.get("event") == "crash"]


def test_name_filtering_keeps_only_the_direct_flows_it_allows(lab: Lab) -> None:
    """The runtime's own path (NetworkSlot.set_policy, the host table's forward chain): a
    direct TCP 80 flow opened under the default policy survives an update to a name-filtering
    policy that allows its address, and is reset by one that allows only a name (the kernel
    cannot know its name); new connections then go through the proxy."""
    from agentenv.network.policy import EgressPolicy

    slot = lab.slots[2]
    by_address = {"allowOut": [INET_SERVER, ALLOWED], "denyOut": ["0.0.0.0/0"]}

    def apply(network: dict[str, Any]) -> None:
        lab.set_policy(slot, network, mode="none")  # the proxy's table only
        lab.loop.run_until_complete(slot.set_policy(EgressPolicy.from_wire(network)))

    apply({})  # whatever earlier tests left on this slot
    try:
        with lab.connect(slot, INET_SERVER, 80) as direct:
            assert http_get(direct, ALLOWED, "/")[0] == 200  # default policy: not redirected
            apply(by_address)
            assert slot.policy.proxied_ports == "web"
            for path in ("/1", "/2"):  # still the direct flow, kept
                assert http_get(direct, ALLOWED, path)[0] == 200
            apply(ONLY_ALLOWED)
            assert_reset(lambda: http_get(direct, ALLOWED, "/3"))
        with lab.connect(slot, INET_SERVER, 80) as proxied:
            assert http_get(proxied, ALLOWED, "/")[0] == 200
        request_is_reset(lab, slot, INET_SERVER, 80, DENIED)
    finally:
        apply({})


def test_the_proxy_port_takes_only_redirected_guest_flows(lab: Lab) -> None:
    """Found by the red team (finding 6): the proxy listens on every address (a redirect goes
    to the receiving slot interface's), so anyone on the node's network, or a process of the
    node, reached it directly. The host table refuses what no redirect sent to its port."""
    for where, target in ((None, "127.0.0.1"), (lab.inet, INET_HOST)):
        sock = socket_in(where) if where else socket.socket()
        sock.settimeout(5)
        try:
            with pytest.raises(ConnectionRefusedError):
                sock.connect((target, lab.port))
        finally:
            sock.close()
    # a guest's redirected flows still arrive
    lab.set_policy(lab.slots[0], {})
    with lab.connect(lab.slots[0], "169.254.169.254", 80) as sock:
        assert http_get(sock, "169.254.169.254", "/")[0] == 200
