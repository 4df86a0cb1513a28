"""The tier interface and its safety contract.

`Tier` is the interface (the tiered store implements it too). `BaseTier` (base_tier.py)
writes its public operations once around a few hooks each tier implements.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tierkv.storage_backends.leases import Hold, Leases
from tierkv.storage_backends.names import DEFAULT_NAMESPACE, check_key, check_namespace
from tierkv.storage_backends.segment import KVSegment, SegmentHeader
from tierkv.storage_backends.stats import TierStats
from tierkv.storage_backends.stream import LayerSink, stream_layers


@dataclass(slots=True)
class SegmentLayer:
    """One layer of a streamed segment: `data` is its encoded bytes (check with decode_layer)."""

    header: SegmentHeader
    layer: int
    data: memoryview


EvictHook = Callable[[str, bytes, KVSegment], None]
"""Called with (ns, key, segment) when a tier evicts an entry; the segment is the caller's."""


@dataclass(slots=True)
class TierChange:
    """An entry came into a tier or left it (observers: KV events, the server's watch)."""

    kind: str  # "stored" | "removed"
    tier: str  # the tier's name
    ns: str
    key: bytes
    header: SegmentHeader | None = None  # stored: the segment's header (tokens, parent)
    reason: str = ""  # removed: "evicted" | "corrupt" | "deleted"


ChangeHook = Callable[[TierChange], None]
"""Called on the tier's event loop, synchronously: it must not block or raise."""


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
    on_change: ChangeHook | None = None

    def _changed(
        self, kind: str, ns: str, key: bytes, header: SegmentHeader | None = None, why: str = ""
    ) -> None:
        if self.on_change is not None:
            self.on_change(TierChange(kind, self.name, ns, key, header, why))

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
        """Store a copy; True when stored. May evict unleased entries, in the tier's eviction
        order (storage_backends.eviction: least recently used first unless configured)."""

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
