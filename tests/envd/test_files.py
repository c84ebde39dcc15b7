"""files.* of the official e2b SDK against envd: read, write (multipart, octet-stream, gzip),
list, stat, make_dir, rename, remove, watch, metadata, 100 MiB transfers."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import subprocess
import time
from pathlib import Path

import pytest
from e2b import AsyncSandbox, FileNotFoundException, Sandbox, SandboxException
from e2b.exceptions import InvalidArgumentException
from e2b.sandbox.filesystem.filesystem import FileType
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

pytestmark = pytest.mark.root


def test_write_read_text_bytes_and_stream(sbx: Sandbox, envd) -> None:
    info = sbx.files.write("/home/user/notes/hello.txt", "hello world")
    assert info.path == "/home/user/notes/hello.txt"
    assert info.name == "hello.txt"
    host = envd.root / "home/user/notes/hello.txt"
    assert host.read_text() == "hello world"
    assert (host.stat().st_uid, host.parent.stat().st_uid) == (1000, 1000)  # given to `user`
    assert sbx.files.read("/home/user/notes/hello.txt") == "hello world"
    sbx.files.write("/data/blob.bin", bytes(range(256)))
    assert sbx.files.read("/data/blob.bin", format="bytes") == bytes(range(256))
    streamed = b"".join(sbx.files.read("/data/blob.bin", format="stream"))
    assert streamed == bytes(range(256))
    # A relative path starts at the user's home.
    sbx.files.write("rel.txt", "relative")
    assert (envd.root / "home/user/rel.txt").read_text() == "relative"
    assert sbx.files.read("~/rel.txt") == "relative"


def test_write_octet_stream_gzip_and_file_objects(sbx: Sandbox, envd) -> None:
    sbx.files.write("/data/gz.txt", "compressed " * 1000, gzip=True)
    assert (envd.root / "data/gz.txt").read_text() == "compressed " * 1000
    # A gzip read asks for a compressed answer; envd answers identity, which the client takes.
    assert sbx.files.read("/data/gz.txt", gzip=True) == "compressed " * 1000
    sbx.files.write("/data/fileobj.bin", io.BytesIO(b"from a file object"))
    assert (envd.root / "data/fileobj.bin").read_bytes() == b"from a file object"
    sbx.files.write("/data/iter.bin", iter([b"chunk1-", b"chunk2"]))
    assert (envd.root / "data/iter.bin").read_bytes() == b"chunk1-chunk2"
    sbx.files.write("/data/forced.txt", "octet", use_octet_stream=True)
    assert (envd.root / "data/forced.txt").read_text() == "octet"


def test_write_files_keeps_full_paths(sbx: Sandbox, envd) -> None:
    infos = sbx.files.write_files(
        [{"path": "/data/multi/a.txt", "data": "A"}, {"path": "/data/multi/deep/b.txt", "data": b"B"}]
    )
    assert [i.path for i in infos] == ["/data/multi/a.txt", "/data/multi/deep/b.txt"]
    assert (envd.root / "data/multi/a.txt").read_text() == "A"
    assert (envd.root / "data/multi/deep/b.txt").read_text() == "B"


def test_read_missing_and_directory(sbx: Sandbox) -> None:
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/data/does-not-exist")
    with pytest.raises(InvalidArgumentException, match="is a directory"):
        sbx.files.read("/data")


def test_exists_info_list_make_dir_rename_remove(sbx: Sandbox) -> None:
    assert sbx.files.make_dir("/data/tree/sub") is True
    assert sbx.files.make_dir("/data/tree/sub") is False
    sbx.files.write("/data/tree/top.txt", "12345")
    sbx.files.write("/data/tree/sub/inner.txt", "x")
    assert sbx.files.exists("/data/tree/top.txt") is True
    assert sbx.files.exists("/data/tree/nope") is False
    assert sbx.files.exists("/data/tree/top.txt/below") is False

    info = sbx.files.get_info("/data/tree/top.txt")
    assert (info.name, info.type, info.size, info.owner, info.group) == ("top.txt", FileType.FILE, 5, "user", "user")
    assert info.permissions == "-rw-r--r--"
    assert abs(info.modified_time.timestamp() - time.time()) < 60

    level1 = sbx.files.list("/data/tree")
    assert [(e.name, e.type) for e in level1] == [("sub", FileType.DIR), ("top.txt", FileType.FILE)]
    level2 = sbx.files.list("/data/tree", depth=2)
    assert [e.path for e in level2] == ["/data/tree/sub", "/data/tree/sub/inner.txt", "/data/tree/top.txt"]

    with pytest.raises(InvalidArgumentException):
        sbx.files.list("/data/tree/top.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.list("/data/nothing-here")
    with pytest.raises(InvalidArgumentException):
        sbx.files.make_dir("/data/tree/top.txt")

    moved = sbx.files.rename("/data/tree/top.txt", "/data/tree/moved/top2.txt")
    assert moved.path == "/data/tree/moved/top2.txt"
    assert sbx.files.exists("/data/tree/top.txt") is False
    with pytest.raises(FileNotFoundException):
        sbx.files.rename("/data/tree/top.txt", "/data/tree/x.txt")

    sbx.files.remove("/data/tree")
    assert sbx.files.exists("/data/tree") is False
    sbx.files.remove("/data/tree")  # removing what is not there is fine


def test_symlinks_stay_inside_the_root(sbx: Sandbox, envd) -> None:
    # An absolute link target means the guest's /etc, not the host's.
    os.symlink("/etc", envd.root / "data/etc-link")
    entries = {e.name: e for e in sbx.files.list("/data")}
    assert entries["etc-link"].type == FileType.SYMLINK
    assert entries["etc-link"].symlink_target == "/etc"
    passwd = sbx.files.read("/data/etc-link/passwd")
    assert passwd.startswith("root:x:0:0:root:/root:/bin/sh")
    escape = sbx.files.read("/../../../../etc/passwd")
    assert escape == passwd


def test_metadata_is_stored_as_xattrs(sbx: Sandbox, envd) -> None:
    try:
        os.setxattr(envd.root / "data", "user.probe", b"1")
    except OSError:
        pytest.skip("the test filesystem has no user xattrs")
    info = sbx.files.write("/data/meta.txt", "m", metadata={"Owner": "alice"})
    assert info.metadata == {"owner": "alice"}
    assert os.getxattr(envd.root / "data/meta.txt", "user.e2b.owner") == b"alice"
    assert sbx.files.get_info("/data/meta.txt").metadata == {"owner": "alice"}


def test_overwrite_replaces_metadata(sbx: Sandbox, envd) -> None:
    """E2B clears a file's metadata on overwrite: only what the new write sets is left."""
    try:
        os.setxattr(envd.root / "data", "user.probe", b"1")
    except OSError:
        pytest.skip("the test filesystem has no user xattrs")
    sbx.files.write("/data/over.txt", "v1", metadata={"owner": "alice", "stage": "draft"})
    info = sbx.files.write("/data/over.txt", "v2", metadata={"stage": "final"})
    assert info.metadata == {"stage": "final"}
    assert sbx.files.get_info("/data/over.txt").metadata == {"stage": "final"}
    sbx.files.write("/data/over.txt", "v3")
    assert not sbx.files.get_info("/data/over.txt").metadata
    host = envd.root / "data/over.txt"
    assert host.read_text() == "v3"
    assert [n for n in os.listxattr(host) if n.startswith("user.e2b.")] == []


