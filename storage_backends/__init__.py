"""KV segments, chunk keys, the tier interface and the local tiers behind one tiered store."""

from tierkv.storage_backends.base_tier import BaseTier
from tierkv.storage_backends.indexed_tier import IndexedTier
from tierkv.storage_backends.invariants import InvariantError
from tierkv.storage_backends.keys import ChunkHasher, Salt
from tierkv.storage_backends.leases import Lease
from tierkv.storage_backends.names import DEFAULT_NAMESPACE, check_key, check_namespace
from tierkv.storage_backends.segment import (
    DTYPES,
    KVSegment,
    SegmentError,
    SegmentHeader,
    decode_layer,
    dtype_name,
)
from tierkv.storage_backends.sizes import MiB, format_size, parse_size
from tierkv.storage_backends.stats import TierStats
from tierkv.storage_backends.tier import SegmentLayer, Tier

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
