"""Templates from every test image, end to end through the product path (issue 7):

    docker-registry on loopback  <-  the images pushed with plain registry v2 calls
    E2B template build API (the official SDK's `Template().from_image(...)`, or `aenv template
    build --from-image`)  ->  the node pulls and converts the image, boots a build VM from it,
    pauses it into the template's boot snapshot
    `Sandbox.create(template)` on the VM backend  ->  a command runs; files read through envd.

Images: a busybox rootfs (one zstd tar layer), a real debootstrap'ed Debian bookworm root in
two layers (the second deletes a file and a directory, replaces files, empties a directory with
an opaque whiteout), and the hello-world fixture's `amd64` (docker media types, converted) and
`amd64-converted` (overlaybd, used as it is). hello-world has no shell and no /etc/passwd: envd
runs the SDK's `/bin/bash -l -c CMD` with the tools disk's busybox sh (/agentenv/bin/sh) and the
build creates the default user, so `/hello` runs as a command there too.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.template.layercache import CONVERTER_KIND
from tests.template import helpers
from tests.template.conftest import Registry

from . import conftest
from .conftest import NodeProcess

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

NET_PREFIX = "ati"  # unique: a test teardown deletes every {NET_PREFIX}-s* namespace
FIRST_SLOT = 30001  # disjoint from the other VM test modules' slot ranges
CACHE = Path("/var/cache/aenv-test/template-sandboxes")  # converted layers, keyed by content
MEMORY_MB = 256

LAYER2_ISSUE = b"AgentENV layer two \\n \\l\n"
LAYER2_MOTD = b"replaced by the second layer\n"
LAYER2_LIST = b"deb http://deb.debian.org/debian bookworm-backports main\n"


def _hello_bytes() -> bytes:
    layer = helpers.fixture_image("amd64").layer_tars[0]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        member = tar.extractfile("hello")
        assert member is not None
        return member.read()


def _debian_layers() -> tuple[bytes, bytes]:
    """The base template's debootstrap tarball (bookworm minbase + python3, pip, git, curl:
    the VM node made it, or found it cached, when it started) and a second layer over it."""
    from agentenv.guest.build.rootfs import BASE_PACKAGES, debian_root_tarball

    base = debian_root_tarball(BASE_PACKAGES, cache_dir=conftest.DEBIAN_CACHE).read_bytes()
    top = helpers.TarBuilder()
    top.whiteout("usr/bin/curl")  # a file deleted
    top.whiteout("usr/share/doc/curl")  # a directory deleted with everything in it
    top.file("etc/issue", LAYER2_ISSUE)  # replaced
    top.file("etc/motd", LAYER2_MOTD, mode=0o600)  # replaced, other mode
    top.dir("etc/apt/sources.list.d")
    top.opaque("etc/apt/sources.list.d")  # emptied, then refilled
    top.file("etc/apt/sources.list.d/backports.list", LAYER2_LIST)
    top.dir("opt/layer2", mode=0o755, uid=1234, gid=1234)
    top.file("opt/layer2/marker", b"from layer two\n", uid=1234, gid=1234)
    return base, top.bytes()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with conftest.template_build_node(tmp_path_factory.mktemp("tplnode"), NET_PREFIX,
                                      FIRST_SLOT, CACHE / "layer-cache") as node:
        yield node


@pytest.fixture(scope="module")
def api(node: NodeProcess) -> Iterator[httpx.Client]:
    with node.client() as client:
        yield client


def _build_with_sdk(image: str, name: str) -> Any:
    from e2b import Template

    logs: list[str] = []
    t0 = time.monotonic()
    info = Template.build(Template().from_image(image), name, cpu_count=1, memory_mb=MEMORY_MB,
                          skip_cache=True, on_build_logs=lambda e: logs.append(str(e.message)))
    print(f"\n{name}: built in {time.monotonic() - t0:.1f} s")
    assert info.name == name and info.template_id and info.build_id
    assert any("pulled" in line for line in logs), logs[-20:]
    return info


def _status_messages(api: httpx.Client, template_id: str, build_id: str) -> list[str]:
    messages: list[str] = []
    while True:
        answer = api.get(f"/templates/{template_id}/builds/{build_id}/status",
                         params={"logsOffset": len(messages)})
        assert answer.status_code == 200, answer.text
        entries = answer.json()["logEntries"]
        if not entries:
            return messages
        messages += [e["message"] for e in entries]


def _pull_counts(api: httpx.Client, info: Any) -> tuple[int, int, int]:
    """(layers converted, layers cached, overlaybd layers fetched) from the build's log, as the
    status route serves it."""
    for message in _status_messages(api, info.template_id, info.build_id):
        found = re.search(r"^pulled .*: (\d+) layers converted, (\d+) cached, (\d+) overlaybd",
                          message)
        if found:
            return int(found.group(1)), int(found.group(2)), int(found.group(3))
    raise AssertionError("no 'pulled' line in the build's log")


def _run(sbx: Any, cmd: str, **kwargs: Any) -> Any:
    """The first command after a restore is retried for a few seconds, as the reference does."""
    for attempt in range(10):
        try:
            return sbx.commands.run(cmd, **kwargs)
        except Exception:
            if attempt == 9:
                raise
            time.sleep(1)
    raise AssertionError("unreachable")


def test_hello_world_docker_image(node: NodeProcess, registry: Registry, api: httpx.Client) -> None:
    """The `amd64` image (docker v2 media types, gzip layer): converted, built, and /hello in
    the sandbox is the blob's byte for byte, and runs."""
    from e2b import Sandbox

    registry.push("hello-world", "amd64", helpers.fixture_image("amd64"))
    info = _build_with_sdk(f"{registry.host}/hello-world:amd64", "hello-docker")
    # Converted (or found converted in the layer cache, which outlives test runs).
    assert _pull_counts(api, info) in ((1, 0, 0), (0, 1, 0))
    sbx = Sandbox.create(template="hello-docker", timeout=60)
    try:
        assert sbx.files.read("/hello", format="bytes") == _hello_bytes()
        ran = _run(sbx, "/hello")
        assert ran.exit_code == 0 and "Hello from Docker!" in ran.stdout, ran.stdout
        # No shell in the image: the command ran under the tools disk's busybox sh.
        shell = sbx.commands.run("echo $0; test -e /bin/sh || echo no-image-shell")
        assert shell.stdout.split() == ["/agentenv/bin/sh", "no-image-shell"], shell.stdout
    finally:
        sbx.kill()


