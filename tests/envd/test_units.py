"""Pieces of envd checked on their own: the multipart parser, Connect framing, path handling."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentenv.guest.envd.multipart import MultipartParser, PartData, PartEnd, PartStart, boundary_of
from agentenv.guest.envd.rootfs import RootFs, User
from agentenv.guest.envd.rpc import (
    EnvelopeDecoder,
    RpcError,
    decode_bytes,
    encode_envelope,
    end_of_stream,
)

BOUNDARY = "9f4e63053100b78e70816c2289a49cfe"


def multipart_body(parts: list[tuple[str, str, bytes]]) -> bytes:
    body = b""
    for name, filename, data in parts:
        body += (
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{filename}\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode() + data + b"\r\n"
    return body + f"--{BOUNDARY}--\r\n".encode()


def parse(body: bytes, cuts: list[int]) -> tuple[list[tuple[str | None, str | None, bytes]], bool]:
    parser = MultipartParser(boundary_of(f"multipart/form-data; boundary={BOUNDARY}"))
    parts: list[tuple[str | None, str | None, bytes]] = []
    current: bytearray | None = None
    positions = [0, *sorted(c % (len(body) + 1) for c in cuts), len(body)]
    for start, end in itertools.pairwise(positions):
        for event in parser.feed(body[start:end]):
            if isinstance(event, PartStart):
                parts.append((event.headers.name, event.headers.filename, b""))
                current = bytearray()
            elif isinstance(event, PartData):
                assert current is not None
                current += event.data
            elif isinstance(event, PartEnd):
                assert current is not None
                parts[-1] = (*parts[-1][:2], bytes(current))
    return parts, parser.finished


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.binary(max_size=300), min_size=1, max_size=3),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
)
def test_multipart_any_split(datas: list[bytes], cuts: list[int]) -> None:
    # Data that looks like a delimiter prefix must survive any chunking.
    datas = [d + b"\r\n--" + BOUNDARY[:5].encode() for d in datas]
    parts_in = [("file", f"/home/user/dir {i}/f{i}.txt", d) for i, d in enumerate(datas)]
    parts_out, finished = parse(multipart_body(parts_in), cuts)
    assert finished
    assert parts_out == parts_in  # full paths kept, bytes exact


def test_multipart_truncated_is_not_finished() -> None:
    body = multipart_body([("file", "/a", b"data")])
    _, finished = parse(body[:-10], [])
    assert not finished


def test_envelopes_round_trip_and_limits() -> None:
    decoder = EnvelopeDecoder(max_message_bytes=100)
    stream = encode_envelope({"a": 1}) + end_of_stream(RpcError("not_found", "gone"))
    frames = [frame for byte in stream for frame in decoder.feed(bytes([byte]))]
    assert frames == [(0, b'{"a":1}'), (2, b'{"error":{"code":"not_found","message":"gone"}}')]
    with pytest.raises(RpcError) as info:
        EnvelopeDecoder(10).feed(encode_envelope({"long": "x" * 20}))
    assert info.value.code == "resource_exhausted"
    with pytest.raises(ValueError):
        RpcError("no_such_code", "x")


def test_bytes_fields_accept_url_safe_and_unpadded() -> None:
    assert decode_bytes("aGkK", "x") == b"hi\n"
    assert decode_bytes("-_8", "x") == b"\xfb\xff"
    with pytest.raises(RpcError):
        decode_bytes("!!", "x")


def test_paths_resolve_inside_the_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "real").mkdir()
    os.symlink("/real", tmp_path / "abs-link")
    os.symlink("../../../..", tmp_path / "real" / "up")
    os.symlink("loop2", tmp_path / "loop1")
    os.symlink("loop1", tmp_path / "loop2")
    rootfs = RootFs(str(tmp_path))
    user = User("user", 1000, 1000, "/home/user", "/bin/sh", (1000,))
    assert rootfs.host_path("/abs-link/x") == f"{tmp_path}/real/x"
    assert rootfs.host_path("/real/up/etc") == f"{tmp_path}/etc"
    assert rootfs.host_path("/../../etc") == f"{tmp_path}/etc"
    assert rootfs.host_path("/abs-link", follow_final=False) == f"{tmp_path}/abs-link"
    with pytest.raises(RpcError):
        rootfs.host_path("/loop1/x")
    assert rootfs.expand("~/a", user) == "/home/user/a"
    assert rootfs.expand("a/../b", user) == "/home/user/b"
    assert rootfs.expand("rel", user, "/work") == "/work/rel"
    assert rootfs.expand("//x//y/", user) == "/x/y"


def test_envd_imports_only_stdlib_and_its_requirements() -> None:
    """The guest copy has no host-side agentenv and no compiled third-party packages."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import agentenv.guest.envd.__main__, agentenv.guest.envd.server, agentenv.guest.envd.inotify\n"
        "top = {m.split('.')[0] for m in sys.modules}\n"
        # __mp_main__ comes from multiprocessing, _distutils_hack from setuptools' .pth in the venv.
        "print(sorted(top - set(sys.stdlib_module_names) - {'__main__', '__mp_main__', '_distutils_hack', 'agentenv'}))\n"
        "print(sorted(m for m in sys.modules if m.startswith('agentenv.') and not m.startswith('agentenv.guest')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    third_party, host_side = out.splitlines()
    assert set(eval(third_party)) <= {"h11"}
    assert eval(host_side) == []
    requirements = (Path(__file__).resolve().parents[2] / "src/agentenv/guest/envd/requirements.txt").read_text()
    pinned = {line.split("==")[0] for line in requirements.splitlines() if "==" in line and not line.startswith("#")}
    assert set(eval(third_party)) <= pinned


def test_busybox_helper_detection() -> None:
    import shutil

    from agentenv.guest.envd.process import busybox_can_switch_user

    assert busybox_can_switch_user("/bin/true") is False
    assert busybox_can_switch_user("/nonexistent/busybox") is False
    busybox = shutil.which("busybox")
    if busybox:
        assert busybox_can_switch_user(busybox) is True


@pytest.mark.parametrize(("text", "expected"), [
    ("2001-01-01T00:00:00Z", 978307200.0),
    ("2001-01-01T00:00:00.123Z", 978307200.123),
    ("2001-01-01T00:00:00.123456789Z", 978307200.123456),  # Go: nanoseconds, cut to micro
    ("2001-01-01T00:00:00.1234567+01:00", 978303600.123456),
    ("2001-01-01T01:00:00.123456-00:30", 978312600.123456),
])
def test_init_timestamp_parsing(text: str, expected: float) -> None:
    from agentenv.guest.envd.app import parse_timestamp

    assert parse_timestamp(text) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("text", ["", "yesterday", "2001-13-01T00:00:00Z", "12.5"])
def test_init_timestamp_malformed(text: str) -> None:
    from agentenv.guest.envd.app import parse_timestamp

    with pytest.raises(ValueError):
        parse_timestamp(text)


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False))
def test_log_line_timestamp(created: float) -> None:
    """The JSON log line's "ts" is the record time to the microsecond, as round(created, 6) was."""
    import json
    import logging

    from agentenv.guest.envd.log import JsonLines

    record = logging.makeLogRecord({"msg": "init %s", "args": ("x",), "created": created, "extra_field": 1})
    line = json.loads(JsonLines().format(record))
    assert list(line)[:4] == ["ts", "level", "logger", "msg"]
    assert line["msg"] == "init x" and line["extra_field"] == 1
    assert abs(line["ts"] - created) <= 1e-6 + 1e-15 * created
