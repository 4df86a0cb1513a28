"""RemoteTier: the cache server's gRPC client, as a storage Tier.

    tier = RemoteTier(target="10.0.0.5:50051", token="s3cret-token", tls_ca="ca.pem")
    await tier.put(key, segment); seg = await tier.get(key)
    async for chunk in tier.get_layers(key): ...   # each layer as soon as its frames land

Safety contract: one channel, reused by every call; each call has a deadline; UNAVAILABLE
is retried with backoff (a Put resends its whole stream, so nothing is half-stored); any
other failure is a miss or False, counted and logged, never an exception to the caller
(bad arguments still raise ValueError). Every layer is checked against its checksum
before it is handed out. The namespace is the one the server maps this tier's token to;
the `ns` arguments are checked for form and otherwise left to the server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from tierkv.cacheserver import wire
from tierkv.cacheserver.auth import bearer
from tierkv.cacheserver.frames import Assembly, put_wire
from tierkv.proto import tierkv_pb2 as pb
from tierkv.proto import tierkv_pb2_grpc as pb_grpc
from tierkv.storage_backends.base import (
    DEFAULT_NAMESPACE,
    Latency,
    LayerChunk,
    Tier,
    TierStats,
    check_key,
    check_namespace,
)
from tierkv.storage_backends.buffers import copy_into
from tierkv.storage_backends.segment import KVSegment, SegmentError, decode_layer

log = logging.getLogger("tierkv.remote")
MiB = 1 << 20
LOOKUP_BATCH = 1024  # keys per Lookup call in contains()


def _identity(b: bytes) -> bytes:
    return b


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


@dataclass(slots=True, eq=False)
class RemoteTier(Tier):
    target: str  # "host:port" of a tierkv-server
    token: str | None = None  # bearer token (the server maps it to a namespace)
    tls_ca: str | bytes | None = None  # CA certificate (PEM path or bytes): TLS on
    timeout_s: float = 30.0  # deadline of each call
    retries: int = 3  # extra attempts on UNAVAILABLE
    backoff_s: float = 0.05  # first pause between attempts; doubles
    frame_bytes: int = MiB  # payload frame size of puts
    max_segment_bytes: int = 1 << 30  # largest segment accepted from the server
    name: str = "remote"
    _channel: grpc.aio.Channel | None = None
    _stub: pb_grpc.TierKVStub | None = None
    _put: grpc.aio.StreamUnaryMultiCallable | None = None
    _get: grpc.aio.UnaryStreamMultiCallable | None = None
    _stats: TierStats = field(default_factory=lambda: TierStats(name="remote", device="grpc"))
    _get_lat: Latency = field(default_factory=Latency)
    _put_lat: Latency = field(default_factory=Latency)
    _last_log: float = -1e9

    @property
    def stub(self) -> pb_grpc.TierKVStub:
        if self._stub is None:  # made on first use, inside the caller's event loop
            self._channel = channel(self.target, self.tls_ca, self.frame_bytes)
            self._stub = pb_grpc.TierKVStub(self._channel)
            # Payload frames go out pre-serialized and are read in place (cacheserver.wire):
            # one copy of the payload each way, not three.
            self._put = self._channel.stream_unary(
                "/tierkv.v1.TierKV/Put",
                request_serializer=_identity,
                response_deserializer=pb.PutResponse.FromString,
            )
            self._get = self._channel.unary_stream(
                "/tierkv.v1.TierKV/Get",
                request_serializer=pb.GetRequest.SerializeToString,
                response_deserializer=wire.parse_frame,
            )
        return self._stub

    def _opts(self) -> dict:
        return {"timeout": self.timeout_s, "metadata": bearer(self.token)}

    def _fail(self, op: str, e: BaseException) -> None:
        self._stats.errors += 1
        now = time.monotonic()
        if now - self._last_log >= 10.0:  # one line per interval, not one per call
            self._last_log = now
            msg = e.details() if isinstance(e, grpc.aio.AioRpcError) else e
            log.warning("remote tier %s: %s failed (%s): miss", self.target, op, msg)

    async def _retry(self, op: str, fn):
        """fn() with retries on UNAVAILABLE; None (a miss) on any failure."""
        pause = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return await fn()
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.retries:
                    self._fail(op, e)
                    return None
            except (SegmentError, ValueError, OSError) as e:
                self._fail(op, e)
                return None
            await asyncio.sleep(pause)
            pause *= 2
        return None

    def _frames(self, req: pb.GetRequest):
        self.stub  # noqa: B018  (makes the channel and self._get)
        return self._get(req, **self._opts())

    async def lookup(
        self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE
    ) -> pb.LookupResponse | None:
        """The server's full answer: presence, tier of each key, present prefix length."""
        check_namespace(ns)
        req = pb.LookupRequest(keys=[check_key(k) for k in keys])
        return await self._retry("lookup", lambda: self.stub.Lookup(req, **self._opts()))

    async def contains(self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE) -> list[bool]:
        found: list[bool] = []
        for i in range(0, len(keys), LOOKUP_BATCH):  # within the server's max_keys
            r = await self.lookup(keys[i : i + LOOKUP_BATCH], ns)
            found += list(r.present) if r is not None else [False] * len(keys[i : i + LOOKUP_BATCH])
        return found

    async def get(self, key: bytes, ns: str = DEFAULT_NAMESPACE, out=None) -> KVSegment | None:
        check_namespace(ns)
        req = pb.GetRequest(key=check_key(key))
        t0 = time.perf_counter()

        async def run() -> KVSegment | None:
            asm = None
            async for f in self._frames(req):
                if f.kind == pb.SegmentFrame.MISS:
                    return None
                if asm is None:  # frames land in `out` itself when they can
                    asm = Assembly.start(f, self.max_segment_bytes, out=out)
                else:
                    asm.add(f)
            return asm.segment() if asm is not None and asm.done else None

        seg = await self._retry("get", run)
        if seg is None or seg.key != key:
            self._stats.misses += 1
            return None
        if out is not None and not _views(seg.payload, out):
            seg = copy_into(seg, seg.header(), out)
        self._stats.hits += 1
        self._stats.bytes_out += seg.nbytes
        self._get_lat.add(time.perf_counter() - t0)
        return seg

    async def get_layers(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE
    ) -> AsyncIterator[LayerChunk]:
        check_namespace(ns)
        req = pb.GetRequest(key=check_key(key))
        for attempt in range(self.retries + 1):
            yielded = False
            try:
                asm = None
                async for f in self._frames(req):
                    if f.kind == pb.SegmentFrame.MISS:
                        break
                    if asm is None:
                        asm = Assembly.start(f, self.max_segment_bytes, per_layer=True)
                        if asm.header.key != key:
                            raise SegmentError("server sent a segment with another key")
                        continue
                    done = asm.add(f)
                    if done is not None:
                        data = asm.layer_bytes(done)
                        decode_layer(asm.header, done, data)  # checksum before anyone sees it
                        yielded = True
                        self._stats.bytes_out += len(data)
                        yield LayerChunk(asm.header, done, data)
                self._stats.hits += asm is not None and asm.done
                self._stats.misses += asm is None or not asm.done
                return
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or yielded or attempt == self.retries:
                    self._fail("get_layers", e)
                    self._stats.misses += 1
                    return
            except (SegmentError, ValueError) as e:
                self._fail("get_layers", e)
                self._stats.misses += 1
                return
            await asyncio.sleep(self.backoff_s * 2**attempt)

    async def put(self, key: bytes, segment: KVSegment, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_namespace(ns)
        if check_key(key) != segment.key:
            raise ValueError("segment.key does not match key")
        t0 = time.perf_counter()

        async def run() -> pb.PutResponse:
            self.stub  # noqa: B018  (makes the channel and self._put)
            return await self._put(put_wire(key, segment, self.frame_bytes), **self._opts())

        r = await self._retry("put", run)
        if r is None or not r.stored:
            return False
        self._stats.puts += 1
        self._stats.bytes_in += segment.nbytes
        self._put_lat.add(time.perf_counter() - t0)
        return True

    async def delete(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_namespace(ns)
        req = pb.DeleteRequest(keys=[check_key(key)])
        r = await self._retry("delete", lambda: self.stub.Delete(req, **self._opts()))
        return bool(r is not None and r.deleted and r.deleted[0])

    async def server_stats(self) -> pb.StatsResponse | None:
        """The server's Stats for this tier's namespace."""
        return await self._retry(
            "stats", lambda: self.stub.Stats(pb.StatsRequest(), **self._opts())
        )

    def stats(self) -> TierStats:
        s = self._stats
        s.get_latency, s.put_latency = self._get_lat.summary(), self._put_lat.summary()
        return s

    def count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        """Unknown without a call: use server_stats(); 0 here (the interface is synchronous)."""
        check_namespace(ns)
        return 0

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


def _views(payload: torch.Tensor, out) -> bool:
    """Whether payload already lives at the start of out."""
    start = (
        out.data_ptr()
        if isinstance(out, torch.Tensor)
        else torch.frombuffer(out, dtype=torch.uint8).data_ptr()
    )
    return payload.data_ptr() == start
