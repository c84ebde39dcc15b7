"""The committed generated code (scheduling/proto/*_pb2*.py[i]) matches the .proto files: run
`make proto` after editing a .proto."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "src" / "agentenv" / "scheduling" / "proto"


# The generator writes its own version into the code (a comment, the minimum grpcio and
# protobuf runtimes it checks); a newer patch release of grpcio-tools on the test machine is
# not a change of the .proto, so those version numbers are left out of the comparison.
_VERSIONS = [
    re.compile(rb"^(GRPC_GENERATED_VERSION = ).*$", re.M),
    re.compile(rb"^(# Protobuf Python Version: ).*$", re.M),
    re.compile(rb"(_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,"),
]


def _code(path: Path) -> bytes:
    text = path.read_bytes()
    for version in _VERSIONS:
        text = version.sub(rb"\1<version>", text)
    return text


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a test dependency")
    protos = sorted(PROTO_DIR.glob("*.proto"))
    assert protos, f"no .proto files in {PROTO_DIR}"
    src = tmp_path / "src"
    target = src / "agentenv" / "scheduling" / "proto"
    target.mkdir(parents=True)
    for proto in protos:
        shutil.copy(proto, target / proto.name)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{src}", f"--python_out={src}",
         f"--grpc_python_out={src}", f"--pyi_out={src}",
         *(str(target / p.name) for p in protos)],
        check=True, capture_output=True,
    )
    generated = sorted(p.name for p in target.iterdir() if p.suffix != ".proto")
    committed = sorted(p.name for p in PROTO_DIR.iterdir() if "_pb2" in p.name)
    assert generated == committed, "run `make proto`: generated files differ in name"
    for name in generated:
        assert _code(target / name) == _code(PROTO_DIR / name), (
            f"{name} does not match the .proto: run `make proto`"
        )


def test_the_stubs_import_and_round_trip() -> None:
    from agentenv.scheduling.proto import scheduler_pb2 as pb
    from agentenv.scheduling.proto import scheduler_pb2_grpc as pb_grpc

    msg = pb.NodeStatus(node_id="n", cpu_total=4)
    msg.template_layers.add(template_id="t", layers=["a", "b"])
    assert pb.NodeStatus.FromString(msg.SerializeToString()) == msg
    assert hasattr(pb_grpc, "SchedulerStub")
