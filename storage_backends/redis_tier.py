"""The shared Redis tier: one value per segment, standalone Redis or Redis Cluster.

A value is the encoded segment (header and payload) under `tierkv:<ns>:<keyhex>`. The
namespace is not in braces: braces are a Redis Cluster hash tag and would pin a whole
namespace to one slot. Layers stream by GETRANGE: the prefix, the header, then each
layer's byte range. Redis down or slow is a miss: after a fault the tier stays off for a
backoff (doubling up to max_backoff_s) without touching Redis, logs one line per
interval, and tries again afterwards, so it recovers by itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tierkv.storage_backends.base_tier import BaseTier
from tierkv.storage_backends.names import DEFAULT_NAMESPACE, check_namespace
from tierkv.storage_backends.redis_connect import connect
from tierkv.storage_backends.redis_stream import stream_values
from tierkv.storage_backends.segment import (
    PREFIX_NBYTES,
    KVSegment,
    SegmentError,
    SegmentHeader,
    decode_layer,
)
from tierkv.storage_backends.stats import TierStats
from tierkv.storage_backends.stream import LayerSink
from tierkv.storage_backends.tier import SegmentLayer

log = logging.getLogger("tierkv.redis")
# Redis unreachable or too slow: these start a backoff. Other RedisErrors are one refused call.
# (RedisClusterException: no startup node reachable, or the slots not yet covered after a
# failover; it is no RedisError.)
_DOWN = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    RedisClusterException,
    OSError,
    asyncio.TimeoutError,
)


@dataclass(slots=True)
class RedisTierConfig:
    # redis://, rediss://, or redis+cluster://h1:p1,h2:p2/0 (a cluster's startup nodes: the
    # client finds the cluster from any of them that answers)
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False  # Redis Cluster client; also chosen by a redis+cluster:// URL
    ttl_s: int = 0  # expiry of every value (0: none; Redis' own maxmemory policy applies)
    timeout_s: float = 1.0  # per command; a timeout is a miss
    # Connections to one Redis (per node for a cluster). More concurrent commands than this
    # wait up to timeout_s for a free connection instead of failing (a request's chunk loads
    # all go at once: 128 of them for a 32K-token prompt of 256-token chunks).
    max_connections: int = 64
    backoff_s: float = 0.5  # first pause after a fault
    max_backoff_s: float = 10.0  # longest pause
    log_interval_s: float = 10.0  # at most one "redis down" line per interval


@dataclass(slots=True)
class _Health:
    """When Redis may next be tried, and how long the current pause is."""

    until: float = 0.0
    pause: float = 0.0
    last_log: float = -1e9
    down: bool = False


T = TypeVar("T")


@dataclass(slots=True, eq=False)
class RedisTier(BaseTier):
    config: RedisTierConfig = field(default_factory=RedisTierConfig)
    name: str = "redis"
    client: aioredis.Redis | RedisCluster = field(init=False)
    health: _Health = field(default_factory=_Health)
    counts: dict[str, int] = field(default_factory=dict)  # ns -> entries, as of the last scan_count
    on_evict: None = None  # Redis evicts by itself (TTL, maxmemory); nothing to demote to

    def __post_init__(self) -> None:
        self.client, cluster = connect(self.config)
        self._start_stats(device="redis-cluster" if cluster else "redis")

    def _name(self, ns: str, key: bytes) -> str:
        return f"tierkv:{ns}:{key.hex()}"

    def _up(self) -> bool:
        return time.monotonic() >= self.health.until

    def _fault(self, op: str, e: BaseException) -> None:
        h, c, now = self.health, self.config, time.monotonic()
        self._stats.errors += 1
        h.pause = min(c.max_backoff_s, max(c.backoff_s, h.pause * 2))
        h.until, h.down = now + h.pause, True
        self._log(
            f"redis tier unavailable ({op}: {type(e).__name__}: {e}); misses until it answers, "
            f"next try in {h.pause:.1f}s"
        )

    def _ok(self) -> None:
        h = self.health
        if h.down:
            log.warning("redis tier is back")
        h.down, h.pause = False, 0.0

    async def _call(self, op: str, coro: Awaitable[T]) -> T | None:
        """Await one Redis call within the timeout; None on any fault. Only an unreachable or
        slow Redis starts a backoff; a refused command (e.g. OOM under maxmemory) does not."""
        try:
            out = await asyncio.wait_for(coro, self.config.timeout_s)
        except _DOWN as e:
            self._fault(op, e)
            return None
        except RedisError as e:
            self._stats.errors += 1
            self._log(f"redis tier: {op} refused ({type(e).__name__}: {e})")
            return None
        self._ok()
        return out

    def _log(self, line: str) -> None:
        now = time.monotonic()
        if now - self.health.last_log >= self.config.log_interval_s:
            self.health.last_log = now
            log.warning("%s", line)

    async def _contains(self, ns: str, keys: list[bytes]) -> list[bool]:
        names = [self._name(ns, k) for k in keys]
        if not names or not self._up():
            return [False] * len(names)

        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for n in names:
                    pipe.exists(n)
                return await pipe.execute()

        found = await self._call("contains", run())
        return [bool(x) for x in found] if found is not None else [False] * len(names)

    async def _read(self, ns: str, key: bytes, out: Any) -> tuple[KVSegment, int] | None:
        name = self._name(ns, key)
        value = await self._call("get", self.client.get(name)) if self._up() else None
        if value is None:
            return None
        try:
            seg = KVSegment.decode(value)
            if seg.key != key:
                raise SegmentError("stored segment carries another key")
        except SegmentError as e:
            await self._corrupt(name, e)
            return None
        return seg, len(value)

    async def stream(self, keys: Sequence[bytes], ns: str, sink: LayerSink) -> None:
        """Pipelined GETRANGEs: the headers, then one round per layer (redis_stream)."""
        await stream_values(self, keys, ns, sink)

    async def _read_layers(self, ns: str, key: bytes) -> AsyncGenerator[SegmentLayer, None]:
        name = self._name(ns, key)
        if not self._up():
            return
        prefix = await self._call("getrange", self.client.getrange(name, 0, PREFIX_NBYTES - 1))
        try:
            if not prefix:
                return
            hn = SegmentHeader.peek_nbytes(prefix)
            head = await self._call("getrange", self.client.getrange(name, 0, hn - 1))
            if head is None:
                return
            header = SegmentHeader.decode(head)
            if header.key != key:
                raise SegmentError("stored segment carries another key")
        except SegmentError as e:
            await self._corrupt(name, e)
            return
        for i, (off, n) in enumerate(header.layers):
            data = await self._call("getrange", self.client.getrange(name, off, off + n - 1))
            if not isinstance(data, bytes):  # None: Redis gone midway (a short stream is a miss)
                return
            if len(data) != n:  # deleted midway (a miss), or a value shorter than its header
                size = await self._call("strlen", self.client.strlen(name))
                if size and size != header.nbytes:
                    await self._corrupt(
                        name,
                        SegmentError(f"value is {size} bytes, its header says {header.nbytes}"),
                    )
                return
            try:
                decode_layer(header, i, data)
            except SegmentError as e:
                await self._corrupt(name, e)
                return
            yield SegmentLayer(header, i, memoryview(data))

    async def _write(self, ns: str, key: bytes, segment: KVSegment) -> int | None:
        if not self._up():
            return None
        value = segment.encode()
        ex = self.config.ttl_s or None
        ok = await self._call("set", self.client.set(self._name(ns, key), memoryview(value), ex=ex))
        return len(value) if ok else None

    async def _delete(self, ns: str, key: bytes) -> bool:
        if not self._up():
            return False
        return bool(await self._call("delete", self.client.delete(self._name(ns, key))))

    async def scan_count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        """Count ns's values by SCAN (every node of a cluster); the last count on a fault."""
        pattern = f"tierkv:{check_namespace(ns)}:*"

        async def run() -> int:
            return sum([1 async for _ in self.client.scan_iter(match=pattern, count=1000)])

        if self._up():
            n = await self._call("scan", run())
            if n is not None:
                self.counts[ns] = n
        return self.counts.get(ns, 0)

    def count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        """Entries of ns as of the last scan_count (Redis is shared: only a scan knows)."""
        return self.counts.get(check_namespace(ns), 0)

    def _fill_stats(self, s: TierStats) -> None:
        s.num_segments = sum(self.counts.values())
        s.notes = "down" if self.health.down else ""

    async def _corrupt(self, name: str, e: SegmentError) -> None:
        log.warning("redis tier: dropping corrupt value %s: %s", name, e)
        self._stats.errors += 1
        if await self._call("delete", self.client.delete(name)):
            _, ns, key = name.split(":", 2)
            self._changed("removed", ns, bytes.fromhex(key), why="corrupt")

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except (RedisError, OSError):
            pass
