"""The kernels' call shape: a layer's paged cache (LayerCache) and the queries' view of it
(AttentionMeta), with the argument checks that kernels/__init__.py runs once, before the torch
reference or the Triton kernel sees them: bad input is a ValueError before any read or write."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierkv.kernels.cascade import CascadeGroups
from tierkv.kernels.fp8 import is_fp8

INTS = (torch.int32, torch.int64)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(slots=True)
class LayerCache:
    """One layer's paged KV cache: k and v [num_blocks, block_size, Hkv, D] of one dtype. An
    fp8 cache has float32 per-head scales [Hkv]; any other dtype ignores them."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def of(cls, kv: torch.Tensor, scales: torch.Tensor | None = None) -> LayerCache:
        """A [2, num_blocks, block_size, Hkv, D] layer tensor with its scales [2, Hkv] (or None)."""
        if scales is None or not is_fp8(kv):
            return cls(kv[0], kv[1])
        return cls(kv[0], kv[1], scales[0], scales[1])

    @property
    def fp8(self) -> bool:
        return is_fp8(self.k)

    def sides(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """(k, k_scale), (v, v_scale)."""
        return (self.k, self.k_scale), (self.v, self.v_scale)

    def check(self) -> None:
        k, v = self.k, self.v
        if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(
                f"caches must be two equal [num_blocks, block_size, Hkv, D] tensors, got "
                f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
            )
        if self.fp8:
            for s in (self.k_scale, self.v_scale):
                if s is None or s.shape != (k.shape[2],):
                    raise ValueError(
                        f"an fp8 cache needs k_scale and v_scale of shape [{k.shape[2]}]"
                    )


@dataclass(slots=True)
class AttentionMeta:
    """Which keys each query sees: rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q belong to
    sequence b, whose keys [0, seq_lens[b]) lie in the blocks of block_tables[b]; the query at
    position p sees keys j <= p. Int tensors on q's device. max_seqlen_q/k are optional hints
    (they save a device sync when the Triton path chooses split-K). cascade: for a batch of
    decodes only (one query per sequence, at its last key), groups of sequences whose block
    tables share leading blocks (kernels/cascade.py); the decode kernels that serve it read the
    shared keys once per group, the others ignore it (the result is the same)."""

    block_tables: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B]
    cu_seqlens_q: torch.Tensor  # [B+1]
    q_positions: torch.Tensor  # [Nq] absolute positions
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    cascade: CascadeGroups | None = None


def check_attention(q: torch.Tensor, cache: LayerCache, meta: AttentionMeta) -> None:
    """Shapes and dtypes; the values (block ids, lengths) are checked by check_values."""
    cache.check()
    if q.dim() != 3:
        raise ValueError(f"q must be [Nq, Hq, D], got {tuple(q.shape)}")
    nq, hq, d = q.shape
    hkv = cache.k.shape[2]
    if cache.k.shape[3] != d or hq % hkv:
        raise ValueError(
            f"head dim {cache.k.shape[3]} vs {d}, or Hq={hq} not a multiple of Hkv={hkv}"
        )
    if q.dtype not in FLOATS:
        raise ValueError(f"q dtype {q.dtype} not supported")
    if cache.fp8:
        if any(s is None or s.dtype != torch.float32 for s in (cache.k_scale, cache.v_scale)):
            raise ValueError(f"fp8 KV needs float32 k_scale and v_scale of shape [{hkv}]")
    elif cache.k.dtype != q.dtype and cache.k.dtype not in FLOATS:
        raise ValueError(f"cache dtype {cache.k.dtype} not supported")
    b = meta.seq_lens.shape[0]
    bt, cu = meta.block_tables, meta.cu_seqlens_q
    if bt.dim() != 2 or bt.shape[0] != b or cu.shape != (b + 1,):
        raise ValueError(
            f"block_tables [B, max_blocks], seq_lens [B], cu_seqlens_q [B+1] disagree: "
            f"{tuple(bt.shape)}, {tuple(meta.seq_lens.shape)}, {tuple(cu.shape)}"
        )
    if meta.q_positions.shape != (nq,):
        raise ValueError(f"q_positions must be [{nq}], got {tuple(meta.q_positions.shape)}")
    for name in ("block_tables", "seq_lens", "cu_seqlens_q", "q_positions"):
        t = getattr(meta, name)
        if t.dtype not in INTS or t.device != q.device:
            raise ValueError(f"{name} must be an int32/int64 tensor on {q.device}")