def test_hello_world_overlaybd_image(node: NodeProcess, registry: Registry,
                                     api: httpx.Client) -> None:
    """The `amd64-converted` image: its overlaybd layer blob is the disk as it is (nothing
    converted); /hello is there byte for byte and runs."""
    from e2b import Sandbox

    registry.push("hello-world", "amd64-converted", helpers.fixture_image("amd64-converted"))
    info = _build_with_sdk(f"{registry.host}/hello-world:amd64-converted", "hello-obd")
    # Nothing converted: the blob is the layer (fetched, or found in the layer cache, which
    # outlives test runs: either way it counts once, and never as converted).
    assert _pull_counts(api, info) in ((0, 0, 1), (0, 1, 0))
    sbx = Sandbox.create(template="hello-obd", timeout=60)
    try:
        assert sbx.files.read("/hello", format="bytes") == _hello_bytes()
        ran = _run(sbx, "/hello")
        assert ran.exit_code == 0 and "Hello from Docker!" in ran.stdout, ran.stdout
    finally:
        sbx.kill()


@pytest.fixture(scope="module")
def debian_image(node: NodeProcess, registry: Registry) -> helpers.BuiltImage:
    image = helpers.build_image(list(_debian_layers()), ["", "gzip"])
    registry.push("debian-two", "v1", image)
    return image


def test_debian_two_layer_image(node: NodeProcess, registry: Registry,
                                debian_image: helpers.BuiltImage) -> None:
    """A real Debian root plus a layer that deletes and replaces: inside the sandbox the deleted
    file and directory are gone, replaced files have the second layer's bytes, bash and
    python3 of the first layer run."""
    from e2b import Sandbox

    _build_with_sdk(f"{registry.host}/debian-two:v1", "debian-two")
    sbx = Sandbox.create(template="debian-two", timeout=60)
    try:
        checks = _run(sbx, "test ! -e /usr/bin/curl && echo curl-gone;"
                           " test ! -e /usr/share/doc/curl && echo doc-gone;"
                           " test -x /usr/bin/git && echo git-kept;"
                           " ls -A /etc/apt/sources.list.d;"
                           " stat -c '%a %u:%g' /etc/motd /opt/layer2 /opt/layer2/marker;"
                           " echo $BASH_VERSION | cut -c1;"
                           " python3 -c 'print(6 * 7)'")
        assert checks.stdout.split("\n")[:-1] == [
            "curl-gone", "doc-gone", "git-kept", "backports.list",
            "600 0:0", "755 1234:1234", "644 1234:1234", "5", "42"], checks.stdout
        assert sbx.files.read("/etc/issue", format="bytes") == LAYER2_ISSUE
        assert sbx.files.read("/etc/motd", format="bytes") == LAYER2_MOTD
        assert sbx.files.read("/etc/apt/sources.list.d/backports.list",
                              format="bytes") == LAYER2_LIST
    finally:
        sbx.kill()


