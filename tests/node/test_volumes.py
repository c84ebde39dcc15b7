"""E2B's Volume API on the node (node/volumes.py, docs/volumes.md), driven by the official SDK's
`Volume` class unchanged: the volume API with the API key, the content API at
E2B_VOLUME_API_URL with the volume's token; paths that cannot leave the volume; sizes; teams;
a restart."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import AsyncVolume, Volume
from e2b.exceptions import (
    AuthenticationException,
    NotFoundException,
    VolumeException,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)
from starlette.testclient import TestClient

from agentenv.api.errors import ApiError
from agentenv.node.server import ServeOptions, build_app
from agentenv.node.volume_files import TooLarge
from agentenv.snapshot.record import VOLUME_DISK_BYTES
from agentenv.storage.export import export_raw
from agentenv.storage.image import Image
from tests.node.conftest import NodeProcess, sdk_pointed_at


def _name(prefix: str = "vol") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def volume(sdk_env: NodeProcess) -> Iterator[Volume]:
    vol = Volume.create(_name())
    yield vol
    Volume.destroy(vol.volume_id)


def _data_dir(node: NodeProcess, vol: Volume) -> Path:
    return node.state_dir / "volumes" / vol.volume_id / "data"


def _raw(node: NodeProcess, vol: Volume, token: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=f"{node.url}/volumecontent/{vol.volume_id}", timeout=30,
                        trust_env=False, headers={"Authorization": f"Bearer {token or vol.token}"})


def test_the_volume_api_through_the_sdk(sdk_env: NodeProcess) -> None:
    name = _name("life")
    vol = Volume.create(name)
    try:
        assert vol.name == name and vol.token and vol.volume_id
        info = Volume.get_info(vol.volume_id)
        assert (info.volume_id, info.name, info.token) == (vol.volume_id, name, vol.token)
        assert (vol.volume_id, name) in [(v.volume_id, v.name) for v in Volume.list()]
        again = Volume.connect(vol.volume_id)
        assert again.token == vol.token and again.name == name
        with pytest.raises(VolumeException, match=r"409.*already has a volume named"):
            Volume.create(name)
        with pytest.raises(VolumeException, match=r"400.*letters, digits"):
            Volume.create("no spaces/or slashes")
        with sdk_env.client() as api:
            made = api.post("/volumes", json={"name": _name(), "sizeMB": 10**9})
            assert made.status_code == 400 and "AENV_VOLUME_MAX_SIZE_MB" in made.json()["message"]
            assert api.get(f"/volumes/{vol.volume_id}").json()["sizeMB"] == 1024  # the default
    finally:
        assert Volume.destroy(vol.volume_id) is True
    assert Volume.destroy(vol.volume_id) is False
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id)
    assert not (sdk_env.state_dir / "volumes" / vol.volume_id).exists()


def test_the_content_api_through_the_sdk(volume: Volume) -> None:
    """E2B's own SDK test scenarios (tests/sync/volume_sync/test_file.py), against the node."""
    volume.write_file("/test.txt", "Hello, World!")
    assert volume.read_file("/test.txt") == "Hello, World!"
    assert volume.read_file("test.txt", format="bytes") == b"Hello, World!"  # relative: the same
    volume.write_file("/binary.bin", bytes(range(256)) * 5000)
    assert volume.read_file("/binary.bin", format="bytes") == bytes(range(256)) * 5000
    assert b"".join(volume.read_file("/binary.bin", format="stream")) == bytes(range(256)) * 5000
    volume.write_file("/stream.txt", io.BytesIO(b"from a stream"))
    volume.write_file("/text-stream.txt", io.StringIO("from a text stream"))
    assert volume.read_file("/stream.txt") == "from a stream"
    assert volume.read_file("/text-stream.txt") == "from a text stream"
    volume.write_file("/empty.txt", "")
    assert volume.read_file("/empty.txt") == ""

    # overwriting takes force
    with pytest.raises(VolumeException, match=r"409.*force replaces"):
        volume.write_file("/test.txt", "New content", force=False)
    with pytest.raises(VolumeException, match="409"):
        volume.write_file("/test.txt", "New content")
    volume.write_file("/test.txt", "New content", force=True)
    assert volume.read_file("/test.txt") == "New content"

    # metadata on write, get_info, update_metadata
    volume.write_file("/meta.txt", "m", uid=1000, gid=1000, mode=0o640)
    info = volume.get_info("/meta.txt")
    assert (info.name, info.type.value, info.path, info.size) == ("meta.txt", "file",
                                                                  "/meta.txt", 1)
    assert (info.uid, info.gid, info.mode) == (1000, 1000, 0o640)
    updated = volume.update_metadata("/meta.txt", uid=1001, gid=1002, mode=0o755)
    assert (updated.uid, updated.gid, updated.mode) == (1001, 1002, 0o755)
    with pytest.raises(NotFoundException):
        volume.update_metadata("/absent.txt", mode=0o644)
    assert volume.exists("/meta.txt") and not volume.exists("/absent.txt")
    with pytest.raises(VolumePathNotFoundException):
        volume.read_file("/absent.txt")

    # directories
    made = volume.make_dir("/dir-with-metadata", uid=1000, gid=1000, mode=0o750)
    assert (made.type.value, made.uid, made.gid, made.mode) == ("directory", 1000, 1000, 0o750)
    with pytest.raises(VolumeException, match=r"409.*already exists"):
        volume.make_dir("/dir-with-metadata")
    assert volume.make_dir("/dir-with-metadata", force=True).path == "/dir-with-metadata"
    with pytest.raises(VolumePathNotFoundException):
        volume.make_dir("/nested/deep/directory")  # parents only with force
    volume.make_dir("/nested/deep/directory", force=True)
    assert volume.get_info("/nested/deep").type.value == "directory"
    with pytest.raises(VolumePathNotFoundException):
        volume.write_file("/no-such-dir/file.txt", "x")  # the parent must exist
    volume.write_file("/nested/deep/directory/file.txt", "Nested")
    assert volume.read_file("/nested/deep/directory/file.txt") == "Nested"
    with pytest.raises(VolumeException, match=r"409.*is a directory"):
        volume.write_file("/nested", "x", force=True)
    with pytest.raises(VolumeException, match=r"400.*is a directory"):
        volume.read_file("/nested")

    # listing
    top = {e.name: e for e in volume.list("/")}
    assert {"test.txt", "binary.bin", "meta.txt", "nested", "dir-with-metadata"} <= set(top)
    assert top["nested"].type.value == "directory" and top["test.txt"].size == 11
    assert [e.name for e in volume.list("/nested")] == ["deep"]
    deep = [e.path for e in volume.list("/nested", depth=3)]
    assert deep == ["/nested/deep", "/nested/deep/directory",
                    "/nested/deep/directory/file.txt"]
    with pytest.raises(NotFoundException):
        volume.list("/non-existent")

    # removal
    volume.remove("/test.txt")
    assert not volume.exists("/test.txt")
    volume.remove("/nested")  # recursively
    assert not volume.exists("/nested")
    with pytest.raises(NotFoundException):
        volume.remove("/non-existent.txt")


