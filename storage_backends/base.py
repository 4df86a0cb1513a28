"""The tier interface every storage tier implements, its stats, leases, and size parsing."""

from __future__ import annotations

import abc
import dataclasses
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.storage_backends.segment import KVSegment, SegmentHeader

DEFAULT_NAMESPACE = "default"
_NS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", re.IGNORECASE)


def check_namespace(ns: str) -> str:
    """A namespace is 1-64 of [A-Za-z0-9_.-], not starting with '.' or '-' (it names files and keys)."""
    if not isinstance(ns, str) or not _NS.fullmatch(ns):
        raise ValueError(
            f"bad namespace {ns!r}: use 1-64 characters of [A-Za-z0-9_.-], "
            "starting with a letter, digit or '_'"
        )
    return ns


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


def format_size(n: int) -> str:
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

    window: deque = field(default_factory=lambda: deque(maxlen=1024))
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
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0  # bytes stored by puts
    bytes_out: int = 0  # bytes returned by gets
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
class LayerChunk:
    """One layer of a streamed segment: `data` is its encoded bytes (check with decode_layer)."""

    header: SegmentHeader
    layer: int
    data: memoryview


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

    def __exit__(self, *exc) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc) -> None:
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


EvictHook = Callable[[str, bytes, "KVSegment"], None]
"""Called with (ns, key, segment) when a tier evicts an entry; the segment is the caller's to keep."""


class Tier(abc.ABC):
    """One storage tier. Entries are keyed by (ns, key); ns is a tenant and never crosses.

    Safety contract, for every tier:
    - A fault (I/O error, corrupt entry, slow tier down) is a miss or a False, never an
      exception to the caller; it is counted in stats().errors.
    - get verifies checksums: a corrupt entry is a miss, counted, and removed.
    - Memory or disk use never exceeds the configured capacity; a segment larger than the
      capacity is refused (put returns False).
    - put copies: the tier never keeps a reference to the caller's tensor or buffer.
    - A segment returned by get is the caller's: with `out`, its payload views `out`;
      without, it does not alias tier memory that eviction may reuse.
    - Bad arguments (bad namespace, wrong key length, `out` too small) raise ValueError.
    """

    name: str = "tier"
    on_evict: EvictHook | None = None

    @abc.abstractmethod
    async def contains(self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE) -> list[bool]: ...

    @abc.abstractmethod
    async def get(self, key: bytes, ns: str = DEFAULT_NAMESPACE, out=None) -> KVSegment | None:
        """The segment, or None on a miss. `out` (writable buffer or CPU tensor of at least the
        raw payload size) receives the payload, and the returned segment views it."""

    @abc.abstractmethod
    def get_layers(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> AsyncIterator[LayerChunk]:
        """Layers in order; empty on a miss. Each chunk's data is valid until the iterator
        advances. A stream that ends before header.num_layers layers is a miss (a fault midway)."""

    @abc.abstractmethod
    async def put(self, key: bytes, segment: KVSegment, ns: str = DEFAULT_NAMESPACE) -> bool:
        """Store a copy; True when stored. May evict unleased entries (least recently used first)."""

    @abc.abstractmethod
    async def delete(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> bool: ...

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    @abc.abstractmethod
    def count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        """Entries held for namespace ns."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    def lease(self, key: bytes, ns: str = DEFAULT_NAMESPACE, ttl: float = 30.0) -> Lease:
        """Hold (ns, key) against eviction: `with tier.lease(k): ...`; ends by itself after ttl.
        Tiers without eviction pressure (remote ones) may return a lease that holds nothing."""
        return Leases().take(ns, key, ttl)


class IndexedTier(Tier):
    """What the local tiers (gpu, cpu, disk) share: an LRU `index` keyed by (ns, key), per-namespace
    `counts`, `leases`, and stats. A subclass sets those attributes, `used_bytes`,
    `config.lease_ttl_s`, and implements `_remove(ns, key) -> bool`."""

    index: dict
    counts: dict[str, int]
    leases: Leases
    _stats: TierStats
    _get_lat: Latency
    _put_lat: Latency

    async def contains(self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE) -> list[bool]:
        check_namespace(ns)
        return [(ns, check_key(k)) in self.index for k in keys]

    def _corrupt(self, ns: str, key: bytes) -> None:
        """A corrupt or unreadable entry: a miss, counted as an error, and removed."""
        self._stats.errors += 1
        self._stats.misses += 1
        self._remove(ns, key)

    def lease(self, key: bytes, ns: str = DEFAULT_NAMESPACE, ttl: float | None = None) -> Lease:
        ttl = self.config.lease_ttl_s if ttl is None else ttl
        return self.leases.take(check_namespace(ns), check_key(key), ttl)

    def stats(self) -> TierStats:
        s = self._stats
        s.used_bytes, s.num_segments = self.used_bytes, len(self.index)
        s.get_latency, s.put_latency = self._get_lat.summary(), self._put_lat.summary()
        return dataclasses.replace(s)

    def count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        return self.counts.get(ns, 0)


def check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != 16:
        n = len(key) if hasattr(key, "__len__") else "?"
        raise ValueError(f"a key is 16 bytes, got {type(key).__name__} of length {n}")
    return key
