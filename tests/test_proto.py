"""The generated protobuf modules match proto/tierkv.proto, and the wire messages behave."""

from __future__ import annotations

import re
from pathlib import Path

from tierkv.proto import build, tierkv_pb2, tierkv_pb2_grpc

# What names the generator's own version (grpcio-tools, its protobuf), not the proto's content:
# a newer grpcio-tools from the package index writes other numbers there.
TOOL_VERSIONS = (
    (re.compile(r"GRPC_GENERATED_VERSION = '[^']*'"), "GRPC_GENERATED_VERSION = ''"),
    (re.compile(r"# Protobuf Python Version: \S+"), "# Protobuf Python Version:"),
    (re.compile(r"ValidateProtobufRuntimeVersion\([^)]*\)"), "ValidateProtobufRuntimeVersion()"),
)


def content(text: str) -> str:
    for pattern, same in TOOL_VERSIONS:
        text = pattern.sub(same, text)
    return text


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    fresh = build.generate(tmp_path)
    for path in fresh:
        committed = build.HERE / path.name
        assert content(committed.read_text()) == content(path.read_text()), (
            f"{committed} is stale vs {build.SOURCE}: run `make proto`"
        )


def test_only_the_tool_versions_are_masked() -> None:
    code = (build.HERE / "tierkv_pb2_grpc.py").read_text()
    assert content(code) != content(code.replace("def add_TierKVServicer", "def add_Other"))
    assert content(code.replace("GRPC_GENERATED_VERSION = '", "GRPC_GENERATED_VERSION = '9")) == (
        content(code)
    )


def test_package_and_services() -> None:
    svc = tierkv_pb2.DESCRIPTOR.services_by_name["TierKV"]
    assert tierkv_pb2.DESCRIPTOR.package == "tierkv.v1"
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in svc.methods}
    assert methods == {
        "Lookup": (False, False),
        "Put": (True, False),
        "Get": (False, True),
        "GetMany": (False, True),
        "Delete": (False, False),
        "Stats": (False, False),
        "DataPlane": (False, False),
        "Watch": (False, True),
        "Hint": (False, False),
    }
    assert hasattr(tierkv_pb2_grpc, "TierKVStub")


def test_frame_round_trip() -> None:
    f = tierkv_pb2.PutFrame(seq=1, data=b"\x00" * 1000)
    g = tierkv_pb2.PutFrame.FromString(f.SerializeToString())
    assert g.WhichOneof("body") == "data" and g.data == f.data and g.seq == 1
    h = tierkv_pb2.PutFrame(
        seq=0, header=tierkv_pb2.PutHeader(key=b"k" * 16, total_bytes=5, num_frames=1)
    )
    assert tierkv_pb2.PutFrame.FromString(h.SerializeToString()).header.total_bytes == 5
