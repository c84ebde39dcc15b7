"""`pull_image` end to end: a real registry, blockd's FUSE files, ext4 checked by e2fsck and
compared file by file with umoci / tar -x of the same image."""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.registry.errors import DigestMismatchError, NotFoundError, UnsupportedImageError
from agentenv.storage.export import export_raw
from agentenv.storage.image import Image
from agentenv.template.convert import loop_mount
from agentenv.template.errors import LayerApplyError
from agentenv.template.layercache import CONVERTER_KIND
from agentenv.template.pull import PulledImage, pull_image
from tests.template import helpers
from tests.template.conftest import Registry

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture
def state(tmp_path: Path, no_docker_config: Path) -> Path:
    return tmp_path / "state"


def _pull(registry: Registry, ref: str, state: Path, blockd: Path, **kw: object) -> PulledImage:
    return pull_image(f"{registry.host}/{ref}", state_dir=state, blockd=blockd, **kw)  # type: ignore[arg-type]


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[callable]:  # type: ignore[valid-type]
    """Export a pulled image to a raw disk, e2fsck it, mount it read-only; yields the root."""
    stack: list[object] = []

    def mount(pulled: PulledImage, fsck: bool = True) -> Path:
        raw = tmp_path / f"{pulled.name}.raw"
        with Image.open(pulled.image_json, writable=False) as image:
            export_raw(image, raw)
        if fsck:
            check = subprocess.run(["e2fsck", "-fn", str(raw)], capture_output=True, text=True)
            assert check.returncode == 0, check.stdout + check.stderr
        ctx = loop_mount(raw, tmp_path / f"mnt-{pulled.name}", readonly=True)
        stack.append(ctx)
        root = ctx.__enter__()
        # loop_mount mounts noexec (a layer is untrusted data on the host); these tests run the
        # image's own busybox in a chroot on purpose.
        subprocess.run(["mount", "-o", "remount,exec", str(root)], check=True)
        return root

    yield mount
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)  # type: ignore[attr-defined]


def _cache_entries(state: Path) -> list[str]:
    root = state / "layer-cache"
    return sorted(str(p.relative_to(root)) for kind in (CONVERTER_KIND, "overlaybd")
                  for p in (root / kind).iterdir()) if root.exists() else []


def _assert_no_leftovers(state: Path) -> None:
    root = state / "layer-cache"
    assert list((root / "work").iterdir()) == []
    assert list((root / "blobs").iterdir()) == []
    assert [p.name for p in (state / "images").iterdir() if p.name.startswith(".")] == []


def _hello_bytes() -> bytes:
    layer = helpers.fixture_image("amd64").layer_tars[0]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        return tar.extractfile("hello").read()  # type: ignore[union-attr]


def test_hello_world_docker_image(registry: Registry, state: Path, blockd: Path, mounted, tmp_path: Path) -> None:
    image = helpers.fixture_image("amd64")
    registry.push("hello-world", "amd64", image)
    pulled = _pull(registry, "hello-world:amd64", state, blockd, name="hello")
    assert pulled.format == "converted" and pulled.layers_converted == 1
    record = json.loads(pulled.image_json.read_text())
    assert [lower["file"] for lower in record["lowers"]] == [str(p) for p in pulled.lowers]
    diff_id = json.loads(image.blobs[json.loads(image.manifest)["config"]["digest"]])["rootfs"]["diff_ids"][0]
    base, layer = record["lowers"]
    assert base["digest"] == helpers.digest_of(Path(base["file"]).read_bytes())  # the ext4 base
    assert layer["chainId"] == diff_id  # a one-layer chain: the chain ID is the diff ID
    assert record["config"]["cmd"] == ["/hello"]
    assert record["manifestDigest"] == image.digest
    assert (pulled.path / "config.json").read_bytes() in image.blobs.values()
    # Every layer of the stack is a 64 GiB virtual disk, and the ext4 on it spans all of it.
    from agentenv.storage.layer import inspect_layer

    assert {inspect_layer(p)["virtual_size"] for p in pulled.lowers} == {64 << 30}
    root = mounted(pulled)
    fs = os.statvfs(root)
    assert fs.f_blocks * fs.f_frsize > 60 << 30
    assert sum(p.stat().st_blocks * 512 for p in pulled.lowers) < 64 << 20  # sparse layers
    assert (root / "hello").read_bytes() == _hello_bytes()
    expected = tmp_path / "expected"
    expected.mkdir()
    subprocess.run(["tar", "-x", "--numeric-owner", "--same-permissions", "-C", str(expected)],
                   input=image.layer_tars[0], check=True)
    helpers.assert_same_tree(root, expected)
    _assert_no_leftovers(state)


