"""The client's gRPC channel to a cache server and the calls made on it."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from tierkv.cacheserver import wire
from tierkv.proto import tierkv_pb2 as pb
from tierkv.proto import tierkv_pb2_grpc as pb_grpc
from tierkv.storage_backends.sizes import MiB


def channel(
    target: str, tls_ca: str | bytes | None = None, frame_bytes: int = MiB
) -> grpc.aio.Channel:
    """An aio channel to target; TLS when tls_ca (PEM path or bytes) is given."""
    limit = frame_bytes + 128 * 1024
    opts = [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.http2.max_frame_size", (1 << 24) - 1),  # a 1 MiB message in one HTTP/2 frame
        # gRPC's reconnect backoff grows to 120 s by default: after a long outage a client
        # would miss for seconds after the server is back. Retry the connection every <= 1 s.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if tls_ca is None:
        return grpc.aio.insecure_channel(target, options=opts)
    pem = tls_ca if isinstance(tls_ca, bytes) else open(tls_ca, "rb").read()
    return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(pem), options=opts)


@dataclass(slots=True)
class Connection:
    """One channel and the calls made on it."""

    channel: grpc.aio.Channel
    stub: pb_grpc.TierKVStub
    put: grpc.aio.StreamUnaryMultiCallable
    get: grpc.aio.UnaryStreamMultiCallable
    get_many: grpc.aio.UnaryStreamMultiCallable

    @staticmethod
    def open(target: str, tls_ca: str | bytes | None, frame_bytes: int) -> Connection:
        ch = channel(target, tls_ca, frame_bytes)
        # Payload frames go out pre-serialized and are read in place (cacheserver.wire): one
        # copy of the payload each way, not three.
        put = ch.stream_unary(
            "/tierkv.v1.TierKV/Put",
            request_serializer=wire.identity,
            response_deserializer=pb.PutResponse.FromString,
        )
        get = ch.unary_stream(
            "/tierkv.v1.TierKV/Get",
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=wire.parse_frame,
        )
        get_many = ch.unary_stream(
            "/tierkv.v1.TierKV/GetMany",
            request_serializer=pb.GetManyRequest.SerializeToString,
            response_deserializer=wire.parse_frame,
        )
        return Connection(ch, pb_grpc.TierKVStub(ch), put, get, get_many)