def check_values(q: torch.Tensor, cache: LayerCache, meta: AttentionMeta) -> None:
    """Range checks in one host sync: a bad block id must be an error, never a wild read."""
    bt, bs = meta.block_tables, cache.k.shape[1]
    cu, lens, pos = meta.cu_seqlens_q.long(), meta.seq_lens.long(), meta.q_positions
    need = (lens + bs - 1) // bs
    used = torch.arange(bt.shape[1], device=q.device) < need[:, None]
    zero = torch.zeros((), dtype=torch.bool, device=q.device)
    flags = torch.stack(
        [
            (cu[0] != 0) | (cu[-1] != q.shape[0]) | (cu[1:] < cu[:-1]).any(),
            (lens < 0).any() | (pos < 0).any() if pos.numel() else (lens < 0).any(),
            need.max() > bt.shape[1] if need.numel() else zero,
            (used & ((bt < 0) | (bt >= cache.k.shape[0]))).any(),
        ]
    ).tolist()
    for bad, msg in zip(
        flags,
        (
            "cu_seqlens_q must rise from 0 to Nq",
            "seq_lens and q_positions must be >= 0",
            "a sequence has more keys than its block table covers",
            "block table entry outside the cache",
        ),
    ):
        if bad:
            raise ValueError(msg)


def check_write(
    k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor
) -> None:
    cache.check()
    kc = cache.k
    n = k.shape[0]
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != kc.shape[2:]:
        raise ValueError(
            f"k, v must be [N, Hkv, D] matching the cache, got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if slot_mapping.shape != (n,) or slot_mapping.dtype not in INTS:
        raise ValueError(f"slot_mapping must be int [{n}]")
    if n and int(slot_mapping.max()) >= kc.shape[0] * kc.shape[1]:
        raise ValueError("slot_mapping points past the end of the cache")
    if not kc.is_contiguous() or not cache.v.is_contiguous():
        raise ValueError("caches must be contiguous")


def check_move(
    cache: LayerCache,
    block_ids: torch.Tensor,
    start: int,
    seg: torch.Tensor,
    seg_scales: torch.Tensor | None,
) -> None:
    """A gather or scatter of tokens [start, start + length) of a request with these block ids,
    to or from the segment slice seg [2, length, Hkv, D] (fp8: with scales [2, Hkv])."""
    cache.check()
    nb, bs, h, d = cache.k.shape
    length = seg.shape[1] if seg.dim() == 4 else -1
    if seg.shape != (2, length, h, d):
        raise ValueError(f"segment slice must be [2, {length}, {h}, {d}], got {tuple(seg.shape)}")
    if is_fp8(seg) and (seg_scales is None or seg_scales.shape != (2, h)):
        raise ValueError(f"an fp8 segment needs scales of shape [2, {h}]")
    if start < 0 or length < 0 or block_ids.dim() != 1:
        raise ValueError(f"bad token range start={start} length={length} or block_ids shape")
    end = -(-(start + length) // bs)
    if end > block_ids.numel():
        raise ValueError(f"tokens [{start}, {start + length}) exceed {block_ids.numel()} blocks")
    used = block_ids[start // bs : end]
    if length and ((used < 0) | (used >= nb)).any():
        raise ValueError("block id outside the cache")


__all__ = ["AttentionMeta", "LayerCache"]
