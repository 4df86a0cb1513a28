"""KV segments, chunk keys, the tier interface and the local tiers behind one tiered store."""

from tierkv.storage_backends.base import (
    DEFAULT_NAMESPACE,
    BaseTier,
    IndexedTier,
    InvariantError,
    Lease,
    MiB,
    SegmentLayer,
    Tier,
    TierStats,
    check_key,
    check_namespace,
    format_size,
    parse_size,
)
from tierkv.storage_backends.keys import ChunkHasher, Salt
from tierkv.storage_backends.segment import (
    DTYPES,
    KVSegment,
    SegmentError,
    SegmentHeader,
    decode_layer,
    dtype_name,
)

__all__ = [
    "DEFAULT_NAMESPACE",
    "DTYPES",
    "BaseTier",
    "ChunkHasher",
    "IndexedTier",
    "InvariantError",
    "KVSegment",
    "Lease",
    "MiB",
    "Salt",
    "SegmentError",
    "SegmentHeader",
    "SegmentLayer",
    "Tier",
    "TierStats",
    "check_key",
    "check_namespace",
    "decode_layer",
    "dtype_name",
    "format_size",
    "parse_size",
]