def test_hello_world_overlaybd_image_used_as_is(registry: Registry, state: Path, blockd: Path, mounted,
                                                tmp_path: Path) -> None:
    image = helpers.fixture_image("amd64-converted")
    registry.push("hello-world", "amd64-converted", image)
    # Downloaded whole (the default leaves it in the registry: tests/remote).
    pulled = _pull(registry, "hello-world:amd64-converted", state, blockd, lazy=False)
    assert pulled.format == "overlaybd" and pulled.name == image.digest.replace(":", "-")
    # Fetched and used as it is: never counted as converted (the node's build log says so).
    assert (pulled.layers_converted, pulled.layers_fetched, pulled.layers_cached) == (0, 1, 0)
    [blob_digest] = [d for d in image.blobs if d.startswith("sha256:0222")]
    assert pulled.lowers[0].read_bytes() == image.blobs[blob_digest]
    # Not e2fsck'd: this ext4 is the reference converter's, not ours. (e2fsck -fn flags an
    # HTREE index on its lost+found, and takes 12-30 s over its 4M initialised inodes; the
    # blob reads byte-identical to TV10's digests (docs/overlaybd.md §11), so that is how the
    # blob is.)
    root = mounted(pulled, fsck=False)
    assert (root / "hello").read_bytes() == _hello_bytes()
    # Its tree is the docker image's layer, unpacked by tar -x.
    expected = tmp_path / "expected"
    expected.mkdir()
    subprocess.run(["tar", "-x", "--numeric-owner", "--same-permissions", "-C", str(expected)],
                   input=helpers.fixture_image("amd64").layer_tars[0], check=True)
    helpers.assert_same_tree(root, expected)
    again = _pull(registry, "hello-world:amd64-converted", state, blockd)
    assert again.layers_cached == 1 and again.bytes_downloaded == 0  # the whole blob is used


def test_two_layer_image_and_shared_base(registry: Registry, state: Path, blockd: Path, mounted,
                                         tmp_path: Path) -> None:
    base, top = helpers.debian_like_layers()
    image = helpers.build_image([base, top], ["gzip", "zstd"])
    registry.push("debianish", "v1", image)
    pulled = _pull(registry, "debianish:v1", state, blockd, name="deb")
    assert pulled.layers_converted == 2
    expected = helpers.reference_unpack(image, tmp_path / "bundle", tmp_path)
    helpers.assert_same_tree(mounted(pulled), expected)

    # Another image on the same base: the base layer is neither fetched nor converted.
    other_top = helpers.TarBuilder().file("etc/other", b"other").whiteout("bin/tool").bytes()
    other = helpers.build_image([base, other_top], ["gzip", ""])
    registry.push("debianish", "v2", other)
    base_digest = json.loads(image.manifest)["layers"][0]["digest"]
    mark = registry.log_mark()
    pulled2 = _pull(registry, "debianish:v2", state, blockd, name="deb2")
    requests = registry.requests_since(mark)
    assert pulled2.layers_cached == 1 and pulled2.layers_converted == 1
    assert pulled2.lowers[:2] == pulled.lowers[:2] and len(pulled2.lowers) == 3  # base, shared, new
    assert not [r for r in requests if base_digest in r], requests
    assert [r for r in requests if "/blobs/" in r and "GET" in r]  # the new layer was fetched
    expected2 = helpers.reference_unpack(other, tmp_path / "bundle2", tmp_path / "w2")
    helpers.assert_same_tree(mounted(pulled2), expected2)

    # The same image again: no blob at all is fetched but its config.
    mark = registry.log_mark()
    pulled3 = _pull(registry, "debianish:v1", state, blockd, name="deb")
    blob_gets = [r for r in registry.requests_since(mark) if "/blobs/" in r]
    assert pulled3.layers_converted == 0 and len(blob_gets) == 1
    _assert_no_leftovers(state)