def test_the_async_sdk_reaches_the_same_content(volume: Volume) -> None:
    async def use() -> list[str]:
        remote = await AsyncVolume.connect(volume.volume_id)
        await remote.write_file("/async.txt", "written async")
        return [e.name for e in await remote.list("/")]

    assert asyncio.run(use()) == ["async.txt"]
    assert volume.read_file("/async.txt") == "written async"


def test_paths_never_leave_the_volume(sdk_env: NodeProcess, volume: Volume,
                                      tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text("host secret")
    data = _data_dir(sdk_env, volume)
    # links a sandbox's commit could bring in one day (the content API never makes them)
    (data / "to-dir").symlink_to(outside)
    (data / "to-file").symlink_to(secret)
    (data / "to-abs").symlink_to("/etc/passwd")

    with _raw(sdk_env, volume) as raw:
        for path in ("../../secrets/api-key", "/a/../../x", "..", "/x/.."):
            answer = raw.get("/file", params={"path": path})
            assert answer.status_code == 400 and "'..'" in answer.json()["message"], path
        assert raw.get("/file", params={"path": "a\0b"}).status_code == 400
        assert raw.get("/file", params={"path": "x" * 300}).status_code == 400
    # an absolute path is the volume's own
    with pytest.raises(VolumePathNotFoundException):
        volume.read_file("/etc/passwd")
    # links are never followed: not read, written or created through, not listed into
    for path in ("/to-file", "/to-abs", "/to-dir/secret.txt"):
        with pytest.raises(VolumeException, match=r"400.*symbolic link"):
            volume.read_file(path)
    with pytest.raises(VolumeException, match=r"400.*symbolic link"):
        volume.write_file("/to-dir/planted.txt", "x")
    with pytest.raises(VolumeException, match=r"400.*symbolic link"):
        volume.make_dir("/to-dir/sub/deeper", force=True)
    with pytest.raises(VolumeException, match=r"400.*symbolic link"):
        volume.list("/to-dir")
    with pytest.raises(VolumeException, match=r"400.*symbolic link"):
        volume.update_metadata("/to-file", mode=0o777)
    link = volume.get_info("/to-file")
    assert link.type.value == "symlink" and link.target == str(secret)
    listed = {e.name: e for e in volume.list("/", depth=5)}
    assert listed["to-dir"].type.value == "symlink" and "secret.txt" not in listed
    volume.update_metadata("/to-file", uid=4321)  # the link's owner, not the file's
    assert os.lstat(data / "to-file").st_uid == 4321 and secret.stat().st_uid == 0
    # with force an upload replaces the link itself, never the file it names
    volume.write_file("/to-file", "replaced", force=True)
    assert volume.get_info("/to-file").type.value == "file"
    volume.remove("/to-dir")
    volume.remove("/to-abs")
    assert secret.read_text() == "host secret" and outside.is_dir()
    assert os.path.exists("/etc/passwd")
    # the root itself cannot be removed or replaced
    with pytest.raises(VolumeException, match=r"400.*root cannot be removed"):
        volume.remove("/")
    with pytest.raises(VolumeException, match=r"400.*is a directory"):
        volume.write_file("/", "x", force=True)


def test_a_volume_holds_at_most_its_size(sdk_env: NodeProcess) -> None:
    with sdk_env.client() as api:
        made = api.post("/volumes", json={"name": _name("small"), "sizeMB": 1}).json()
    vol = Volume.connect(made["volumeID"])
    try:
        assert made["sizeMB"] == 1
        with pytest.raises(VolumeException, match=r"413.*is full: its size is 1 MiB"):
            vol.write_file("/big.bin", b"x" * (2 << 20))  # refused by its Content-Length
        vol.write_file("/half.bin", b"y" * (512 << 10))

        def chunks() -> Iterator[bytes]:  # no Content-Length: refused while it streams
            for _ in range(8):
                yield b"z" * (128 << 10)

        with _raw(sdk_env, vol) as raw:
            answer = raw.put("/file", params={"path": "/streamed.bin"}, content=chunks())
        assert answer.status_code == 413 and "is full" in answer.json()["message"]
        # nothing of the refused writes is left, and what fits still fits
        assert sorted(e.name for e in vol.list("/")) == ["half.bin"]
        assert os.listdir(sdk_env.state_dir / "volumes" / vol.volume_id / "tmp") == []
        vol.write_file("/half.bin", b"w" * (900 << 10), force=True)  # replaces: room enough
        with pytest.raises(VolumeException, match="413"):
            vol.write_file("/more.bin", b"v" * (200 << 10))
        vol.remove("/half.bin")
        vol.write_file("/more.bin", b"v" * (200 << 10))
    finally:
        Volume.destroy(vol.volume_id)


def test_the_content_api_takes_the_volumes_own_token(sdk_env: NodeProcess) -> None:
    one, two = Volume.create(_name("one")), Volume.create(_name("two"))
    try:
        one.write_file("/one.txt", "1")
        with pytest.raises(AuthenticationException):
            Volume(one.volume_id, one.name, token=two.token).read_file("/one.txt")
        with _raw(sdk_env, one, token="wrong") as raw:
            answer = raw.get("/file", params={"path": "/one.txt"})
            assert answer.status_code == 401 and "Bearer" in answer.json()["message"]
        with httpx.Client(trust_env=False) as plain:
            bare = plain.get(f"{sdk_env.url}/volumecontent/{one.volume_id}/file",
                             params={"path": "/one.txt"}, headers={"X-API-KEY": sdk_env.api_key})
            assert bare.status_code == 401  # the API key is not the volume's token
            unknown = plain.get(f"{sdk_env.url}/volumecontent/{uuid.uuid4()}/path",
                                params={"path": "/"}, headers={"Authorization": "Bearer x"})
            assert unknown.status_code == 401  # whether it exists is not told
    finally:
        Volume.destroy(one.volume_id)
        Volume.destroy(two.volume_id)


NODE_KEY = "0f" * 32  # a node of a cluster: its gateway names the team


def test_teams_see_only_their_own_volumes(tmp_path: Path) -> None:
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process",
                                 node_key=NODE_KEY))
    with TestClient(app) as client:
        def as_team(team: str) -> dict[str, str]:
            return {"x-agentenv-node-key": NODE_KEY, "x-agentenv-team": team}

        made = client.post("/volumes", json={"name": "data"}, headers=as_team("team-a"))
        assert made.status_code == 201, made.text
        vid = made.json()["volumeID"]
        assert client.get(f"/volumes/{vid}", headers=as_team("team-b")).status_code == 404
        assert client.delete(f"/volumes/{vid}", headers=as_team("team-b")).status_code == 404
        assert client.get("/volumes", headers=as_team("team-b")).json() == []
        # a name is the team's own: another team may use it too
        theirs = client.post("/volumes", json={"name": "data"}, headers=as_team("team-b"))
        assert theirs.status_code == 201 and theirs.json()["volumeID"] != vid
        assert [v["volumeID"] for v in client.get(
            "/volumes", headers=as_team("team-a")).json()] == [vid]
        assert client.get(f"/volumes/{vid}", headers=as_team("team-a")).status_code == 200


