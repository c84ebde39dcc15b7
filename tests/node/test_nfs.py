"""The node's NFSv4 server (node/nfs.py) with real parts: nfs-ganesha started by NfsServer on
loopback, and libnfs's userspace NFSv4 client (nfs-cp, nfs-cat, nfs-ls; the host kernel here
has no NFS client) as separate clients, each process its own NFSv4 client id and session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.node.nfs import NfsError, NfsExport, NfsServer, render_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _url(port: int, path: str) -> str:
    return f"nfs://127.0.0.1{path}?version=4&nfsport={port}"


def _nfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NfsServer]:
    for tool in ("ganesha.nfsd", "nfs-cp", "nfs-cat", "nfs-ls"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run scripts/install-system.sh")
    if os.geteuid() != 0:
        pytest.skip("ganesha's VFS FSAL needs root (open_by_handle_at)")
    srv = NfsServer(tmp_path / "nfs", bind_addr="127.0.0.1", port=_free_port())
    try:
        yield srv
    finally:
        srv.stop()


def _export(tmp_path: Path, export_id: int, name: str, clients: tuple[str, ...]) -> NfsExport:
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    os.chown(d, 4321, 4321)  # the volume directory's owner: every client acts as it
    return NfsExport(export_id, d, f"/volumes/{name}", clients, 4321, 4321)


def test_two_clients_see_each_others_writes(server: NfsServer, tmp_path: Path) -> None:
    vol = _export(tmp_path, 1, "shared", ("127.0.0.1",))
    server.start([vol])
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("written by client A\n")
    (src / "b").write_text("written by client B\n")

    assert _nfs("nfs-cp", str(src / "a"), _url(server.port, "/volumes/shared/a.txt")).returncode == 0
    read = _nfs("nfs-cat", _url(server.port, "/volumes/shared/a.txt"))
    assert read.returncode == 0 and read.stdout == "written by client A\n", read
    assert _nfs("nfs-cp", str(src / "b"), _url(server.port, "/volumes/shared/b.txt")).returncode == 0
    read = _nfs("nfs-cat", _url(server.port, "/volumes/shared/b.txt"))
    assert read.returncode == 0 and read.stdout == "written by client B\n", read
    # What the content API edits on the host: the same files, owned by the directory's owner.
    assert (vol.path / "a.txt").read_text() == "written by client A\n"
    assert os.stat(vol.path / "b.txt").st_uid == 4321
    (vol.path / "host.txt").write_text("from the host\n")
    listing = _nfs("nfs-ls", _url(server.port, "/volumes/shared"))
    assert {"a.txt", "b.txt", "host.txt"} <= {line.split()[-1] for line in listing.stdout.split("\n") if line}


def test_an_export_is_reached_only_by_its_clients(server: NfsServer, tmp_path: Path) -> None:
    mine = _export(tmp_path, 1, "mine", ("127.0.0.1",))
    other = _export(tmp_path, 2, "other", ("127.0.0.9",))
    server.start([mine, other])
    assert _nfs("nfs-ls", _url(server.port, "/volumes/mine")).returncode == 0
    denied = _nfs("nfs-ls", _url(server.port, "/volumes/other"))
    assert denied.returncode != 0 and "NFS4ERR_NOENT" in denied.stdout + denied.stderr, denied

    # The exports change in place (SIGHUP): the other volume gains this client, mine loses it.
    pid = server.pid
    server.update([NfsExport(1, mine.path, mine.pseudo, ("127.0.0.9",), 4321, 4321),
                   NfsExport(2, other.path, other.pseudo, ("127.0.0.9", "127.0.0.1"), 4321, 4321)])
    assert server.pid == pid and server.running()
    assert _nfs("nfs-ls", _url(server.port, "/volumes/other")).returncode == 0
    assert _nfs("nfs-ls", _url(server.port, "/volumes/mine")).returncode != 0

    # An export without clients is left out; an export added later appears.
    third = _export(tmp_path, 3, "third", ("127.0.0.1",))
    server.update([NfsExport(1, mine.path, mine.pseudo, (), 4321, 4321), third])
    assert _nfs("nfs-ls", _url(server.port, "/volumes/third")).returncode == 0
    assert _nfs("nfs-ls", _url(server.port, "/volumes/other")).returncode != 0


def test_stop_ends_the_server(server: NfsServer, tmp_path: Path) -> None:
    server.start([_export(tmp_path, 1, "v", ("127.0.0.1",))])
    pid = server.pid
    assert pid is not None
    server.stop()
    assert not server.running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


def test_render_refuses_what_would_break_the_config(tmp_path: Path) -> None:
    ok = NfsExport(1, tmp_path, "/volumes/v", ("10.12.0.3",), 1000, 1000)
    text = render_config([ok], bind_addr="0.0.0.0", port=2049, recovery_root=tmp_path / "r")
    assert "Protocols = 4;" in text and "Clients = 10.12.0.3;" in text
    assert "Squash = All_Squash;" in text and "Enable_UDP = false;" in text
    bad = [
        NfsExport(1, Path('/tmp/x"; } EXPORT { Path = /'), "/volumes/v", (), 1000, 1000),
        NfsExport(1, Path("relative"), "/volumes/v", (), 1000, 1000),
        NfsExport(1, tmp_path, "/volumes/v", ("0.0.0.0/0",), 1000, 1000),
        NfsExport(1, tmp_path, "/volumes/v", ("*",), 1000, 1000),
        NfsExport(1, tmp_path, "volumes", ("10.0.0.1",), 1000, 1000),
        NfsExport(0, tmp_path, "/volumes/v", ("10.0.0.1",), 1000, 1000),
        # every client would act as root on the exported file system
        NfsExport(1, tmp_path, "/volumes/v", ("10.0.0.1",), 0, 1000),
        NfsExport(1, tmp_path, "/volumes/v", ("10.0.0.1",), 1000, 0),
    ]
    for export in bad:
        with pytest.raises(NfsError):
            render_config([export], bind_addr="0.0.0.0", port=2049, recovery_root=tmp_path)
    with pytest.raises(NfsError):
        render_config([ok, NfsExport(1, tmp_path, "/volumes/w", ("10.0.0.1",), 1000, 1000)],
                      bind_addr="0.0.0.0", port=2049, recovery_root=tmp_path)
