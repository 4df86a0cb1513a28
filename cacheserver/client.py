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
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from tierkv.cacheserver import wire
from tierkv.cacheserver.auth import bearer
from tierkv.cacheserver.batch import Batcher
from tierkv.cacheserver.channel import Connection
from tierkv.cacheserver.frames import Assembly, assemble_many, put_wire
from tierkv.cacheserver.hint_call import hint_requests
from tierkv.proto import tierkv_pb2 as pb
from tierkv.proto import tierkv_pb2_grpc as pb_grpc
from tierkv.storage_backends.base_tier import BaseTier
from tierkv.storage_backends.hints import KVHint
from tierkv.storage_backends.names import DEFAULT_NAMESPACE, check_key, check_namespace
from tierkv.storage_backends.segment import KVSegment, SegmentError, decode_layer
from tierkv.storage_backends.sizes import MiB
from tierkv.storage_backends.stream import LayerSink, stream_whole
from tierkv.storage_backends.tier import SegmentLayer

log = logging.getLogger("tierkv.remote")
LOOKUP_BATCH = 1024  # keys per Lookup call in contains()
T = TypeVar("T")


@dataclass(slots=True, eq=False)
class RemoteTier(BaseTier):
    target: str  # "host:port" of a tierkv-server
    token: str | None = None  # bearer token (the server maps it to a namespace)
    tls_ca: str | bytes | None = None  # CA certificate (PEM path or bytes): TLS on
    timeout_s: float = 30.0  # deadline of each call
    retries: int = 3  # extra attempts on UNAVAILABLE
    backoff_s: float = 0.05  # first pause between attempts; doubles
    frame_bytes: int = MiB  # payload frame size of puts
    max_segment_bytes: int = 1 << 30  # largest segment accepted from the server
    name: str = "remote"
    _conn: Connection | None = None
    _gets: Batcher[tuple[bytes, Any], tuple[KVSegment, int] | None] | None = None
    _last_log: float = -1e9

    def __post_init__(self) -> None:
        self._start_stats(device="grpc")

    @property
    def conn(self) -> Connection:
        if self._conn is None:  # made on first use, inside the caller's event loop
            self._conn = Connection.open(self.target, self.tls_ca, self.frame_bytes)
        return self._conn

    @property
    def stub(self) -> pb_grpc.TierKVStub:
        return self.conn.stub

    def _opts(self) -> dict[str, Any]:
        return {"timeout": self.timeout_s, "metadata": bearer(self.token)}

    def _fail(self, op: str, e: BaseException) -> None:
        self._stats.errors += 1
        now = time.monotonic()
        if now - self._last_log >= 10.0:  # one line per interval, not one per call
            self._last_log = now
            msg = e.details() if isinstance(e, grpc.aio.AioRpcError) else e
            log.warning("remote tier %s: %s failed (%s): miss", self.target, op, msg)

    async def _retry(self, op: str, fn: Callable[[], Awaitable[T]]) -> T | None:
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

    def _frames(self, req: pb.GetRequest) -> AsyncIterable[wire.SegmentFrame]:
        return self.conn.get(req, **self._opts())

    async def lookup(
        self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE
    ) -> pb.LookupResponse | None:
        """The server's full answer: presence, tier of each key, present prefix length."""
        check_namespace(ns)
        return await self._lookup([check_key(k) for k in keys])

    async def _lookup(self, keys: list[bytes]) -> pb.LookupResponse | None:
        req = pb.LookupRequest(keys=keys)
        return await self._retry("lookup", lambda: self.stub.Lookup(req, **self._opts()))

    async def hint(
        self,
        keys: Sequence[bytes],
        hint: KVHint | None,
        pin_ttl_s: float = 0.0,
        prefetch: bool = False,
    ) -> pb.HintResponse | None:
        """Advise the server of keys (its Hint call, docs/workflows.md): tag them with hint's
        agent, soft-pin them pin_ttl_s seconds (0: no pin), and with prefetch move them up to
        its fastest tier in the background. Counts summed over batches; None when a call
        failed (hints are advice: nothing else happens)."""
        ks = [check_key(k) for k in keys]
        total = pb.HintResponse()
        for req in hint_requests(ks, hint, pin_ttl_s, prefetch, LOOKUP_BATCH):
            r = await self._hint_batch(req)
            if r is None:
                return None
            total.tagged += r.tagged
            total.pinned += r.pinned
            total.prefetching += r.prefetching
        return total

    async def _hint_batch(self, req: pb.HintRequest) -> pb.HintResponse | None:
        return await self._retry("hint", lambda: self.stub.Hint(req, **self._opts()))

    async def _contains(self, ns: str, keys: list[bytes]) -> list[bool]:
        found: list[bool] = []
        for i in range(0, len(keys), LOOKUP_BATCH):  # within the server's max_keys
            batch = keys[i : i + LOOKUP_BATCH]
            r = await self._lookup(batch)
            found += list(r.present) if r is not None else [False] * len(batch)
        return found

    async def _read(self, ns: str, key: bytes, out: Any) -> tuple[KVSegment, int] | None:
        """Concurrent reads (a request's chunks) go out as one GetMany stream."""
        if self._gets is None:
            self._gets = Batcher(self._get_many, LOOKUP_BATCH)
        return await self._gets.submit((key, out))

    async def _get_many(
        self, batch: list[tuple[bytes, Any]]
    ) -> list[tuple[KVSegment, int] | None | Exception]:
        req = pb.GetManyRequest(keys=[k for k, _ in batch])

        async def run() -> list[Assembly | None]:
            frames = self.conn.get_many(req, **self._opts())
            return await assemble_many(frames, [out for _, out in batch], self.max_segment_bytes)

        asms = await self._retry("get", run)
        out: list[tuple[KVSegment, int] | None | Exception] = []
        for (key, _), asm in zip(batch, asms or [None] * len(batch), strict=True):
            try:
                seg = asm.segment() if asm is not None and asm.done else None
            except SegmentError as e:
                self._fail("get", e)
                seg = None
            out.append((seg, seg.nbytes) if seg is not None and seg.key == key else None)
        return out

    async def stream(self, keys: Sequence[bytes], ns: str, sink: LayerSink) -> None:
        """The keys' segments by one GetMany stream, then handed over layer by layer: gRPC's
        per-key streams cost more than the overlap they would buy."""
        check_namespace(ns)
        for k in keys:
            check_key(k)
        await stream_whole(lambda k: self.get(k, ns), keys, sink)

    async def _read_layers(self, ns: str, key: bytes) -> AsyncGenerator[SegmentLayer, None]:
        req = pb.GetRequest(key=key)
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
                        yield SegmentLayer(asm.header, done, data)
                return
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or yielded or attempt == self.retries:
                    self._fail("get_layers", e)
                    return
            except (SegmentError, ValueError) as e:
                self._fail("get_layers", e)
                return
            await asyncio.sleep(self.backoff_s * 2**attempt)

    async def _write(self, ns: str, key: bytes, segment: KVSegment) -> int | None:
        async def run() -> pb.PutResponse:
            return await self.conn.put(put_wire(key, segment, self.frame_bytes), **self._opts())

        r = await self._retry("put", run)
        return segment.nbytes if r is not None and r.stored else None

    async def _delete(self, ns: str, key: bytes) -> bool:
        req = pb.DeleteRequest(keys=[key])
        r = await self._retry("delete", lambda: self.stub.Delete(req, **self._opts()))
        return bool(r is not None and r.deleted and r.deleted[0])

    async def server_stats(self) -> pb.StatsResponse | None:
        """The server's Stats for this tier's namespace."""
        return await self._retry(
            "stats", lambda: self.stub.Stats(pb.StatsRequest(), **self._opts())
        )

    async def watch(self, stored: bool = False) -> AsyncIterator[pb.WatchEvent]:
        """The server's removals of this tier's namespace as they happen (with `stored`, what
        enters it too; the Watch stream, no deadline): until the caller stops iterating; a
        broken stream raises AioRpcError."""
        req = pb.WatchRequest(stored=stored)
        call = self.stub.Watch(req, metadata=bearer(self.token))
        try:
            async for ev in call:
                yield ev
        finally:
            call.cancel()

    def count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        """Unknown without a call: use server_stats(); 0 here (the interface is synchronous)."""
        check_namespace(ns)
        return 0

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.channel.close(None)
            self._conn = None
