"""The node's NFS port (node/nfs.py "Port"): none at all when the rw-shared mode is off (no
port walled or claimed on the host), and two nodes on one host never pick the same one: a port
another node claims (its claim under /run, while its state still keeps the port) or walls (its
host rules) is skipped."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from agentenv.node.nfs import PRIVILEGED_PORTS, node_nfs_port, stable_port, walled_ports


def test_no_port_when_the_mode_is_off(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    assert node_nfs_port(tmp_path / "a", shared_rw=False, configured=None, claims=claims) is None
    assert not (tmp_path / "a").exists() and not claims.exists()
    port = node_nfs_port(tmp_path / "a", shared_rw=True, configured=None, claims=claims)
    assert port is not None and port < PRIVILEGED_PORTS
    assert (claims / str(port)).is_file()


def test_two_nodes_never_share_a_port(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    a = stable_port(tmp_path / "a", claims=claims)
    b = stable_port(tmp_path / "b", claims=claims)
    assert a != b
    assert stable_port(tmp_path / "a", claims=claims) == a  # kept
    assert stable_port(tmp_path / "b", claims=claims) == b
    # a node whose kept port another node claimed meanwhile (a copied state directory) moves
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "port").write_text(f"{a}\n")
    c = stable_port(tmp_path / "c", claims=claims)
    assert c not in (a, b)
    # a claim whose node keeps another port now (or is gone) is stale: the port is free again
    shutil.rmtree(tmp_path / "b")
    assert stable_port(tmp_path / "d", claims=claims) == b


def test_a_walled_port_is_skipped(tmp_path: Path) -> None:
    if shutil.which("nft") is None:
        pytest.fail("nft is missing: run scripts/install-system.sh")
    first = stable_port(tmp_path / "probe", claims=tmp_path / "probe-claims")
    table = f"aenv_test_wall_{first}"
    # A chain without a hook is never evaluated: the rule walls nothing, but reads as a node's
    # wall of `first` (runtime/network.py host_ruleset) in the ruleset.
    script = (f"add table ip {table}\nadd chain ip {table} c\n"
              f"add rule ip {table} c tcp dport {first} ct status & dnat == 0 reject with tcp reset\n")
    subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True)
    try:
        assert first in walled_ports()
        assert stable_port(tmp_path / "other", claims=tmp_path / "claims") != first
    finally:
        subprocess.run(["nft", "delete", "table", "ip", table], check=False)