def test_watch_dir_sync(sbx: Sandbox) -> None:
    sbx.files.make_dir("/data/watched")
    handle = sbx.files.watch_dir("/data/watched", recursive=True)
    try:
        sbx.files.write("/data/watched/new.txt", "one")
        sbx.files.make_dir("/data/watched/sub")
        time.sleep(0.2)
        sbx.files.write("/data/watched/sub/deep.txt", "two")
        sbx.files.remove("/data/watched/new.txt")
        time.sleep(0.3)
        events = [(e.name, e.type) for e in handle.get_new_events()]
    finally:
        handle.stop()
    assert ("new.txt", FilesystemEventType.CREATE) in events
    assert ("new.txt", FilesystemEventType.WRITE) in events
    assert ("sub", FilesystemEventType.CREATE) in events
    assert ("sub/deep.txt", FilesystemEventType.CREATE) in events
    assert ("new.txt", FilesystemEventType.REMOVE) in events
    with pytest.raises(SandboxException):
        handle.get_new_events()  # the watcher is gone


def test_watch_dir_errors(sbx: Sandbox) -> None:
    with pytest.raises(FileNotFoundException):
        sbx.files.watch_dir("/data/no-such-dir")
    sbx.files.write("/data/plain.txt", "x")
    with pytest.raises(InvalidArgumentException):
        sbx.files.watch_dir("/data/plain.txt")


