"""`aenv layer ...` / `aenv image ...` end to end (through click's runner, one real subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from agentenv.cli.main import cli
from agentenv.storage.image import Image
from tests.storage.vectors import FIXTURE_BLOB, sha256_file

AENV = Path(sys.executable).parent / "aenv"


def _run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_inspect_kinds(tmp_path: Path) -> None:
    facts = json.loads(_run("layer", "inspect", str(FIXTURE_BLOB)))
    assert facts["kind"] == "tar" and facts["inner_kind"] == "zfile"
    assert facts["index_entries"] == 515 and facts["virtual_size"] == 64 << 30
    image = Image.create([], tmp_path / "up", virtual_size=1 << 20)
    image.write(0, b"a" * 8192)
    image.discard(8192, 4096)
    image.close()
    for target in (tmp_path / "up", tmp_path / "up/upper.data"):
        facts = json.loads(_run("layer", "inspect", str(target)))
        assert facts["kind"] == "upper"
        assert facts["index_entries"] == 2 and facts["data_size"] == 8192
        assert facts["virtual_size"] == 1 << 20
    out = tmp_path / "c.zst"
    _run("layer", "commit", str(tmp_path / "up"), str(out), "--compress", "zstd")
    facts = json.loads(_run("layer", "inspect", str(out)))
    assert facts["kind"] == "zfile" and facts["zfile"]["algorithm"] == "zstd"
    assert facts["index_entries"] == 2 and facts["data_size"] == 8192
    out2 = tmp_path / "c.tar"
    _run("layer", "commit", str(tmp_path / "up"), str(out2), "--tar")
    facts = json.loads(_run("layer", "inspect", str(out2)))
    assert facts["kind"] == "tar" and facts["inner_kind"] == "sealed"


def test_import_export_round_trip(tmp_path: Path) -> None:
    raw = tmp_path / "disk.raw"
    with open(raw, "wb") as f:
        f.truncate(64 << 20)
        for pos in (0, 5 << 20, (64 << 20) - 8192):
            f.seek(pos)
            f.write(os.urandom(8192))
        f.seek(10 << 20)
        f.write(bytes(1 << 20))  # written zeros: must not become data
    layer = tmp_path / "disk.layer"
    proc = subprocess.run([str(AENV), "image", "import", str(raw), str(layer), "--compress",
                           "lz4", "--tar"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(_run("layer", "inspect", str(layer)))
    assert facts["data_size"] == 3 * 8192
    assert facts["virtual_size"] == 64 << 20
    out = tmp_path / "out.raw"
    _run("image", "export", str(layer), str(out))
    assert sha256_file(out) == sha256_file(raw)
    assert os.stat(out).st_blocks * 512 <= 1 << 20  # sparse
