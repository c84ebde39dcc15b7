"""A pull that cannot fit is refused before anything is downloaded or written (a real small
tmpfs as the state directory, a real registry on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.fsutil import InsufficientSpace
from agentenv.template.convert import private_blockd, start_private
from agentenv.template.pull import pull_image
from tests.template import helpers
from tests.template.conftest import Registry, needs_root

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture
def small_state(tmp_path: Path) -> Iterator[Path]:
    needs_root()
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "aenv-test", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
                  and not p.name.endswith(".lock"))


def test_pull_that_cannot_fit_is_refused_before_downloading(
        registry: Registry, small_state: Path, tmp_path_factory: pytest.TempPathFactory,
        no_docker_config: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_DISK_RESERVE", str(1 << 20))
    big = helpers.TarBuilder().file("noise", os.urandom(16 << 20)).bytes()  # incompressible
    image = helpers.build_image([big], ["gzip"])
    registry.push("space/big", "v1", image)
    layer_digest = json.loads(image.manifest)["layers"][0]["digest"]
    mark = registry.log_mark()
    blockd = private_blockd(tmp_path_factory.mktemp("bd"))
    try:
        with pytest.raises(InsufficientSpace, match=r"not enough free disk space for pulling .*"
                           r"space/big:v1 \(16\.\d MiB to download and convert\)"):
            pull_image(f"{registry.host}/space/big:v1", state_dir=small_state / "state",
                       blockd=start_private(blockd))
    finally:
        blockd.stop()
    assert not [r for r in registry.requests_since(mark) if layer_digest in r]
    # Nothing downloaded, converted or recorded; the shared empty-ext4 base layer (a complete
    # cache entry every conversion starts from) may have been made.
    left = [f for f in _files(small_state) if not f.startswith("state/layer-cache/base/")]
    assert left == [], left