def test_debian_image_as_converted_by_the_node(node: NodeProcess, debian_image: helpers.BuiltImage,
                                               tmp_path: Path) -> None:
    """The node's own conversion of that image (its layer stack under <state>/images, pulled
    by the build above) passes `e2fsck -fn`, and its tree equals `umoci unpack` of the image:
    names, types, modes, owners, sizes, content hashes, link targets, xattrs, mtimes."""
    from agentenv.storage.export import export_raw
    from agentenv.storage.image import Image
    from agentenv.template.convert import loop_mount

    image_json = node.state_dir / "images" / debian_image.digest.replace(":", "-") / "image.json"
    assert image_json.is_file(), "the build did not record the pulled image"
    raw = tmp_path / "debian.raw"
    with Image.open(image_json, writable=False) as image:
        export_raw(image, raw)
    check = subprocess.run(["e2fsck", "-fn", str(raw)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    expected = helpers.reference_unpack(debian_image, tmp_path / "bundle", tmp_path)
    with loop_mount(raw, tmp_path / "mnt", readonly=True) as root:
        helpers.assert_same_tree(root, expected)
        assert not (root / "usr/bin/curl").exists() and (root / "usr/bin/git").is_file()
    raw.unlink()
    helpers.rmtree(tmp_path / "bundle")


def test_busybox_image_with_the_cli(node: NodeProcess, registry: Registry) -> None:
    """`aenv template build NAME --from-image REF` (the CLI's path through the same API) on a
    busybox rootfs image; the sandbox's commands find the image's busybox applets."""
    from e2b import Sandbox

    layer = helpers.busybox_layer()
    registry.push("busybox", "v1", helpers.build_image([layer], ["zstd"]))
    built = subprocess.run(
        [sys.executable, "-m", "agentenv.cli.main", "template", "--api-url", node.url,
         "--api-key", node.api_key, "build", "busybox-cli", "--from-image",
         f"{registry.host}/busybox:v1", "--cpu", "1", "--memory", str(MEMORY_MB)],
        capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("E2B_")})
    assert built.returncode == 0, built.stderr[-3000:]
    assert "ready" in built.stderr and "pulled" in built.stderr, built.stderr[-3000:]
    sbx = Sandbox.create(template="busybox-cli", timeout=60)
    try:
        busybox_sum = hashlib.sha256(Path("/bin/busybox").read_bytes()).hexdigest()
        ran = _run(sbx, "sha256sum /bin/busybox; readlink /bin/ls; cat /etc/group; whoami")
        assert ran.stdout.split("\n")[:-1] == [
            f"{busybox_sum}  /bin/busybox", "busybox", "root:x:0:", "user:x:1000:", "user"
        ], ran.stdout
    finally:
        sbx.kill()


def test_bad_images_fail_the_build_and_leave_nothing(node: NodeProcess, registry: Registry,
                                                     api: httpx.Client) -> None:
    """A missing tag and a corrupt gzip layer end the build with a clear reason at the `base`
    step (the SDK raises it); no template is registered, no build VM boots, and neither the
    layer cache nor the node's images keep a half-built entry."""
    import gzip

    from e2b import Template
    from e2b.exceptions import BuildException

    good = helpers.TarBuilder().file("ok", b"ok").bytes()
    bad_tar = helpers.TarBuilder().file("big", os.urandom(300_000)).bytes()
    truncated = gzip.compress(bad_tar)[:-5000]
    image = helpers.build_image([good, bad_tar])
    image.replace_layer_blob(1, truncated)
    registry.push("broken", "gz", image)
    cache = CACHE / "layer-cache"
    entries_before = {p.name for p in (cache / CONVERTER_KIND).glob("*")}

    for ref, name, expected in ((f"{registry.host}/broken:missing", "bad-tag", "not found"),
                                (f"{registry.host}/broken:gz", "bad-gzip", "corrupt")):
        with pytest.raises(BuildException) as raised:
            Template.build(Template().from_image(ref), name, cpu_count=1, memory_mb=MEMORY_MB,
                           skip_cache=True)
        assert expected in str(raised.value), str(raised.value)
        assert Template.exists(name) is False
        listed = {t["names"][0]: t for t in api.get("/templates").json()}
        assert listed[name]["buildStatus"] == "error"
        status = api.get(f"/templates/{listed[name]['templateID']}/builds/"
                         f"{listed[name]['buildID']}/status").json()
        assert status["reason"]["step"] == "base" and expected in status["reason"]["message"]
        messages = _status_messages(api, listed[name]["templateID"], listed[name]["buildID"])
        assert not any("booting the build VM" in m for m in messages), messages
        assert api.post("/v2/sandboxes", json={"templateID": name}).status_code in (400, 404)
        assert api.delete(f"/templates/{listed[name]['templateID']}").status_code == 204
    # Only the good first layer of the corrupt image may have joined the cache.
    new_entries = {p.name for p in (cache / CONVERTER_KIND).glob("*")} - entries_before
    assert len(new_entries) <= 1, new_entries
    assert list((cache / "work").glob("*")) == []
    assert list((cache / "blobs").glob("*")) == []
    images = node.state_dir / "images"
    assert not (images / image.digest.replace(":", "-")).exists()
    assert [p.name for p in images.glob(".*")] == []  # no image record half written
