"""The generated protobuf modules match proto/tierkv.proto, and the wire messages behave."""

from __future__ import annotations

from pathlib import Path

from tierkv.proto import build, tierkv_pb2, tierkv_pb2_grpc


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    fresh = build.generate(tmp_path)
    for path in fresh:
        committed = build.HERE / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale vs {build.SOURCE}: run `make proto`"
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
