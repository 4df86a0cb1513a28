"""Chunk keys: 128-bit xxh3 digests of token ids under a salt, the same in every process and host.

prefix keys (chained):   k_0 = H(salt || tokens_0),  k_i = H(k_{i-1} || tokens_i)
segment keys (position-free):  H(salt || b"segment" || tokens)
segment keys after a declared shared prefix P:
    H(salt || b"after-prefix" || prefix_key(P) || tokens)
segment keys encoded after the engine's preamble E (no declared prefix; engine/encoding.py):
    H(salt || b"after-prefix" || prefix_key(E) || tokens), the same KV as after a declared E
KV head parts of a chunk (the chunk stored as one segment per KV head):
    H(b"kv-head" || chunk_key || head as u32)
where salt = Salt.digest() (16 bytes), tokens are little-endian int32 bytes and prefix_key(P)
is the chained key of P's last chunk (partial when P is not chunk-aligned).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from tierkv.storage_backends.names import KEY_NBYTES, check_namespace


def _field(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b  # length-prefixed, so ("ab","c") != ("a","bc")


@dataclass(frozen=True, slots=True)
class Salt:
    """What makes KV interchangeable. Two salts that differ in any field never share a key."""

    model_fingerprint: str  # architecture + weights digest (or checkpoint identity) + dtype
    kv_format: str  # layout, kv dtype, quantization, segment format version
    tp_size: int = 1
    tp_rank: int = 0
    chunk_size: int = 256
    namespace: str = "default"

    def __post_init__(self) -> None:
        if not (self.tp_size >= 1 and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"bad tensor-parallel rank {self.tp_rank} of size {self.tp_size}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if not self.model_fingerprint or not self.kv_format:
            raise ValueError("model_fingerprint and kv_format must be non-empty")
        check_namespace(self.namespace)

    def fingerprint(self) -> bytes:
        """16 bytes binding model, KV format, TP and chunk size (not the tenant): stored in
        headers."""
        data = (
            b"tierkv-salt-v1"
            + _field(self.model_fingerprint)
            + _field(self.kv_format)
            + struct.pack("<III", self.tp_size, self.tp_rank, self.chunk_size)
        )
        return xxhash.xxh3_128_digest(data)

    def digest(self) -> bytes:
        """16 bytes: the fingerprint plus the namespace; the seed of every key."""
        return xxhash.xxh3_128_digest(self.fingerprint() + _field(self.namespace))


def as_tokens(tokens) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array; ValueError on anything else."""
    if hasattr(tokens, "detach"):  # a torch tensor, without importing torch here
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.dtype("<i4") and (int(arr.min()) < 0 or int(arr.max()) >= 2**31):
        raise ValueError("token ids must be in [0, 2**31)")
    return np.ascontiguousarray(arr, dtype="<i4")


def head_key(key: bytes, head: int) -> bytes:
    """The key of KV head `head` of the chunk keyed `key`, when the chunk is stored as one
    segment per KV head (any tensor-parallel layout reads and writes the same parts)."""
    if len(key) != KEY_NBYTES or not 0 <= head < 2**32:
        raise ValueError(f"a head part needs a {KEY_NBYTES}-byte key and a u32 head")
    return xxhash.xxh3_128_digest(b"kv-head" + key + struct.pack("<I", head))


class ChunkHasher:
    """Turns token ids into chunk keys under one salt."""

    def __init__(self, salt: Salt) -> None:
        self.salt = salt
        self.chunk_size = salt.chunk_size
        self._seed = salt.digest()

    def salted(self, cache_salt: str | None) -> ChunkHasher:
        """This hasher under a per-request cache salt (a tenant's secret): its keys share
        nothing with another salt's, nor with the unsalted ones; None returns self."""
        if cache_salt is None:
            return self
        out = ChunkHasher(self.salt)
        out._seed = xxhash.xxh3_128_digest(self._seed + b"cache-salt" + _field(cache_salt))
        return out

    def chunks(self, tokens, partial: bool = False) -> list[tuple[int, int]]:
        n = len(tokens)
        c = self.chunk_size
        ends = list(range(c, n + 1, c))
        if partial and n % c:
            ends.append(n)
        return [(e - c if e % c == 0 else e - e % c, e) for e in ends]

    def prefix_keys(self, tokens, partial: bool = False) -> list[bytes]:
        """One chained key per full chunk (and the partial last chunk when partial)."""
        arr = as_tokens(tokens)
        mv = arr.data.cast("B")
        keys: list[bytes] = []
        prev = self._seed
        for a, b in self.chunks(arr, partial):
            h = xxhash.xxh3_128(prev)
            h.update(mv[4 * a : 4 * b])
            prev = h.digest()
            keys.append(prev)
        return keys

    def chunk_key(self, parent: bytes | None, tokens) -> bytes:
        """The key prefix_keys gives a chunk of these tokens after the chunk keyed parent (None:
        a prompt's first chunk): what a reader told a chunk's parent and tokens rebuilds."""
        h = xxhash.xxh3_128(self._seed if parent is None else parent)
        h.update(as_tokens(tokens).data.cast("B"))
        return h.digest()

    def prefix_key(self, tokens) -> bytes:
        """The chained key of the whole of tokens (its last chunk partial when not aligned): it
        names exactly these tokens at positions 0.. and nothing else."""
        if len(tokens) == 0:
            raise ValueError("a prefix key needs at least one token")
        return self.prefix_keys(tokens, partial=True)[-1]

    def segment_key(self, tokens, after: bytes | None = None) -> bytes:
        """Position-free key of a segment (a RAG document, a tool result): computed standalone,
        or, with after = prefix_key(P), computed right after the shared prefix P."""
        h = xxhash.xxh3_128(self._seed)
        if after is None:
            h.update(b"segment")
        else:  # a tag that differs from the first byte on: no standalone input equals this one
            if len(after) != KEY_NBYTES:
                raise ValueError(f"a prefix key has {KEY_NBYTES} bytes, got {len(after)}")
            h.update(b"after-prefix")
            h.update(after)
        h.update(as_tokens(tokens).data.cast("B"))
        return h.digest()

    def prefix_length(self, present: Sequence[bool]) -> int:
        """Number of leading chunks present: the reusable prefix of a chained key list."""
        n = 0
        for p in present:
            if not p:
                break
            n += 1
        return n