def test_watch_dir_async_stream(envd) -> None:
    async def scenario() -> list[tuple[str, FilesystemEventType, bool]]:
        sandbox = await AsyncSandbox.create(debug=True, sandbox_url=envd.url)
        # The async client, on the same envd: a command and a concurrent pair.
        assert (await sandbox.commands.run("echo async")).stdout == "async\n"
        results = await asyncio.gather(*(sandbox.commands.run(f"echo {i}") for i in range(2)))
        assert [r.stdout for r in results] == ["0\n", "1\n"]
        await sandbox.files.make_dir("/data/async-watched")
        seen: list[tuple[str, FilesystemEventType, bool]] = []
        handle = await sandbox.files.watch_dir(
            "/data/async-watched",
            on_event=lambda e: seen.append((e.name, e.type, e.entry is not None)),
            include_entry=True,
        )
        await sandbox.files.write("/data/async-watched/a.txt", "a")
        for _ in range(50):
            if any(name == "a.txt" for name, _, _ in seen):
                break
            await asyncio.sleep(0.05)
        await handle.stop()
        return seen

    seen = asyncio.run(scenario())
    assert ("a.txt", FilesystemEventType.CREATE, True) in seen


def test_upload_to_read_only_place(sbx: Sandbox, envd) -> None:
    target = envd.root / "data/ro"
    target.mkdir()
    subprocess.run(["mount", "--bind", str(target), str(target)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
        with pytest.raises(SandboxException, match="Read-only file system"):
            sbx.files.write("/data/ro/x.txt", "x")
        with pytest.raises(SandboxException, match="Read-only file system"):
            sbx.files.make_dir("/data/ro/sub")
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_100_mib_up_and_down(sbx: Sandbox, envd, tmp_path: Path) -> None:
    size = 100 * 1024 * 1024
    payload = os.urandom(1024 * 1024) * 100
    digest = hashlib.sha256(payload).hexdigest()

    started = time.monotonic()
    sbx.files.write("/data/big.bin", payload)  # bytes: one multipart upload
    upload_seconds = time.monotonic() - started
    host = envd.root / "data/big.bin"
    assert host.stat().st_size == size
    assert hashlib.sha256(host.read_bytes()).hexdigest() == digest

    started = time.monotonic()
    source = tmp_path / "source.bin"
    source.write_bytes(payload)
    with open(source, "rb") as stream:
        sbx.files.write("/data/big-stream.bin", stream)  # file object: octet-stream
    stream_seconds = time.monotonic() - started
    assert hashlib.sha256((envd.root / "data/big-stream.bin").read_bytes()).hexdigest() == digest

    started = time.monotonic()
    hasher = hashlib.sha256()
    received = 0
    for chunk in sbx.files.read("/data/big.bin", format="stream"):
        hasher.update(chunk)
        received += len(chunk)
    download_seconds = time.monotonic() - started
    assert received == size
    assert hasher.hexdigest() == digest
    # Inside envd the command sees the same bytes.
    assert sbx.commands.run("sha256sum /data/big.bin", user="root").stdout.split()[0] == digest
    print(f"100 MiB: multipart up {upload_seconds:.2f}s, octet-stream up {stream_seconds:.2f}s, down {download_seconds:.2f}s")
    assert upload_seconds < 30 and download_seconds < 30