def test_busybox_image_from_index(registry: Registry, state: Path, blockd: Path, mounted,
                                  tmp_path: Path) -> None:
    layer = helpers.busybox_layer()
    image = helpers.build_image([layer], ["zstd"], {"Cmd": ["/bin/sh"], "WorkingDir": "/tmp"})
    decoy = helpers.build_image([helpers.TarBuilder().file("arm", b"arm").bytes()])
    registry.push("busybox", "amd64-only", image)
    registry.push("busybox", "arm64-only", decoy)
    helpers.push_index(registry.host, "busybox", "latest",
                       [(decoy, {"os": "linux", "architecture": "arm64"}),
                        (image, {"os": "linux", "architecture": "amd64"})])
    pulled = _pull(registry, "busybox", state, blockd, name="busybox")
    assert pulled.manifest_digest == image.digest
    assert json.loads(pulled.image_json.read_text())["config"]["workingDir"] == "/tmp"
    root = mounted(pulled)
    expected = tmp_path / "expected"
    expected.mkdir()
    subprocess.run(["tar", "-x", "--numeric-owner", "--same-permissions", "-C", str(expected)],
                   input=layer, check=True)
    helpers.assert_same_tree(root, expected)
    out = subprocess.run(["chroot", str(root), "/bin/sh", "-c", "echo ok"], capture_output=True, text=True)
    assert out.stdout.strip() == "ok"


def test_same_layer_pulled_twice_at_once_is_done_once(registry: Registry, state: Path, blockd: Path) -> None:
    layer = helpers.TarBuilder().file("big", bytes(range(256)) * 20000).dir("d").bytes()
    image = helpers.build_image([layer])
    registry.push("twice", "v1", image)
    mark = registry.log_mark()
    results: list[PulledImage | BaseException] = []

    def run(name: str) -> None:
        try:
            results.append(_pull(registry, "twice:v1", state, blockd, name=name))
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("same", "same")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(r, PulledImage) for r in results), results
    layer_digest = json.loads(image.manifest)["layers"][0]["digest"]
    gets = [r for r in registry.requests_since(mark) if layer_digest in r]
    assert len(gets) == 1, gets
    assert sorted(r.layers_converted for r in results) == [0, 1]  # type: ignore[union-attr]


