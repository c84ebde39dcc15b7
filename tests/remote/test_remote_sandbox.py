"""A sandbox from a remote 1 GiB overlaybd image on a VM node with an empty chunk cache: the
E2B template build boots from the remote layer, the sandbox reads files through the guest's
ext4, and the node's blockd fetched a small part of the image (docs/remote-layers.md)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentenv.blockd.client import BlockdClient
from tests.node import conftest as node_conftest
from tests.node.conftest import NodeProcess
from tests.remote import bigimage
from tests.template.conftest import Registry

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]

NET_PREFIX = "arl"  # unique: a test teardown deletes every {NET_PREFIX}-s* namespace
FIRST_SLOT = 29501  # disjoint from the other VM test modules (29001-29400, 30001, ...)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("rlnode")
    # No background completion: what is fetched is what the build and the sandbox read.
    proc = node_conftest.vm_node_process(base / "state", base / "node.log", NET_PREFIX,
                                         FIRST_SLOT, {**node_conftest.NO_READY_POOLS,
                                                      "AENV_REMOTE_BACKGROUND_BW": "0",
                                                      "AENV_LAYER_CACHE": str(base / "lc")})
    with node_conftest.serving_vm_node(proc, NET_PREFIX):
        yield proc


def _run(sbx: Any, cmd: str) -> Any:
    for attempt in range(10):
        try:
            return sbx.commands.run(cmd)
        except Exception:
            if attempt == 9:
                raise
            time.sleep(1)
    raise AssertionError("unreachable")


def test_sandbox_from_a_remote_image_fetches_little(node: NodeProcess, registry: Registry) -> None:
    from e2b import Sandbox, Template

    image = bigimage.build()
    bigimage.push(image, registry.host, "big", "v1")
    Template.build(Template().from_image(f"{registry.host}/big:v1"), "big-remote", cpu_count=1,
                   memory_mb=256, skip_cache=True)
    sbx = Sandbox.create(template="big-remote", timeout=120)
    try:
        assert _run(sbx, "cat /hello.txt").stdout == bigimage.SMALL_FILES["hello.txt"].decode()
        digest = _run(sbx, "sha256sum /data/medium.bin").stdout.split()[0]
        assert digest == image.medium_sha256
    finally:
        sbx.kill()
    sock = Path(node.state_dir) / "vm-backend" / "blockd" / "blockd.sock"
    with BlockdClient(sock) as client:
        stats = client.call("remote_stats")
    fetched = sum(stats["fetched_bytes"].values())
    assert 0 < fetched < image.blob_size // 10, stats
    assert stats["eio"] == 0