def test_volumes_survive_a_node_restart(make_node: object) -> None:
    node: NodeProcess = make_node()  # type: ignore[operator]
    with sdk_pointed_at(node):
        vol = Volume.create(_name("kept"))
        vol.write_file("/kept.txt", "still here")
    node.stop()
    # an upload the stopped node was receiving is dropped at the next start
    stale = node.state_dir / "volumes" / vol.volume_id / "tmp" / "upload-stale"
    stale.write_bytes(b"half")
    node.start()
    with sdk_pointed_at(node):
        again = Volume.connect(vol.volume_id)
        assert again.token == vol.token
        assert again.read_file("/kept.txt") == "still here"
        assert not stale.exists()


def _as_team(team: str) -> dict[str, str]:
    return {"x-agentenv-node-key": NODE_KEY, "x-agentenv-team": team}


def test_shared_read_write_is_off_unless_the_node_offers_it(tmp_path: Path) -> None:
    """`rw-shared` is off by default (AENV_VOLUME_SHARED_RW=1 offers it): a 400 naming the
    setting, before anything is made."""
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process",
                                 node_key=NODE_KEY))
    with TestClient(app) as client:
        assert client.post("/volumes", json={"name": "data"},
                           headers=_as_team("team-a")).status_code == 201
        answer = client.post("/v2/sandboxes", headers=_as_team("team-a"), json={
            "templateID": "base", "volumeMounts": [{"name": "data:rw-shared", "path": "/m"}]})
        assert answer.status_code == 400 and "AENV_VOLUME_SHARED_RW" in answer.text, answer.text
        assert client.get("/v2/sandboxes", headers=_as_team("team-a")).json() == []


