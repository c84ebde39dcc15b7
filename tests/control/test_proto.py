"""The committed generated code (control/proto/*_pb2*.py[i]) matches the .proto files: run
`make proto` after editing a .proto."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "src" / "agentenv" / "control" / "proto"


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a test dependency")
    protos = sorted(PROTO_DIR.glob("*.proto"))
    assert protos, f"no .proto files in {PROTO_DIR}"
    src = tmp_path / "src"
    target = src / "agentenv" / "control" / "proto"
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
        assert (target / name).read_bytes() == (PROTO_DIR / name).read_bytes(), (
            f"{name} does not match the .proto: run `make proto`"
        )


def test_the_stubs_import_and_round_trip() -> None:
    from agentenv.control.proto import scheduler_pb2 as pb
    from agentenv.control.proto import scheduler_pb2_grpc as pb_grpc

    msg = pb.NodeStatus(node_id="n", cpu_total=4)
    msg.template_layers.add(template_id="t", layers=["a", "b"])
    assert pb.NodeStatus.FromString(msg.SerializeToString()) == msg
    assert hasattr(pb_grpc, "SchedulerStub")
