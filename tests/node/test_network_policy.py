"""Egress policies through the official e2b SDK on the VM backend (real QEMU guests): address
rules in the kernel, walls around the host and the other sandboxes, updates of live sandboxes,
and a policy that holds across pause/connect, fork and a node crash. The "internet" is
tests/netlab.py: two test hosts in a namespace this module makes (198.18.41.0/24)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.netlab import ALLOWED_NAME, DENIED_NAME, DNS_NAME, Internet, internet

from . import conftest
from .conftest import NodeProcess

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

NET_PREFIX = "anw"  # unique: a test teardown deletes every {NET_PREFIX}-s* namespace
FIRST_SLOT = 28001  # 28001-28400: disjoint from the other VM test modules and benches
LAB_PREFIX, LAB_SUBNET = "anwl", 41


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Internet]:
    with internet(LAB_PREFIX, LAB_SUBNET, tmp_path_factory.mktemp("lab")) as net:
        yield net


@pytest.fixture(scope="module")
def vm_node(tmp_path_factory: pytest.TempPathFactory, lab: Internet) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("netnode")
    # One parked VM: creates are pool handovers, which must get the create's policy.
    # The guests' resolver is the lab's DNS server (the default, 8.8.8.8, is out of reach).
    node = conftest.vm_node_process(base / "state", base / "node.log", NET_PREFIX, FIRST_SLOT,
                                    {"AENV_VM_POOL_LOW": "1", "AENV_VM_POOL_HIGH": "1",
                                     "AENV_GUEST_DNS": lab.host_b,
                                     # The egress proxy binds names with the same server.
                                     "AENV_EGRESS_NAME_SERVER": lab.host_b})
    with conftest.serving_vm_node(node, NET_PREFIX):
        yield node


def run(sbx: Any, command: str, user: str = "user") -> str:
    return str(sbx.commands.run(command, user=user, timeout=120).stdout)


def fetch(sbx: Any, url: str) -> tuple[int, str]:
    """curl from inside the guest: (curl's exit code, body)."""
    out = run(sbx, f"curl -sk -m 8 {url}; rc=$?; echo; echo EXIT=$rc")
    body, _, code = out.rstrip().rpartition("EXIT=")
    return int(code), body.strip()


def reaches(sbx: Any, url: str) -> bool:
    code, body = fetch(sbx, url)
    assert code in (0, 7, 28, 35, 56), f"unexpected curl exit {code} for {url}: {body}"
    return code == 0


def new_sandbox(lab: Internet, **kwargs: Any) -> Any:
    from e2b import Sandbox

    sbx = Sandbox.create(template="base", timeout=600, **kwargs)
    run(sbx, f"printf '{lab.hosts_lines()}' >> /etc/hosts", user="root")
    return sbx


def slot_address(node: NodeProcess, sandbox_id: str) -> str:
    """The other sandbox's address as the host (and a guest) would name it."""
    manifest = json.loads(
        (node.state_dir / "vm-backend" / "sandboxes" / f"{sandbox_id}.vm.json").read_text())
    return str(ipaddress.IPv4Address("10.12.0.0") + 2 * int(manifest["slot"]["index"]) + 1)


def test_default_reaches_both_hosts_and_deny_out_blocks_one(vm_node: NodeProcess,
                                                            lab: Internet) -> None:
    from e2b import Sandbox

    free = new_sandbox(lab)
    denied = new_sandbox(lab, network={"deny_out": [lab.host_a]})
    try:
        assert reaches(free, lab.url(lab.host_a)) and reaches(free, lab.url(lab.host_b))
        code, body = fetch(free, f"https://{ALLOWED_NAME}/")
        assert code == 0 and f"sni={ALLOWED_NAME}" in body
        code, body = fetch(free, f"https://{DENIED_NAME}/")
        assert code == 0 and f"sni={DENIED_NAME}" in body

        assert not reaches(denied, lab.url(lab.host_a))
        assert not reaches(denied, f"https://{ALLOWED_NAME}/")  # host A by name
        assert reaches(denied, lab.url(lab.host_b))
        # A denied TCP connection is reset (curl 7: refused), not left to time out (28).
        code, _ = fetch(denied, lab.url(lab.host_a))
        assert code == 7
        info = Sandbox.get_info(denied.sandbox_id)
        assert info.network == {"deny_out": [lab.host_a]}
    finally:
        free.kill()
        denied.kill()


def test_guest_resolver_and_the_dns_servers_a_policy_opens(vm_node: NodeProcess,
                                                            lab: Internet) -> None:
    """Guests resolve through the node's guest resolver (AENV_GUEST_DNS; 8.8.8.8 by default,
    as on E2B), whatever resolv.conf the image has; with only names allowed, a resolver is
    reachable only when the policy's `dnsServers` (default: 8.8.8.8) names it."""
    free = new_sandbox(lab)
    names_only = new_sandbox(lab, network={"allow_out": [ALLOWED_NAME],
                                           "deny_out": ["0.0.0.0/0"]})
    names_and_dns = new_sandbox(lab, network={"allow_out": [ALLOWED_NAME],
                                              "deny_out": ["0.0.0.0/0"],
                                              "dns_servers": [lab.host_b]})
    lookup = f"getent hosts {DNS_NAME}; echo EXIT=$?"
    try:
        assert run(free, "cat /etc/resolv.conf").split() == ["nameserver", lab.host_b]
        assert run(free, lookup).split()[:2] == [lab.host_a, DNS_NAME]
        assert "EXIT=0" not in run(names_only, f"timeout 20 {lookup}")
        assert run(names_and_dns, lookup).split()[:2] == [lab.host_a, DNS_NAME]
    finally:
        for sbx in (free, names_only, names_and_dns):
            sbx.kill()


def test_allow_internet_access_false_and_allow_beats_deny(vm_node: NodeProcess,
                                                          lab: Internet) -> None:
    off = new_sandbox(lab, allow_internet_access=False)
    only_b = new_sandbox(lab, network={"allow_out": [lab.host_b], "deny_out": ["0.0.0.0/0"]})
    try:
        assert not reaches(off, lab.url(lab.host_a)) and not reaches(off, lab.url(lab.host_b))
        assert reaches(only_b, lab.url(lab.host_b))
        assert not reaches(only_b, lab.url(lab.host_a))
    finally:
        off.kill()
        only_b.kill()


def test_update_network_flips_a_live_sandbox_and_cuts_established(vm_node: NodeProcess,
                                                                  lab: Internet) -> None:
    from e2b import Sandbox

    sbx = new_sandbox(lab)
    try:
        assert reaches(sbx, lab.url(lab.host_a))
        # A slow download that is still running when the policy changes.
        # Paced by the server, not by curl: a client-side rate limit lets the guest's socket
        # buffer megabytes that curl still reads for many seconds after the cut.
        sbx.commands.run(f"curl -s -o /tmp/big {lab.url(lab.host_a, '/slow')}"
                         "; echo $? > /tmp/cut.rc", background=True)
        deadline = time.monotonic() + 60
        while int(run(sbx, "stat -c %s /tmp/big 2>/dev/null || echo 0").strip() or 0) < 100_000:
            assert time.monotonic() < deadline, "the background download did not start"
            time.sleep(0.5)

        t0 = time.perf_counter()
        sbx.update_network({"deny_out": [lab.host_a]})
        update_s = time.perf_counter() - t0
        assert not reaches(sbx, lab.url(lab.host_a))
        assert reaches(sbx, lab.url(lab.host_b))
        # The established download is cut (curl: 56, receive failure / reset).
        deadline = time.monotonic() + 30
        while not run(sbx, "cat /tmp/cut.rc 2>/dev/null || true").strip():
            assert time.monotonic() < deadline, "the established download was not cut"
            time.sleep(0.5)
        assert run(sbx, "cat /tmp/cut.rc").strip() not in ("", "0")
        assert Sandbox.get_info(sbx.sandbox_id).network == {"deny_out": [lab.host_a]}

        # An update replaces the whole policy: omitted fields are cleared.
        sbx.update_network({})
        assert reaches(sbx, lab.url(lab.host_a))
        assert Sandbox.get_info(sbx.sandbox_id).network in (None, {})
        sbx.update_network({"allow_internet_access": False})
        assert not reaches(sbx, lab.url(lab.host_b))
        sbx.update_network({"allow_out": [lab.host_b], "allow_internet_access": False})
        assert reaches(sbx, lab.url(lab.host_b)) and not reaches(sbx, lab.url(lab.host_a))
        print(f"\nupdate_network round trip: {update_s * 1e3:.1f} ms")
    finally:
        sbx.kill()


def test_policy_holds_across_pause_fork_and_node_crash(vm_node: NodeProcess,
                                                       lab: Internet) -> None:
    from e2b import Sandbox

    sbx = new_sandbox(lab, network={"deny_out": [lab.host_a]})
    children: list[Any] = []
    try:
        sbx.pause()
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert not reaches(sbx, lab.url(lab.host_a)) and reaches(sbx, lab.url(lab.host_b))

        children = list(sbx.fork(count=1, timeout=600))
        assert all(isinstance(c, Sandbox) for c in children), children
        for child in children:
            assert not reaches(child, lab.url(lab.host_a))
            assert reaches(child, lab.url(lab.host_b))
            assert Sandbox.get_info(child.sandbox_id).network == {"deny_out": [lab.host_a]}

        # A snapshot's sandbox gets its own create's policy, not the source's.
        snap = sbx.create_snapshot()
        fresh = Sandbox.create(snap.snapshot_id, timeout=600)
        children.append(fresh)
        assert reaches(fresh, lab.url(lab.host_a))

        # A name-filtered sandbox with a download through the egress proxy under way: the
        # restarted node adopts the proxy (same process), and the flow goes on. The lab's
        # server holds the download's second half until the test releases it, after the
        # restart: the crash and the restart happen while it runs, however long they take.
        named = new_sandbox(lab, network={"allow_out": [ALLOWED_NAME],
                                          "deny_out": ["0.0.0.0/0"]})
        children.append(named)
        size = 4_000_000
        named.commands.run(f"curl -s -o /tmp/live http://{ALLOWED_NAME}/held/{size}/live"
                           "; echo $? > /tmp/live.rc", background=True)
        deadline = time.monotonic() + 60
        while int(run(named, "stat -c %s /tmp/live 2>/dev/null || echo 0").strip() or 0) < 100_000:
            assert time.monotonic() < deadline, "the download through the proxy did not start"
            time.sleep(0.5)
        proxy = egress_pids(vm_node)
        assert len(proxy) == 1, proxy

        vm_node.kill9()
        vm_node.start()  # adopts the running VMs and applies their policies again
        assert egress_pids(vm_node) == proxy  # adopted, not a second one
        assert not reaches(sbx, lab.url(lab.host_a)) and reaches(sbx, lab.url(lab.host_b))
        sbx.update_network({})
        assert reaches(sbx, lab.url(lab.host_a))
        assert not run(named, "cat /tmp/live.rc 2>/dev/null || true").strip(), (
            "the held download ended before its release")
        lab.release("live")
        deadline = time.monotonic() + 180
        while not run(named, "cat /tmp/live.rc 2>/dev/null || true").strip():
            assert time.monotonic() < deadline, "the download through the proxy did not end"
            time.sleep(1)
        assert run(named, "cat /tmp/live.rc; stat -c %s /tmp/live").split() == ["0", str(size)]
        assert fetch(named, f"https://{ALLOWED_NAME}/")[0] == 0
        assert fetch(named, f"https://{DENIED_NAME}/")[0] in (35, 56, 7)
    finally:
        for other in [sbx, *children]:
            with contextlib.suppress(Exception):
                other.kill()


@contextlib.contextmanager
def host_listener() -> Iterator[int]:
    """A TCP service on the host bound to 0.0.0.0 (what guests must not reach)."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen(16)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nyes")
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        thread.join(5)
        server.close()


def test_walls_host_and_other_sandboxes(vm_node: NodeProcess, lab: Internet) -> None:
    a = new_sandbox(lab)
    b = new_sandbox(lab)
    try:
        with host_listener() as port:
            # The host itself answers (the listener works) ...
            assert httpx.get(f"http://{lab.gateway}:{port}/", timeout=5).text == "yes"
            slot_a = slot_address(vm_node, a.sandbox_id)
            host_a = str(ipaddress.IPv4Address(slot_a) - 1)
            # ... but not to a guest: not on the lab link, not on the slot's own veth.
            assert not reaches(a, f"http://{lab.gateway}:{port}/")
            assert not reaches(a, f"http://{host_a}:{port}/")
            assert not reaches(a, f"http://{host_a}:{vm_node.port}/health")
            assert not reaches(a, f"http://{lab.gateway}:{vm_node.port}/health")
        # Another sandbox: not its envd, not any port of it.
        slot_b = slot_address(vm_node, b.sandbox_id)
        assert not reaches(a, f"http://{slot_b}:49983/health")
        # Private ranges are walls even when the policy allows them.
        a.update_network({"allow_out": ["10.0.0.0/8", "192.168.0.0/16"]})
        assert not reaches(a, f"http://{slot_b}:49983/health")
        assert reaches(a, lab.url(lab.host_a))
    finally:
        a.kill()
        b.kill()


def test_bad_policies_get_400_naming_the_entry(vm_node: NodeProcess, lab: Internet) -> None:
    from e2b import Sandbox

    for network, named in (({"deny_out": ["10.0.0.0/33"]}, "10.0.0.0/33"),
                           ({"allow_out": ["https://example.com/x"]}, "https://example.com/x"),
                           ({"deny_out": ["2001:db8::/32"]}, "IPv6"),
                           ({"allow_out": ["a.test"], "dns_servers": ["not-an-ip"]}, "not-an-ip")):
        with pytest.raises(Exception) as caught:
            Sandbox.create(template="base", timeout=60, network=network)
        assert named in str(caught.value), caught.value
    sbx = new_sandbox(lab, network={"deny_out": [lab.host_a]})
    try:
        with httpx.Client(base_url=vm_node.url, headers={"X-API-KEY": vm_node.api_key},
                          timeout=30, trust_env=False) as api:
            answer = api.put(f"/sandboxes/{sbx.sandbox_id}/network",
                             json={"denyOut": [lab.host_b, "300.1.2.3"]})
            assert answer.status_code == 400 and "300.1.2.3" in answer.json()["message"]
            many = [f"198.19.{i // 256}.{i % 256}" for i in range(1001)]
            answer = api.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"denyOut": many})
            assert answer.status_code == 400 and "1000" in answer.json()["message"]
        # Nothing of the bad updates was applied or recorded.
        assert Sandbox.get_info(sbx.sandbox_id).network == {"deny_out": [lab.host_a]}
        assert not reaches(sbx, lab.url(lab.host_a)) and reaches(sbx, lab.url(lab.host_b))
    finally:
        sbx.kill()


def metadata(sbx: Any) -> dict[str, Any]:
    out = run(sbx, "curl -s -m 8 http://169.254.169.254/")
    return dict(json.loads(out))


def test_only_a_named_host_and_the_metadata_service(vm_node: NodeProcess, lab: Internet) -> None:
    """Names are decided by the egress proxy (TLS SNI / HTTP Host) on the same IP; every
    sandbox's metadata service answers its own identity; fork children their own."""
    import hashlib

    from e2b import Sandbox

    only = new_sandbox(lab, network={"allow_out": [ALLOWED_NAME], "deny_out": ["0.0.0.0/0"]})
    other = new_sandbox(lab)
    children: list[Any] = []
    try:
        code, body = fetch(only, f"https://{ALLOWED_NAME}/")
        assert code == 0 and f"sni={ALLOWED_NAME}" in body
        code, _ = fetch(only, f"http://{ALLOWED_NAME}/")
        assert code == 0
        # Same IP, other name: reset (curl 35/56/7), not left to time out (28).
        code, _ = fetch(only, f"https://{DENIED_NAME}/")
        assert code in (35, 56, 7), code
        assert not reaches(only, lab.url(lab.host_b))  # addresses: denied by 0.0.0.0/0
        assert not reaches(only, f"http://{lab.host_a}/")  # no name: the address decides

        mine, theirs = metadata(only), metadata(other)
        assert mine["sandboxId"] == only.sandbox_id and theirs["sandboxId"] == other.sandbox_id
        assert mine["templateId"] == "base" and mine["snapshotId"] is None
        with httpx.Client(base_url=vm_node.url, headers={"X-API-KEY": vm_node.api_key},
                          timeout=30, trust_env=False) as api:
            token = api.get(f"/sandboxes/{only.sandbox_id}").json()["envdAccessToken"]
        assert mine["envdAccessTokenSha256"] == hashlib.sha256(token.encode()).hexdigest()
        assert mine["instanceToken"] and mine["instanceToken"] != theirs["instanceToken"]
        assert other.sandbox_id not in json.dumps(mine)

        # An update flips names both ways on a live sandbox.
        only.update_network({"allow_out": [DENIED_NAME], "deny_out": ["0.0.0.0/0"]})
        assert fetch(only, f"https://{DENIED_NAME}/")[0] == 0
        assert fetch(only, f"https://{ALLOWED_NAME}/")[0] != 0

        children = [c for c in only.fork(count=2, timeout=600) if isinstance(c, Sandbox)]
        assert len(children) == 2
        ids = {metadata(c)["sandboxId"] for c in children}
        assert ids == {c.sandbox_id for c in children}
        for child in children:  # inherited the parent's (updated) policy
            assert fetch(child, f"https://{DENIED_NAME}/")[0] == 0
            assert fetch(child, f"https://{ALLOWED_NAME}/")[0] != 0
    finally:
        for sbx in [only, other, *children]:
            with contextlib.suppress(Exception):
                sbx.kill()


def egress_pids(node: NodeProcess) -> list[int]:
    """The node's egress proxy processes (by their control socket's path)."""
    import os

    needle = str(node.state_dir / "vm-backend" / "egress").encode()
    pids = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
    return sorted(pids)


def test_egress_proxy_is_restarted_and_gets_the_table_again(vm_node: NodeProcess,
                                                            lab: Internet) -> None:
    import os
    import signal

    sbx = new_sandbox(lab, network={"allow_out": [ALLOWED_NAME], "deny_out": ["0.0.0.0/0"]})
    try:
        assert metadata(sbx)["sandboxId"] == sbx.sandbox_id
        pids = egress_pids(vm_node)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(Exception):
                if metadata(sbx)["sandboxId"] == sbx.sandbox_id:
                    break
            assert time.monotonic() < deadline, "the egress proxy did not come back"
            time.sleep(0.5)
        assert fetch(sbx, f"https://{ALLOWED_NAME}/")[0] == 0
        assert fetch(sbx, f"https://{DENIED_NAME}/")[0] != 0
    finally:
        sbx.kill()


def test_denying_a_name_cuts_its_established_direct_connection(vm_node: NodeProcess,
                                                               lab: Internet) -> None:
    """Before the update the sandbox's TCP 80 went out directly (no names to check); the
    kernel cannot know that connection's name, so once names are filtered it is reset, and
    new connections go through the proxy, which decides by name."""
    sbx = new_sandbox(lab)
    try:
        sbx.commands.run(f"curl -s -o /tmp/big http://{ALLOWED_NAME}/slow"
                         "; echo $? > /tmp/cut.rc", background=True)
        deadline = time.monotonic() + 60
        while int(run(sbx, "stat -c %s /tmp/big 2>/dev/null || echo 0").strip() or 0) < 100_000:
            assert time.monotonic() < deadline, "the background download did not start"
            time.sleep(0.5)
        sbx.update_network({"deny_out": [ALLOWED_NAME]})
        deadline = time.monotonic() + 30
        while not run(sbx, "cat /tmp/cut.rc 2>/dev/null || true").strip():
            assert time.monotonic() < deadline, "the established download was not cut"
            time.sleep(0.5)
        assert run(sbx, "cat /tmp/cut.rc").strip() not in ("", "0")
        assert fetch(sbx, f"http://{ALLOWED_NAME}/")[0] != 0
        code, body = fetch(sbx, f"http://{DENIED_NAME}/")  # same address, other name
        assert code == 0 and f"host={DENIED_NAME}" in body
        assert reaches(sbx, lab.url(lab.host_b, "/")) and reaches(sbx, "http://" + lab.host_a)
    finally:
        sbx.kill()


def test_egress_proxy_tunnels_tcp_and_fails_closed(vm_node: NodeProcess, lab: Internet) -> None:
    """`egress_proxy`: the sandbox's TCP leaves through the SOCKS5 server (the test host sees
    the SOCKS server's address), after the policy; without the server nothing goes direct."""
    with lab.socks5() as address:
        sbx = new_sandbox(lab, network={"egress_proxy": {"address": address},
                                        "deny_out": [lab.host_b + "/32"]})
        try:
            # Through the tunnel the test host sees a peer inside the lab (microsocks there),
            # never the host's masquerading gateway address.
            code, body = fetch(sbx, lab.url(lab.host_a))
            assert code == 0 and "peer=" in body and f"peer={lab.gateway}" not in body, body
            assert fetch(sbx, lab.url(lab.host_b))[0] != 0  # the policy comes first
        except BaseException:
            sbx.kill()
            raise
    try:
        assert fetch(sbx, lab.url(lab.host_a))[0] != 0  # fails closed
    finally:
        sbx.kill()