def test_mount_requests_are_checked_before_anything_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bad volumeMounts is a 4xx naming it, and leaves no sandbox (the process backend
    mounts no volumes: a good request gets that 400, after the checks)."""
    monkeypatch.setenv("AENV_VOLUME_SHARED_RW", "1")
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process",
                                 node_key=NODE_KEY))
    with TestClient(app) as client:
        assert client.post("/volumes", json={"name": "data"},
                           headers=_as_team("team-a")).status_code == 201
        assert client.post("/volumes", json={"name": "more"},
                           headers=_as_team("team-a")).status_code == 201

        def create(mounts: list[dict[str, Any]], team: str = "team-a") -> httpx.Response:
            return client.post("/v2/sandboxes", headers=_as_team(team),
                               json={"templateID": "base", "volumeMounts": mounts})

        for mounts, status, words in [
            ([{"name": "data", "path": "/mnt/data"}], 404, "volume 'data' not found"),
        ]:
            answer = create(mounts, team="team-b")  # another team's volume: not found
            assert answer.status_code == status and words in answer.json()["message"], answer.text
        for mounts, status, words in [
            ([{"name": "nope", "path": "/mnt/x"}], 404, "volume 'nope' not found"),
            ([{"name": "data", "path": "/etc"}], 400, "system directory"),
            ([{"name": "data", "path": "/usr/local/data"}], 400, "system directory"),
            ([{"name": "data", "path": "/"}], 400, "system directory"),
            ([{"name": "data", "path": "/proc/x"}], 400, "system directory"),
            ([{"name": "data", "path": "relative/x"}], 400, "absolute path"),
            ([{"name": "data", "path": "/mnt/a/../etc"}], 400, "normalised"),
            ([{"name": "data", "path": "/mnt/a\nb"}], 400, "printable"),
            ([{"name": "data", "path": "/mnt/d"}, {"name": "more", "path": "/mnt/d/x"}], 400,
             "overlaps"),
            ([{"name": "data", "path": "/mnt/d", "mode": "rwx"}], 400, "mode must be"),
            ([{"name": "data:rw", "path": "/mnt/a"}, {"name": "data:rw", "path": "/mnt/b"}],
             400, "read-write twice"),
            ([{"name": "data:rw-shared", "path": "/mnt/a"}, {"name": "data:rw", "path": "/mnt/b"}],
             400, "read-write twice"),
            ([{"name": "data:cow", "path": "/mnt/d", "mode": "ro"}], 400, "the name says"),
            ([{"name": "data", "path": f"/mnt/{i}"} for i in range(5)], 400,
             "AENV_VOLUME_MAX_MOUNTS=4"),
            ([{"name": "data", "path": "/mnt/data"}], 400, "process backend does not mount"),
        ]:
            answer = create(mounts)
            assert answer.status_code == status and words in answer.json()["message"], \
                (mounts, answer.text)
        assert create([{"name": "data"}]).status_code == 422  # no path
        for team in ("team-a", "team-b"):
            assert client.get("/v2/sandboxes", headers=_as_team(team)).json() == []
        assert app.orchestrator.sandboxes == {}


def test_a_volume_seals_into_an_ext4_layer_and_old_versions_go(tmp_path: Path) -> None:
    """A mount's layer holds the content as ext4 (owners, modes, the root's too); it is made
    again only after a change; an older version and a deleted volume's go at the next GC."""
    state = tmp_path / "state"
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    key = (state / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        made = client.post("/volumes", json={"name": "data", "sizeMB": 64}).json()
        token = {"Authorization": f"Bearer {made['token']}"}
        base = f"/volumecontent/{made['volumeID']}"
        assert client.put(f"{base}/file", params={"path": "/hello.txt", "uid": 1000, "mode": 416},
                          content=b"hello volume", headers=token).status_code == 201
        assert client.post(f"{base}/dir", params={"path": "/sub/deeper", "force": "true"},
                           headers=token).status_code == 201
        assert client.patch(f"{base}/path", params={"path": "/"}, json={"uid": 1000, "gid": 1000,
                            "mode": 0o770}, headers=token).status_code == 200
        volumes = app.orchestrator.volumes
        assert volumes is not None
        rec = volumes.records[made["volumeID"]]
        first = Path(client.portal.call(volumes.seal, rec))
        assert first.name.endswith("-v1.layer") and first.is_file()
        assert client.portal.call(volumes.seal, rec) == str(first)  # unchanged: the same

        raw = tmp_path / "volume.raw"
        export_raw(Image.open(first, writable=False), raw)
        assert raw.stat().st_size == VOLUME_DISK_BYTES
        assert _debugfs(raw, "cat /hello.txt") == "hello volume"
        hello = _debugfs(raw, "stat /hello.txt")
        assert "User:  1000" in hello and "Mode:  0640" in hello
        root = _debugfs(raw, "stat /")
        assert "User:  1000" in root and "Group:  1000" in root and "Mode:  0770" in root
        assert "Type: directory" in _debugfs(raw, "stat /sub/deeper")

        assert client.put(f"{base}/file", params={"path": "/hello.txt", "force": "true"},
                          content=b"changed", headers=token).status_code == 201
        second = Path(client.portal.call(volumes.seal, rec))
        assert second.name.endswith("-v2.layer") and first.is_file()
        gc = app.orchestrator.gc
        gc.grace_seconds = 0
        client.portal.call(gc.collect, "test")
        assert not first.exists() and second.exists()  # v1: no volume, sandbox or snapshot
        assert client.delete(f"/volumes/{made['volumeID']}").status_code == 204
        client.portal.call(gc.collect, "test")
        assert not second.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop mounts)")
