"""KV segments, chunk keys, the tier interface and the local tiers behind one tiered store."""

from tierkv.storage_backends.base import (
    DEFAULT_NAMESPACE,
    LayerChunk,
    Lease,
    Tier,
    TierStats,
    check_key,
    check_namespace,
    format_size,
    parse_size,
)
from tierkv.storage_backends.keys import ChunkHasher, Salt
from tierkv.storage_backends.segment import KVSegment, SegmentError, SegmentHeader, decode_layer

__all__ = [
    "DEFAULT_NAMESPACE",
    "ChunkHasher",
    "KVSegment",
    "LayerChunk",
    "Lease",
    "Salt",
    "SegmentError",
    "SegmentHeader",
    "Tier",
    "TierStats",
    "check_key",
    "check_namespace",
    "decode_layer",
    "format_size",
    "parse_size",
]
