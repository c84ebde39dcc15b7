"""The node's shared exports (node/nfs_exports.py) with real nfs-ganesha and our NFSv4.1 test
client on loopback (as tests/node/test_nfs.py): the server starts at the first attach, an
export's clients follow attach and detach, a dead server is started again with the same
exports, export ids stay a volume's for good, close stops the server."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest

from agentenv.node.nfs_exports import SharedExports, SharedVolume
from tests.node.nfs41 import Nfs4Error, Nfs41Client, unwalled_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="ganesha's VFS FSAL needs root (open_by_handle_at)")


def _ls(port: int, volume: str) -> list[str] | str:
    """The volume's listing as 127.0.0.1 sees it, or the NFS error's name."""
    try:
        with Nfs41Client("127.0.0.1", port) as client:
            return client.listdir(f"/volumes/{volume}")
    except Nfs4Error as exc:
        return exc.name


def _volume(tmp_path: Path, vid: str) -> SharedVolume:
    d = tmp_path / vid
    d.mkdir()
    os.chown(d, 4321, 4321)
    (d / f"{vid}.txt").write_text(vid)
    return SharedVolume(vid, d, 4321, 4321)


def test_exports_follow_the_sandboxes_and_the_server_is_supervised(tmp_path: Path) -> None:
    if shutil.which("ganesha.nfsd") is None:
        pytest.fail("ganesha.nfsd is missing: run scripts/install-system.sh")
    port = unwalled_port(tmp_path)
    v1, v2 = _volume(tmp_path, "v1"), _volume(tmp_path, "v2")

    async def scenario() -> None:
        exports = SharedExports(tmp_path / "nfs", port, whole_file_systems=False)
        try:
            await exports.attach("sbx-none", "127.0.0.5", ())
            assert not exports.server.running()  # no shared volume: no server
            await exports.attach("sbx-a", "127.0.0.1", (v1,))
            assert exports.server.running()
            ok = await asyncio.to_thread(_ls, port, "v1")
            assert "v1.txt" in ok, ok
            denied = await asyncio.to_thread(_ls, port, "v2")  # not exported at all
            assert denied == "NFS4ERR_NOENT", denied
            await exports.attach("sbx-b", "127.0.0.9", (v1, v2))
            assert [(e.pseudo, e.clients) for e in exports.exports()] == [
                ("/volumes/v1", ("127.0.0.1", "127.0.0.9")), ("/volumes/v2", ("127.0.0.9",))]
            assert exports.clients_of("v1") == ["sbx-a", "sbx-b"]
            ids = {e.pseudo: e.export_id for e in exports.exports()}
            # sbx-a is paused: 127.0.0.1 loses v1 (the export stays: sbx-b mounts it).
            await exports.detach("sbx-a")
            gone = await asyncio.to_thread(_ls, port, "v1")
            assert gone == "NFS4ERR_NOENT", gone
            await exports.attach("sbx-a", "127.0.0.1", (v1,))  # resumed
            # A sandbox whose start failed after its attach left its address listed: the next
            # sandbox given that address (its slot) takes it over, and only its own volumes.
            await exports.attach("sbx-c", "127.0.0.9", (v2,))
            assert [(e.pseudo, e.clients) for e in exports.exports()] == [
                ("/volumes/v1", ("127.0.0.1",)), ("/volumes/v2", ("127.0.0.9",))]
            assert exports.clients_of("v1") == ["sbx-a"]
            taken = await asyncio.to_thread(_ls, port, "v1")  # as 127.0.0.1: still sbx-a's
            assert isinstance(taken, list), taken
            await exports.detach("sbx-c")
            await exports.attach("sbx-b", "127.0.0.9", (v1, v2))
            # The server dies: the supervisor's check starts it again with the same exports.
            pid = exports.server.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(exports.server._proc.wait)  # type: ignore[union-attr]
            assert await exports.check() and exports.restarts == 1
            assert exports.server.pid != pid
            back = await asyncio.to_thread(_ls, port, "v1")
            assert "v1.txt" in back, back
            assert not await exports.check()  # running: nothing to do
            # A node restart: the next run ends the server this one leaves and serves the
            # sandboxes it adopted (sbx-b only: sbx-a did not survive).
            left = exports.server.pid
            nxt = SharedExports(tmp_path / "nfs", port, whole_file_systems=False)
            assert await asyncio.to_thread(nxt.reap_leftover)
            assert left is not None
            await asyncio.to_thread(exports.server._proc.wait, 10)  # type: ignore[union-attr]
            with pytest.raises(ProcessLookupError):
                os.kill(left, 0)
            assert await nxt.resume_clients({"sbx-b"}) == ["sbx-b"]
            try:
                assert [(e.pseudo, e.clients) for e in nxt.exports()] == [
                    ("/volumes/v1", ("127.0.0.9",)), ("/volumes/v2", ("127.0.0.9",))]
                assert {e.pseudo: e.export_id for e in nxt.exports()} == ids
            finally:
                await nxt.close()
        finally:
            await exports.close()
        assert not exports.server.running()
        # Export ids are kept: a new node run gives each volume the id it had.
        again = SharedExports(tmp_path / "nfs", port, whole_file_systems=False)
        assert again.export_id("v2") == ids["/volumes/v2"]
        assert again.export_id("v1") == ids["/volumes/v1"]
        assert again.export_id("v3") not in ids.values()

    asyncio.run(scenario())


def test_a_guest_without_the_nfs_client_is_a_400() -> None:
    """envd answers /init with 400 when the guest cannot mount NFS at all (a template booted
    without the client's modules): the runtime's GuestRefusedError becomes a BackendError the
    API answers with 400, not 500; other /init failures stay 500."""
    from agentenv.api.errors import BadRequest, Internal
    from agentenv.node.operations import backend_failure
    from agentenv.node.vm_backend.errors import vm_errors
    from agentenv.runtime.errors import GuestNotReadyError, GuestRefusedError

    for exc, status, kind in ((GuestRefusedError("no NFSv4 client: build it again", 400), 400,
                               BadRequest),
                              (GuestNotReadyError("envd /init answered 500"), 500, Internal)):
        with pytest.raises(Exception) as caught, vm_errors("creating"):
            raise exc
        answer = backend_failure(f"failed to create sandbox: {caught.value}", caught.value)
        assert isinstance(answer, kind) and answer.status == status, answer