def test_a_shared_volume_moves_onto_its_own_file_system(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A volume's first rw-shared mount (docs/volumes.md §7.1) moves its content onto an ext4
    of its own, loop-mounted (what the NFS server exports: a forged handle reaches nothing
    else), for good: owners and modes kept, the content API on the same files, the node's next
    start mounts it again, a seal (for ro and cow mounts) made at every mount, no commit."""
    state = tmp_path / "state"
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    key = (state / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        made = client.post("/volumes", json={"name": "data", "sizeMB": 16}).json()
        token = {"Authorization": f"Bearer {made['token']}"}
        base = f"/volumecontent/{made['volumeID']}"
        assert client.put(f"{base}/file", params={"path": "/a.txt", "uid": 1000, "mode": 0o640},
                          content=b"before", headers=token).status_code == 201
        assert client.patch(f"{base}/path", params={"path": "/"}, json={"uid": 4321,
                            "gid": 4321}, headers=token).status_code == 200
        volumes = app.orchestrator.volumes
        assert volumes is not None
        rec = volumes.records[made["volumeID"]]
        assert not volumes.is_shared(rec)
        served = Path(client.portal.call(volumes.make_shared, rec))
        assert volumes.is_shared(rec) and served == volumes.shared_dir(rec)
        assert os.stat(served).st_dev != os.stat(state).st_dev  # a file system of its own
        assert volumes.shared_owner(rec) == (4321, 4321)
        st = os.stat(served / "a.txt")
        assert (st.st_uid, st.st_mode & 0o777) == (1000, 0o640)
        assert (served / "a.txt").read_bytes() == b"before"
        assert not (state / "volumes" / rec.volume_id / "data").exists()  # held once
        assert Path(client.portal.call(volumes.make_shared, rec)) == served  # made once
        # The content API and the sandboxes (NFS) edit the same files.
        (served / "from-nfs.txt").write_bytes(b"a guest wrote this")
        got = client.get(f"{base}/file", params={"path": "/from-nfs.txt"}, headers=token)
        assert got.status_code == 200 and got.content == b"a guest wrote this"
        assert client.put(f"{base}/file", params={"path": "/api.txt"}, content=b"api",
                          headers=token).status_code == 201
        assert (served / "api.txt").read_bytes() == b"api"
        # Full at its size: what the guests wrote counts for the content API too.
        (served / "big").write_bytes(b"x" * (15 << 20))
        answer = client.put(f"{base}/file", params={"path": "/more"}, content=b"y" * (2 << 20),
                            headers=token)
        assert answer.status_code == 413, answer.text
        (served / "big").unlink()
        # Never sealed again: its tree is written live by guests, and a walk of it as root
        # (mkfs -d) would follow what a guest swaps in. Mounted rw-shared only.
        with pytest.raises(ApiError, match="'rw-shared' only"):
            client.portal.call(volumes.seal, rec)
        for mode in ("ro", "cow", "rw"):
            with pytest.raises(ApiError, match="'rw-shared' only"):
                volumes.plan_mounts(rec.team, [("data", "/mnt/d", mode)], [], [0, 1], "vm")
        # Guests act as the root's owner on the host: never root.
        assert client.patch(f"{base}/path", params={"path": "/"}, json={"uid": 0, "gid": 0},
                            headers=token).status_code == 200
        with pytest.raises(ApiError, match="must not be root"):
            volumes.shared_owner(rec)
        assert client.patch(f"{base}/path", params={"path": "/"}, json={"uid": 4321,
                            "gid": 4321}, headers=token).status_code == 200
        # A volume whose root is root's (as made) is given to the guest's user when shared.
        fresh = client.post("/volumes", json={"name": "fresh", "sizeMB": 16}).json()
        fresh_rec = volumes.records[fresh["volumeID"]]
        assert os.stat(volumes.shared_dir(fresh_rec)).st_uid == 0
        client.portal.call(volumes.make_shared, fresh_rec)
        assert volumes.shared_owner(fresh_rec) == (1000, 1000)
        # Guests write it unseen by the disk reserve: its image is allocated whole up front,
        # where the reserve is checked (a 507 naming the setting, the volume left as it was).
        image = volumes._shared_fs(fresh_rec).image
        assert os.stat(image).st_blocks * 512 >= os.stat(image).st_size
        late = client.post("/volumes", json={"name": "late", "sizeMB": 16}).json()
        late_rec = volumes.records[late["volumeID"]]
        monkeypatch.setenv("AENV_DISK_RESERVE", str(1 << 60))
        with pytest.raises(ApiError, match="AENV_DISK_RESERVE") as refused:
            client.portal.call(volumes.make_shared, late_rec)
        assert refused.value.status == 507
        monkeypatch.delenv("AENV_DISK_RESERVE")
        assert not volumes.is_shared(late_rec) and volumes.shared_dir(late_rec).is_dir()
        with pytest.raises(Exception, match="nothing to commit"):
            client.portal.call(volumes.replace_content, rec, tmp_path / "none.tar", "commit")
    # The node's next start: mounted again (here: still mounted, kept), the same files.
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        volumes = app.orchestrator.volumes
        assert volumes is not None
        rec = volumes.records[made["volumeID"]]
        got = client.get(f"{base}/file", params={"path": "/api.txt"}, headers=token)
        assert got.status_code == 200 and got.content == b"api"
        assert client.delete(f"/volumes/{made['volumeID']}").status_code == 204
        assert not volumes._shared_fs(rec).mounted()
        fresh_rec = volumes.records[fresh["volumeID"]]
        assert client.delete(f"/volumes/{fresh['volumeID']}").status_code == 204
        assert not volumes._shared_fs(fresh_rec).mounted()


def _debugfs(image: Path, request: str) -> str:
    done = subprocess.run(["debugfs", "-R", request, str(image)], capture_output=True,
                          text=True, check=True)
    return done.stdout


def test_aenv_volume_import_fills_a_volume_from_a_directory(sdk_env: NodeProcess,
                                                            tmp_path: Path) -> None:
    from tests.node.test_cli import aenv, aenv_inline

    source = tmp_path / "dataset"
    (source / "train" / "shard").mkdir(parents=True)
    (source / "README").write_text("a dataset\n")
    blob = os.urandom(300_000)
    (source / "train" / "shard" / "part-0.bin").write_bytes(blob)
    os.chmod(source / "train", 0o750)
    os.chown(source / "train" / "shard" / "part-0.bin", 1000, 1000)
    (source / "link").symlink_to("README")
    name = _name("imported")
    done = aenv_inline(sdk_env, "volume", "import", name, str(source), "--size-mb", "64")
    assert done.exit_code == 0, done.output
    assert "2 files" in done.output and "2 directories" in done.output and "1 links" in done.output
    vol = Volume.connect(next(v.volume_id for v in Volume.list() if v.name == name))
    try:
        assert vol.read_file("/README") == "a dataset\n"
        assert vol.read_file("/train/shard/part-0.bin", format="bytes") == blob
        part = vol.get_info("/train/shard/part-0.bin")
        assert (part.uid, part.gid) == (1000, 1000)
        assert vol.get_info("/train").mode == 0o750
        assert not vol.exists("/link")
        # again: files of the same path are replaced, nothing is refused
        (source / "README").write_text("a newer dataset\n")
        assert aenv_inline(sdk_env, "volume", "import", name, str(source)).exit_code == 0
        assert vol.read_file("/README") == "a newer dataset\n"
        listed = aenv_inline(sdk_env, "volume", "list")
        assert f"{vol.volume_id}  {name}  64 MiB" in listed.output
    finally:
        assert aenv_inline(sdk_env, "volume", "rm", name).exit_code == 0
    missing = aenv(sdk_env, "volume", "rm", name)
    assert missing.returncode == 1 and f"no volume named '{name}'" in missing.stderr


def _tar(entries: list[tuple[str, bytes | str | None]]) -> bytes:
    """A tar of (name, content): bytes a file, None a directory, str a symlink's target."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, content in entries:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size, info.mode, info.uid = len(content), 0o640, 1000
                tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


def test_a_commit_replaces_the_content_with_a_checked_archive(tmp_path: Path) -> None:
    """What a sandbox's commit sends (an archive from the guest: untrusted) becomes the content
    only whole and only when it fits: links and `..` never write outside; too big, nothing
    changes."""
    state = tmp_path / "state"
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    key = (state / "secrets" / "api-key").read_text().strip()
    outside = tmp_path / "outside"
    outside.mkdir()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        made = client.post("/volumes", json={"name": "data", "sizeMB": 1}).json()
        volumes = app.orchestrator.volumes
        assert volumes is not None
        rec = volumes.records[made["volumeID"]]
        token = {"Authorization": f"Bearer {made['token']}"}
        base = f"/volumecontent/{made['volumeID']}"
        assert client.put(f"{base}/file", params={"path": "/old.txt"}, content=b"old",
                          headers=token).status_code == 201
        archive = tmp_path / "commit.tar"

        archive.write_bytes(_tar([(".", None), ("./work", None), ("./work/a.txt", b"A" * 10),
                                  ("../escaped", b"x")]))
        with pytest.raises(ApiError, match=r"a hostile commit.*outside"):
            client.portal.call(volumes.replace_content, rec, archive, "a hostile commit")
        assert not (tmp_path / "escaped").exists()
        assert (state / "volumes" / rec.volume_id / "data" / "old.txt").read_bytes() == b"old"
        # through a link of its own: refused or kept inside, never written outside
        archive.write_bytes(_tar([("./link", str(outside)), ("./link/planted", b"x")]))
        with contextlib.suppress(ApiError):
            client.portal.call(volumes.replace_content, rec, archive, "a hostile commit")
        assert list(outside.iterdir()) == []


        def listing() -> list[str]:
            return [e["path"] for e in client.get(f"{base}/dir", params={"path": "/", "depth": 3},
                                                  headers=token).json()]

        before = listing()
        archive.write_bytes(_tar([("./big.bin", b"x" * (2 << 20))]))
        with pytest.raises(TooLarge):
            client.portal.call(volumes.replace_content, rec, archive, "a large commit")
        assert listing() == before

        archive.write_bytes(_tar([(".", None), ("./work", None), ("./work/a.txt", b"A" * 10)]))
        client.portal.call(volumes.replace_content, rec, archive, "a commit")
        assert listing() == ["/work", "/work/a.txt"]
        entry = client.get(f"{base}/path", params={"path": "/work/a.txt"}, headers=token).json()
        assert (entry["size"], entry["uid"], entry["mode"]) == (10, 1000, 0o640)
        assert rec.dirty  # the next mount seals the new content
        assert not (state / "volumes" / rec.volume_id / "data.new").exists()


def test_device_nodes_never_reach_the_host_through_a_volume(tmp_path: Path) -> None:
    """Red team (2026-12-06): a commit's archive is the guest's, and its root can put a device
    node in it (`mknod`): unpacked on the host, that node was the host's device in the volume's
    directory, and the content API's read opened it (the open alone can act: a watchdog, a
    tape). A commit with a device node is refused, and a read never opens what is not a regular
    file (a FIFO's waiting writer stays blocked)."""
    import threading

    state = tmp_path / "state"
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    key = (state / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        made = client.post("/volumes", json={"name": "data", "sizeMB": 1}).json()
        volumes = app.orchestrator.volumes
        assert volumes is not None
        rec = volumes.records[made["volumeID"]]
        token = {"Authorization": f"Bearer {made['token']}"}
        base = f"/volumecontent/{made['volumeID']}"
        data = state / "volumes" / rec.volume_id / "data"

        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            info = tarfile.TarInfo("./null")
            info.type, info.devmajor, info.devminor, info.mode = tarfile.CHRTYPE, 1, 3, 0o666
            tar.addfile(info)
        archive = tmp_path / "commit.tar"
        archive.write_bytes(out.getvalue())
        with pytest.raises(ApiError, match=r"null is a device node"):
            client.portal.call(volumes.replace_content, rec, archive, "a hostile commit")
        assert list(data.iterdir()) == []
        assert not (data.parent / "data.new").exists()

        # a FIFO (kept: harmless once never opened): the read answers 400 without opening it
        os.mkfifo(data / "pipe")
        writer_done = threading.Event()

        def writer() -> None:
            fd = os.open(data / "pipe", os.O_WRONLY)  # blocks until someone opens it to read
            os.close(fd)
            writer_done.set()

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        try:
            answer = client.get(f"{base}/file", params={"path": "/pipe"}, headers=token)
            assert answer.status_code == 400, answer.text
            assert "not a regular file" in answer.json()["message"]
            assert not writer_done.wait(2), "the read opened the FIFO on the host"
        finally:
            os.close(os.open(data / "pipe", os.O_RDONLY | os.O_NONBLOCK))  # release the writer
            thread.join(30)
        assert client.get(f"{base}/file", params={"path": "/pipe"},
                          headers=token).status_code == 400


def test_trees_deeper_than_the_api_makes_never_enter_a_volume(tmp_path: Path) -> None:
    """Red team (2026-12-06): a path of 2000 one-letter names fits the 4096-byte bound, and a
    guest's commit may nest as deep: os.fwalk and shutil.rmtree recurse once per level, so the
    volume's count (every change after a restart, every seal and commit), the removal and the
    volume's deletion raised RecursionError (a 500, the directory left on disk)."""
    from agentenv.node.volume_files import MAX_DEPTH_NAMES

    state = tmp_path / "state"
    app = build_app(ServeOptions(state_dir=state, backend="process"))
    key = (state / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        made = client.post("/volumes", json={"name": "data", "sizeMB": 64}).json()
        volumes = app.orchestrator.volumes
        assert volumes is not None
        rec = volumes.records[made["volumeID"]]
        token = {"Authorization": f"Bearer {made['token']}"}
        base = f"/volumecontent/{made['volumeID']}"
        deep = "/a" * 2000
        answer = client.post(f"{base}/dir", params={"path": deep, "force": "true"},
                             headers=token)
        assert answer.status_code == 400 and "names" in answer.json()["message"], answer.text
        fits = "/a" * MAX_DEPTH_NAMES
        assert client.post(f"{base}/dir", params={"path": fits, "force": "true"},
                           headers=token).status_code == 201
        assert client.delete(f"{base}/path", params={"path": "/a"},
                             headers=token).status_code == 204

        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for level in range(1, 1101):
                info = tarfile.TarInfo("./" + "/".join(["a"] * level))
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
        archive = tmp_path / "commit.tar"
        archive.write_bytes(out.getvalue())
        with pytest.raises(ApiError, match="deeper than"):
            client.portal.call(volumes.replace_content, rec, archive, "a deep commit")
        home = state / "volumes" / rec.volume_id
        assert not (home / "data.new").exists()
        assert list((home / "data").iterdir()) == []
        assert client.delete(f"/volumes/{rec.volume_id}").status_code == 204
        assert not home.exists()
