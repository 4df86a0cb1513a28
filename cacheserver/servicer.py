"""The TierKV servicer: each RPC over the tiered store, in the caller's namespace.

Safety contract: the namespace of every call comes from Auth (the caller's token); a Put
reaches the store only after its whole stream was received and its segment decoded,
checksummed and matched to the header key, so a refused or cut stream stores nothing;
a refused request gets INVALID_ARGUMENT / RESOURCE_EXHAUSTED / UNAUTHENTICATED with a
message and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from tierkv.cacheserver import wire
from tierkv.cacheserver.auth import Auth
from tierkv.cacheserver.config import ServerConfig
from tierkv.cacheserver.frames import BadRequest, check_keys, check_known, cut, too_big
from tierkv.cacheserver.hint_call import check_hint
from tierkv.cacheserver.metrics import Metrics
from tierkv.cacheserver.ns_stats import NsCounters, stats_response
from tierkv.cacheserver.receive import Inflight, PutLimits, receive_put
from tierkv.cacheserver.watch import WatchHub
from tierkv.proto import tierkv_pb2 as pb
from tierkv.proto import tierkv_pb2_grpc as pb_grpc
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.store import TieredStore
from tierkv.storage_backends.tier import SegmentLayer


@dataclass(slots=True, eq=False)
class Servicer(pb_grpc.TierKVServicer):
    store: TieredStore
    config: ServerConfig
    metrics: Metrics
    auth: Auth = field(init=False)
    inflight: Inflight = field(init=False)
    watch: WatchHub = field(init=False)
    streams: int = 0
    data_socket: str = ""  # the data plane's Unix socket, once it listens
    data_port: int = 0  # the data plane's TCP port, once it listens (0: off)
    counters: dict[str, NsCounters] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.auth = Auth(self.config.tokens)
        self.inflight = Inflight(self.config.max_inflight_bytes)
        cfg = self.config
        self.watch = WatchHub(self.store, cfg.watch_queue, cfg.max_watchers, self.metrics)

    def _ns(self, ns: str) -> NsCounters:
        return self.counters.setdefault(ns, NsCounters())

    @contextlib.asynccontextmanager
    async def _call(self, method: str, context: grpc.aio.ServicerContext, stream: bool = False):
        """Auth, the stream limit, refusals as statuses, and the RPC's metrics, in one place."""
        t0, code = time.perf_counter(), "OK"
        ns = await self.auth.require(context)
        held = False
        try:
            if stream:
                if self.streams >= self.config.max_streams:
                    limit = self.config.max_streams
                    raise too_big(f"{self.streams} streams in flight; max_streams is {limit}")
                self.streams, held = self.streams + 1, True
            yield ns
        except BadRequest as e:
            code = e.code.name
            self.metrics.rejected.labels(e.reason).inc()
            await context.abort(e.code, e.message)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            if held:
                self.streams -= 1
            self.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - t0)
            self.metrics.rpc_total.labels(method, code).inc()

    async def _where(self, keys: list[bytes], ns: str) -> list[str]:
        """Name of the fastest tier holding each key ('' when none)."""
        return [
            "" if i is None else self.store.tiers[i].name for i in await self.store.locate(keys, ns)
        ]

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        async with self._call("Lookup", context) as ns:
            check_known(request)
            keys = check_keys(request.keys, self.config.max_keys)
            where = await self._where(keys, ns)
            present = [bool(w) for w in where]
            prefix = next((i for i, p in enumerate(present) if not p), len(present))
            self._ns(ns).lookups += 1
            return pb.LookupResponse(present=present, tier=where, prefix_len=prefix)

    async def Put(self, request_iterator: AsyncIterator[wire.PutFrame], context) -> pb.PutResponse:
        async with self._call("Put", context, stream=True) as ns:
            lim = PutLimits(
                self.config.max_segment_bytes, self.config.max_frame_bytes, self.config.max_frames
            )
            key, seg, held = await receive_put(request_iterator, lim, self.inflight)
            seg.owned = True  # the receive buffer is this segment's alone: the store keeps it
            try:  # shielded: once whole and valid, a put completes even if its caller cancels
                stored = await asyncio.shield(self.store.put(key, seg, ns))
            finally:
                self.inflight.give(held)  # received: the write-behind queue bounds it from here
            self.count_put(ns, seg.nbytes)
            return pb.PutResponse(stored=bool(stored))

    def count_put(self, ns: str, nbytes: int) -> None:
        """A put of ns received whole (over gRPC or the data plane)."""
        c = self._ns(ns)
        c.puts += 1
        c.bytes_in += nbytes
        self.metrics.wire_bytes.labels("in").inc(nbytes)

    def count_get(self, ns: str, where: str, nbytes: int) -> None:
        """A get of ns answered from tier `where` with nbytes sent ("": a miss)."""
        c = self._ns(ns)
        c.gets += 1
        if not where:
            c.misses += 1
            return
        c.hits[where] = c.hits.get(where, 0) + 1
        c.bytes_out += nbytes
        self.metrics.wire_bytes.labels("out").inc(nbytes)

    async def _layers(self, key: bytes, ns: str) -> tuple[str, AsyncIterator[SegmentLayer]]:
        """The tier holding key and its layers: streamed from the fastest tier, or read
        whole (and so promoted) from a slower one."""
        [at] = await self.store.locate([key], ns)
        if at is None:
            return "", _none()
        if at == 0:
            return self.store.tiers[0].name, self.store.get_layers(key, ns)
        seg = await self.store.get(key, ns)
        return self.store.tiers[at].name, _from_segment(seg)

    async def _frames(self, index: int, key: bytes, ns: str) -> AsyncIterator[bytes]:
        """The serialized SegmentFrames of one key (see `wire`: one copy from tier memory)."""
        where, chunks = await self._layers(key, ns)
        frame, sent, layers = self.config.max_frame_bytes, 0, -1
        async for chunk in chunks:
            h = chunk.header
            if chunk.layer == 0:
                head = h.encode()
                yield pb.SegmentFrame(
                    index=index,
                    kind=pb.SegmentFrame.HEADER,
                    data=head,
                    total_bytes=h.nbytes,
                    tier=where,
                ).SerializeToString()
                sent += len(head)
            tag = pb.SegmentFrame(index=index, kind=pb.SegmentFrame.LAYER, layer=chunk.layer)
            for data in cut(memoryview(chunk.data).cast("B"), frame):
                yield wire.encode(tag, 4, data)
            sent += len(chunk.data)
            layers = chunk.layer
        if sent == 0 or layers + 1 != h.num_layers:
            # Absent, or the tier failed midway: MISS tells the client to drop what it has.
            self.count_get(ns, "", 0)
            yield pb.SegmentFrame(index=index, kind=pb.SegmentFrame.MISS).SerializeToString()
            return
        self.count_get(ns, where, sent)

    async def Get(self, request: pb.GetRequest, context) -> AsyncIterator[bytes]:
        async with self._call("Get", context, stream=True) as ns:
            check_known(request)
            key = check_keys([request.key], 1)[0]
            async for f in self._frames(0, key, ns):
                yield f

    async def GetMany(self, request: pb.GetManyRequest, context) -> AsyncIterator[bytes]:
        async with self._call("GetMany", context, stream=True) as ns:
            check_known(request)
            for i, key in enumerate(check_keys(request.keys, self.config.max_keys)):
                async for f in self._frames(i, key, ns):
                    yield f

    async def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteResponse:
        async with self._call("Delete", context) as ns:
            check_known(request)
            keys = check_keys(request.keys, self.config.max_keys)
            return pb.DeleteResponse(deleted=[bool(await self.store.delete(k, ns)) for k in keys])

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        async with self._call("Stats", context) as ns:
            check_known(request)
            return await stats_response(self.store, ns, self._ns(ns))

    async def DataPlane(self, request: pb.DataPlaneRequest, context) -> pb.DataPlaneResponse:
        async with self._call("DataPlane", context):
            check_known(request)
            return pb.DataPlaneResponse(
                unix_socket=self.data_socket,
                region_bytes=self.config.shm_region_bytes,
                tcp_port=self.data_port,
            )

    async def Hint(self, request: pb.HintRequest, context) -> pb.HintResponse:
        """Tag, soft-pin and prefetch the caller namespace's keys (cacheserver.hint_call)."""
        async with self._call("Hint", context) as ns:
            h = check_hint(request, self.config.max_keys, self.config.max_pin_s)
            # keys not stored yet are tagged pending: bounded per namespace, expiring
            tagged, pinned = self.store.hint(h.keys, ns, h.hint, h.pin_ttl_s)
            moving = self.store.prefetch(h.keys, ns) if h.prefetch else 0
            return pb.HintResponse(tagged=tagged, pinned=pinned, prefetching=moving)

    async def Watch(self, request: pb.WatchRequest, context) -> AsyncIterator[bytes]:
        """The caller namespace's removals (and stores, if asked), until the caller ends it
        (cacheserver.watch)."""
        async with self._call("Watch", context) as ns:
            check_known(request)
            async for m in self.watch.stream(ns, request.stored):
                yield m


async def _none() -> AsyncIterator[SegmentLayer]:
    return
    yield


async def _from_segment(seg: KVSegment | None) -> AsyncIterator[SegmentLayer]:
    if seg is None:
        return
    h, _, blobs = seg.encode_parts()
    for i, b in enumerate(blobs):
        yield SegmentLayer(h, i, memoryview(b).cast("B"))