def test_failures_leave_nothing_behind(registry: Registry, state: Path, blockd: Path) -> None:
    good = helpers.TarBuilder().file("ok", b"ok").bytes()
    bad_tar = helpers.TarBuilder().file("big", bytes(range(256)) * 40 + os.urandom(200_000)).bytes()
    bad_blob = gzip.compress(bad_tar)[:-5000]  # a truncated gzip stream
    image = helpers.build_image([good, bad_tar], ["gzip", "gzip"])
    image.replace_layer_blob(1, bad_blob)
    registry.push("broken", "gz", image)
    with pytest.raises(LayerApplyError, match="corrupt archive"):
        _pull(registry, "broken:gz", state, blockd, name="broken")
    assert not (state / "images" / "broken").exists()
    assert len(_cache_entries(state)) == 1  # the good first layer only
    _assert_no_leftovers(state)

    with pytest.raises(NotFoundError, match="broken:nope"):
        _pull(registry, "broken:nope", state, blockd)

    odd = helpers.build_image([good])
    body = json.loads(odd.manifest)
    body["layers"][0]["mediaType"] = "application/vnd.example.squashfs"
    odd.manifest = json.dumps(body).encode()
    registry.push("odd", "v1", odd)
    mark = registry.log_mark()
    with pytest.raises(UnsupportedImageError, match="squashfs"):
        _pull(registry, "odd:v1", state, blockd)
    assert not [r for r in registry.requests_since(mark) if body["layers"][0]["digest"] in r]

    flipped = helpers.build_image([helpers.TarBuilder().file("f", b"flip" * 5000).bytes()])
    registry.push("flipped", "v1", flipped)
    digest = json.loads(flipped.manifest)["layers"][0]["digest"].split(":")[1]
    data_file = registry.log.parent / "data/docker/registry/v2/blobs/sha256" / digest[:2] / digest / "data"
    data = bytearray(data_file.read_bytes())
    data[100] ^= 1
    data_file.write_bytes(bytes(data))
    with pytest.raises(DigestMismatchError):
        _pull(registry, "flipped:v1", state, blockd, name="flipped")
    assert not (state / "images" / "flipped").exists()
    assert len(_cache_entries(state)) == 1
    _assert_no_leftovers(state)


def test_progress_bars_for_download_and_conversion(registry: Registry, state: Path,
                                                   blockd: Path) -> None:
    """With progress on, each layer gets a download bar and a conversion bar, both complete."""
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=160)
    layers = [helpers.TarBuilder().file("a", os.urandom(400_000)).bytes(),
              helpers.TarBuilder().file("b", os.urandom(300_000)).bytes()]
    image = helpers.build_image(layers, ["gzip", "zstd"])
    registry.push("progress", "v1", image)
    _pull(registry, "progress:v1", state, blockd, progress=True, console=console)
    text = out.getvalue()
    for layer in json.loads(image.manifest)["layers"]:
        short = layer["digest"].split(":")[1][:12]
        size = f"{layer['size'] / 1e3:.1f}"  # rich's DownloadColumn: kB below 1 MB
        for what in ("download", "convert "):
            [line] = [ln for ln in text.splitlines() if ln.startswith(f"{what} {short}")]
            assert f"{size}/{size} kB" in line, text  # the bar ran to the layer's size
    assert _pull(registry, "progress:v1", state, blockd).layers_converted == 0


def test_pull_with_basic_auth(auth_registry: Registry, tmp_path: Path, blockd: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    image = helpers.build_image([helpers.TarBuilder().file("secret", b"s").bytes()])
    auth_registry.push("private/app", "v1", image)
    config = tmp_path / "docker" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"auths": {auth_registry.host: {
        "auth": base64.b64encode(b"aenv:s3cret-pw").decode()}}}))
    pulled = pull_image(f"{auth_registry.host}/private/app:v1", state_dir=tmp_path / "state",
                        blockd=blockd, docker_config=config, name="app")
    assert pulled.layers_converted == 1


def test_cli_pull(registry: Registry, tmp_path: Path, blockd: Path, no_docker_config: Path) -> None:
    import sys

    registry.push("hello-world", "amd64", helpers.fixture_image("amd64"))
    base = [sys.executable, "-m", "agentenv.cli.main", "pull", "--state-dir", str(tmp_path / "s"),
            "--blockd", str(blockd), "--no-register"]
    ok = subprocess.run([*base, "-q", "--name", "hw", f"{registry.host}/hello-world:amd64"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str(tmp_path / "s" / "images" / "hw")
    assert json.loads((tmp_path / "s/images/hw/image.json").read_text())["config"]["cmd"] == ["/hello"]
    for ref, message in ((f"{registry.host}/hello-world:missing", "not found"),
                         ("UPPER:case", "invalid image reference")):
        bad = subprocess.run([*base, ref], capture_output=True, text=True)
        assert bad.returncode == 1
        assert message in bad.stderr and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
