"""The tier interface, the base every storage tier builds on, stats, leases, sizes, invariants.

`Tier` is the interface (the tiered store implements it too). `BaseTier` writes its public
operations once (argument checks, `out` checks, hit/miss/put counting, latency timing) around
a few hooks each tier implements; `IndexedTier` adds what the local tiers share: an LRU index
against a capacity, leases, eviction and the integrity check.

Debug setting: `TIERKV_CHECK_INVARIANTS=1` in the environment (read when a tier is made)
makes every local tier run its integrity check after each eviction; a broken invariant
raises InvariantError. Off by default: the check walks the whole index.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import re
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from tierkv.storage_backends.buffers import check_out, copy_into, views
from tierkv.storage_backends.segment import KVSegment, SegmentError, SegmentHeader
from tierkv.storage_backends.stream import LayerSink, stream_layers

DEFAULT_NAMESPACE = "default"
KEY_NBYTES = 16  # a key is an xxh3_128 digest
MiB = 1 << 20
CHECK_INVARIANTS_ENV = "TIERKV_CHECK_INVARIANTS"
_NS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", re.IGNORECASE)


class InvariantError(RuntimeError):
    """Internal bookkeeping that no longer adds up (index, byte counts, pages): a bug, never a
    fault of the input or of the storage below. Raised by check_integrity."""


def invariant(ok: bool, what: str) -> None:
    """Raise InvariantError(what) unless ok (not an assert: it holds under python -O too)."""
    if not ok:
        raise InvariantError(what)


def check_invariants_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether TIERKV_CHECK_INVARIANTS asks for invariant checks (any value but '', 0, false,
    no, off)."""
    value = (os.environ if env is None else env).get(CHECK_INVARIANTS_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def check_namespace(ns: str) -> str:
    """A namespace is 1-64 of [A-Za-z0-9_.-], not starting with '.' or '-' (it names files
    and keys)."""
    if not isinstance(ns, str) or not _NS.fullmatch(ns):
        raise ValueError(
            f"bad namespace {ns!r}: use 1-64 characters of [A-Za-z0-9_.-], "
            "starting with a letter, digit or '_'"
        )
    return ns


def check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_NBYTES:
        n = len(key) if hasattr(key, "__len__") else "?"
        raise ValueError(f"a key is {KEY_NBYTES} bytes, got {type(key).__name__} of length {n}")
    return key


def check_put(key: bytes, segment: KVSegment, ns: str) -> None:
    """The arguments of a put: a namespace, a 16-byte key, and a segment made for that key."""
    check_namespace(ns)
    if getattr(segment, "key", None) != check_key(key):
        raise ValueError("segment.key does not match key")


def parse_size(s: str | int) -> int:
    """'8GiB' -> 8 * 2**30, '1.5G' -> 1.5e9, '4096' -> 4096; ValueError on anything else."""
    if isinstance(s, int) and not isinstance(s, bool):
        if s < 0:
            raise ValueError(f"size must be >= 0, got {s}")
        return s
    m = _SIZE.fullmatch(str(s))
    if not m:
        raise ValueError(f"bad size {s!r}: use e.g. 4096, 512MiB, 8GiB, 1.5GB")
    num, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    if binary and not unit:
        raise ValueError(f"bad size {s!r}: 'i' needs a unit (KiB, MiB, GiB, TiB)")
    power = "KMGT".index(unit) + 1 if unit else 0
    return int(num * (1024 if binary else 1000) ** power)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


@dataclass(slots=True)
class LatencySummary:
    count: int = 0
    mean_s: float = 0.0
    p50_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0


@dataclass(slots=True)
class Latency:
    """Recent latencies (a bounded window, so memory stays fixed) and a running count."""

    window: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    count: int = 0

    def add(self, seconds: float) -> None:
        self.window.append(seconds)
        self.count += 1

    def summary(self) -> LatencySummary:
        if not self.window:
            return LatencySummary()
        xs = sorted(self.window)
        return LatencySummary(
            self.count,
            sum(xs) / len(xs),
            xs[len(xs) // 2],
            xs[min(len(xs) - 1, int(len(xs) * 0.99))],
            xs[-1],
        )


@dataclass(slots=True)
class TierStats:
    name: str = ""
    hits: int = 0  # gets answered, and layer streams that delivered every layer
    misses: int = 0  # gets not answered (absent or faulty), and layer streams that ended short
    bytes_in: int = 0  # bytes stored by puts
    bytes_out: int = 0  # bytes returned by gets and layer streams
    evictions: int = 0
    errors: int = 0  # faults turned into misses or failed puts (corrupt entries, I/O errors)
    puts: int = 0
    get_latency: LatencySummary = field(default_factory=LatencySummary)
    put_latency: LatencySummary = field(default_factory=LatencySummary)
    used_bytes: int = 0
    capacity_bytes: int = 0
    num_segments: int = 0
    device: str = ""
    notes: str = ""


@dataclass(slots=True)
class SegmentLayer:
    """One layer of a streamed segment: `data` is its encoded bytes (check with decode_layer)."""

    header: SegmentHeader
    layer: int
    data: memoryview


class Hold(Protocol):
    """What Tier.lease returns: it holds until released (by release() or the end of a `with`
    block) or until its TTL runs out."""

    def release(self) -> None: ...

    def __enter__(self) -> object: ...

    def __exit__(self, *exc: object) -> None: ...

    async def __aenter__(self) -> object: ...

    async def __aexit__(self, *exc: object) -> None: ...


@dataclass(slots=True)
class Lease:
    """Holds (ns, key) against eviction until released or until `expires` (monotonic seconds)."""

    leases: Leases
    ident: tuple[str, bytes]
    expires: float
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.leases.drop(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True)
class Leases:
    """The leases of one tier. A lease ends by itself after its TTL, so a lost one cannot leak."""

    active: dict[tuple[str, bytes], list[Lease]] = field(default_factory=dict)

    def take(self, ns: str, key: bytes, ttl: float) -> Lease:
        lease = Lease(self, (ns, key), time.monotonic() + ttl)
        self.active.setdefault(lease.ident, []).append(lease)
        return lease

    def drop(self, lease: Lease) -> None:
        held = self.active.get(lease.ident)
        if held and lease in held:
            held.remove(lease)
            if not held:
                del self.active[lease.ident]

    def held(self, ns: str, key: bytes) -> bool:
        held = self.active.get((ns, key))
        if not held:
            return False
        now = time.monotonic()
        held[:] = [x for x in held if x.expires > now]
        if not held:
            del self.active[(ns, key)]
        return bool(held)


EvictHook = Callable[[str, bytes, KVSegment], None]
"""Called with (ns, key, segment) when a tier evicts an entry; the segment is the caller's."""


class Tier(abc.ABC):
    """One storage tier. Entries are keyed by (ns, key); ns is a tenant and never crosses.

    Safety contract, for every tier:
    - A fault (I/O error, corrupt entry, slow tier down) is a miss or a False, never an
      exception to the caller; it is counted in stats().errors.
    - get verifies the checksums of bytes that come from outside this process (a file, Redis,
      a server) and marks the segment `verified`; a corrupt entry is a miss, counted, and
      removed. Memory tiers hold only bytes they copied from checked or locally computed
      segments and return them unmarked (a reader checks those once, or trusts them).
    - Memory or disk use never exceeds the configured capacity; a segment larger than the
      capacity is refused (put returns False).
    - put copies: the tier never keeps a reference to the caller's tensor or buffer.
    - A segment returned by get is the caller's: with `out`, its payload views `out`;
      without, it does not alias tier memory that eviction may reuse.
    - Bad arguments (bad namespace, wrong key length, a segment made for another key, `out`
      read-only or too small) raise ValueError.
    - Only with the debug setting TIERKV_CHECK_INVARIANTS=1: an operation that evicts raises
      InvariantError when the tier's bookkeeping is found broken (a bug, never a fault).
    """

    name: str = "tier"
    on_evict: EvictHook | None = None

    @abc.abstractmethod
    async def contains(self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE) -> list[bool]: ...

    @abc.abstractmethod
    async def get(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE, out: Any = None
    ) -> KVSegment | None:
        """The segment, or None on a miss. `out` (writable buffer or contiguous tensor of at
        least the raw payload size) receives the payload, and the returned segment views it."""

    @abc.abstractmethod
    def get_layers(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> AsyncIterator[SegmentLayer]:
        """Layers in order; empty on a miss. Each layer's data is valid until the iterator
        advances. A stream that ends before header.num_layers layers is a miss (a fault midway)."""

    async def stream(self, keys: Sequence[bytes], ns: str, sink: LayerSink) -> None:
        """Load keys layer-major into sink: layer 0 of every key, then layer 1, ... (safety
        contract in storage_backends.stream). Bad keys or namespace raise ValueError first."""
        check_namespace(ns)
        for k in keys:
            check_key(k)
        await stream_layers(lambda k: self.get_layers(k, ns), keys, sink)

    @abc.abstractmethod
    async def put(self, key: bytes, segment: KVSegment, ns: str = DEFAULT_NAMESPACE) -> bool:
        """Store a copy; True when stored. May evict unleased entries, least recently used
        first."""

    @abc.abstractmethod
    async def delete(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> bool: ...

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    @abc.abstractmethod
    def count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        """Entries held for namespace ns."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    def lease(self, key: bytes, ns: str = DEFAULT_NAMESPACE, ttl: float | None = None) -> Hold:
        """Hold (ns, key) against eviction: `with tier.lease(k): ...`; ends by itself after ttl.
        Tiers without eviction pressure (remote ones) may return a lease that holds nothing."""
        return Leases().take(ns, key, 30.0 if ttl is None else ttl)

    def check_integrity(self) -> None:
        """Raise InvariantError when the tier's own bookkeeping is inconsistent (tests call it;
        TIERKV_CHECK_INVARIANTS=1 makes local tiers call it after every eviction). A tier
        without local bookkeeping has nothing to check."""
        return None


class BaseTier(Tier):
    """A tier whose public operations are written here once. `get`, `get_layers`, `put`,
    `delete` and `contains` check their arguments (and `out`), count hits, misses, puts and
    bytes, and time gets and puts; a tier implements only the hooks below. A hook gets
    checked arguments and turns every fault into a miss (None, a short stream) or a refused
    put, counting it in `_stats.errors`.

    - `_read(ns, key, out)`: `(segment, bytes read)`, or None. It may land the payload in
      `out` (then the segment views it); otherwise the base copies the payload into `out`.
    - `_read_layers(ns, key)`: the layers in order; it stops early on a miss or a fault.
    - `_write(ns, key, segment)`: bytes stored; 0 when it was stored already (nothing is
      counted); None when refused.
    - `_delete(ns, key)`: whether an entry was there.
    - `_contains(ns, keys)`: presence of each key.

    A subclass calls `_start_stats(...)` in its constructor. `_touch(ns, key)` (True when the
    tier holds the key, which it then marks recently used) lets an indexed tier skip rewriting
    what it holds and keep its LRU order; `_fill_stats` adds the tier's gauges to stats().
    """

    _stats: TierStats
    _get_lat: Latency
    _put_lat: Latency
    check_invariants: bool = False

    def _start_stats(self, **values: Any) -> None:
        self._stats = TierStats(name=self.name, **values)
        self._get_lat, self._put_lat = Latency(), Latency()
        self.check_invariants = check_invariants_enabled()

    # -- the hooks -------------------------------------------------------------------------
    @abc.abstractmethod
    async def _read(self, ns: str, key: bytes, out: Any) -> tuple[KVSegment, int] | None: ...

    @abc.abstractmethod
    def _read_layers(self, ns: str, key: bytes) -> AsyncGenerator[SegmentLayer, None]: ...

    @abc.abstractmethod
    async def _write(self, ns: str, key: bytes, segment: KVSegment) -> int | None: ...

    @abc.abstractmethod
    async def _delete(self, ns: str, key: bytes) -> bool: ...

    @abc.abstractmethod
    async def _contains(self, ns: str, keys: list[bytes]) -> list[bool]: ...

    def _touch(self, ns: str, key: bytes) -> bool:
        return False

    def _fill_stats(self, s: TierStats) -> None:
        pass

    # -- the public operations -------------------------------------------------------------
    async def contains(self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE) -> list[bool]:
        check_namespace(ns)
        return await self._contains(ns, [check_key(k) for k in keys])

    async def get(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE, out: Any = None
    ) -> KVSegment | None:
        check_namespace(ns)
        check_key(key)
        if out is not None:
            check_out(out)
        t0 = time.perf_counter()
        got = await self._read(ns, key, out)
        if got is None:
            self._stats.misses += 1
            return None
        seg, nbytes = got
        if out is not None and not views(seg.payload, out):
            seg = copy_into(seg, out)
        self._touch(ns, key)
        self._stats.hits += 1
        self._stats.bytes_out += nbytes
        self._get_lat.add(time.perf_counter() - t0)
        return seg

    async def get_layers(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE
    ) -> AsyncIterator[SegmentLayer]:
        check_namespace(ns)
        check_key(key)
        got, header = 0, None
        async with aclosing(self._read_layers(ns, key)) as layers:
            async for layer in layers:
                got, header = got + 1, layer.header
                self._stats.bytes_out += layer.data.nbytes
                yield layer
        if header is not None and got == header.num_layers:
            self._stats.hits += 1
        else:
            self._stats.misses += 1

    async def put(self, key: bytes, segment: KVSegment, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_put(key, segment, ns)
        if self._touch(ns, key):  # keys name their content: the same key is the same KV
            return True
        t0 = time.perf_counter()
        n = await self._write(ns, key, segment)
        if n is None:
            return False
        if n:
            self._stats.puts += 1
            self._stats.bytes_in += n
            self._put_lat.add(time.perf_counter() - t0)
        return True

    async def delete(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_namespace(ns)
        return await self._delete(ns, check_key(key))

    def stats(self) -> TierStats:
        s = self._stats
        s.get_latency, s.put_latency = self._get_lat.summary(), self._put_lat.summary()
        self._fill_stats(s)
        return dataclasses.replace(s)


E = TypeVar("E")


class IndexedTier(BaseTier, Generic[E]):
    """What the local tiers (gpu, cpu, disk) share: an LRU `index` of entries keyed by
    (ns, key) (oldest first), per-namespace `counts`, `used_bytes` against `capacity_bytes`,
    leases, LRU eviction of unleased entries, and check_integrity. A subclass calls
    `_start_index(...)` in its constructor and implements `_entry_bytes(entry)` (the capacity
    an entry takes), `_release(entry)` (free what it holds once it has left the index),
    `_evicted(entry)` (the entry as a segment for on_evict), and may add `_check_entries()`."""

    index: OrderedDict[tuple[str, bytes], E]
    counts: dict[str, int]
    leases: Leases
    used_bytes: int
    reserved_bytes: int  # bytes being written, not indexed yet (they count against capacity)
    capacity_bytes: int
    lease_ttl_s: float

    def _start_index(self, capacity_bytes: int, lease_ttl_s: float, **stats: Any) -> None:
        self.index = OrderedDict()
        self.counts = {}
        self.leases = Leases()
        self.used_bytes = self.reserved_bytes = 0
        self.capacity_bytes, self.lease_ttl_s = capacity_bytes, lease_ttl_s
        self._start_stats(capacity_bytes=capacity_bytes, **stats)

    @abc.abstractmethod
    def _entry_bytes(self, entry: E) -> int: ...

    @abc.abstractmethod
    def _release(self, entry: E) -> None: ...

    @abc.abstractmethod
    def _evicted(self, entry: E) -> KVSegment | None: ...

    def _check_entries(self) -> None:
        pass

    # -- the index -------------------------------------------------------------------------
    def _add(self, ns: str, key: bytes, entry: E) -> None:
        self.index[(ns, key)] = entry
        self.counts[ns] = self.counts.get(ns, 0) + 1
        self.used_bytes += self._entry_bytes(entry)

    def _remove(self, ns: str, key: bytes) -> bool:
        entry = self.index.pop((ns, key), None)
        if entry is None:
            return False
        self.used_bytes -= self._entry_bytes(entry)
        self.counts[ns] -= 1
        if not self.counts[ns]:
            del self.counts[ns]
        self._release(entry)
        return True

    def _touch(self, ns: str, key: bytes) -> bool:
        if (ns, key) not in self.index:
            return False
        self.index.move_to_end((ns, key))
        return True

    def _corrupt(self, ns: str, key: bytes) -> None:
        """A corrupt or unreadable entry: counted as an error and removed (the caller misses)."""
        self._stats.errors += 1
        self._remove(ns, key)

    async def _contains(self, ns: str, keys: list[bytes]) -> list[bool]:
        return [(ns, k) in self.index for k in keys]

    async def _delete(self, ns: str, key: bytes) -> bool:
        return self._remove(ns, key)

    def _make_room(self, n: int) -> bool:
        """Evict unleased entries, least recently used first, until n more bytes fit; False,
        with nothing evicted, when they cannot."""
        if n > self.capacity_bytes:
            return False
        free = self.capacity_bytes - self.used_bytes - self.reserved_bytes
        if free >= n:
            return True
        victims = []
        for ident, entry in self.index.items():
            if free >= n:
                break
            if not self.leases.held(*ident):
                victims.append(ident)
                free += self._entry_bytes(entry)
        if free < n:
            return False  # nothing is evicted unless it makes enough room
        for ns, key in victims:
            self._evict(ns, key)
        if self.check_invariants:
            self.check_integrity()
        return True

    def _evict(self, ns: str, key: bytes) -> None:
        seg = None
        if self.on_evict is not None:
            try:
                seg = self._evicted(self.index[(ns, key)])
            except SegmentError:
                self._stats.errors += 1
        self._remove(ns, key)
        self._stats.evictions += 1
        if seg is not None and self.on_evict is not None:
            self.on_evict(ns, key, seg)

    # -- the rest of the interface ---------------------------------------------------------
    def lease(self, key: bytes, ns: str = DEFAULT_NAMESPACE, ttl: float | None = None) -> Lease:
        ttl = self.lease_ttl_s if ttl is None else ttl
        return self.leases.take(check_namespace(ns), check_key(key), ttl)

    def _fill_stats(self, s: TierStats) -> None:
        s.used_bytes, s.num_segments = self.used_bytes, len(self.index)

    def count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        return self.counts.get(ns, 0)

    def check_integrity(self) -> None:
        """The index, byte accounting and namespace counts agree, and use is within capacity;
        InvariantError when not."""
        used = sum(self._entry_bytes(e) for e in self.index.values())
        invariant(self.used_bytes == used, f"used bytes drifted: {self.used_bytes} != {used}")
        invariant(
            self.used_bytes + self.reserved_bytes <= self.capacity_bytes,
            f"above capacity: {self.used_bytes} + {self.reserved_bytes} > {self.capacity_bytes}",
        )
        counts = Counter(ns for ns, _ in self.index)
        invariant(dict(counts) == self.counts, "namespace counts drifted")
        self._check_entries()
