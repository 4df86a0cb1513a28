"""Randomized paged-attention batches for the kernel tests, and an independent dense
attention over them (per-token block walk + scaled_dot_product_attention with an
explicit position mask). No tests here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierkv.kernels import (
    FP8,
    AttentionMeta,
    LayerCache,
    dequantize_fp8,
    fp8_scales,
    quantize_fp8,
)

BLOCK = 16
PAD = 10**6  # block-table padding: any read of it would fault or fail the range check


@dataclass(slots=True)
class Batch:
    q: torch.Tensor
    cache: LayerCache
    meta: AttentionMeta
    scale: float
    blocks: list[list[int]]
    positions: list[list[int]]

    def slots_of(self, b: int) -> torch.Tensor:
        n = int(self.meta.seq_lens[b])
        t = torch.arange(n)
        return torch.tensor(self.blocks[b], dtype=torch.long)[t // BLOCK] * BLOCK + t % BLOCK


def _queries(n_keys: int, spec: int | str | list[int], g: torch.Generator) -> list[int]:
    if isinstance(spec, list):
        return spec
    if spec == "all":
        return list(range(n_keys))
    if spec == "sparse":
        if n_keys == 0:
            return []
        k = n_keys // 4 + 1
        return torch.randperm(n_keys, generator=g)[:k].tolist()  # shuffled, non-contiguous
    n = min(int(spec), n_keys)
    return list(range(n_keys - n, n_keys))


def make_batch(
    seed: int,
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    seqs: list[tuple[int, int | str | list[int]]],
    fp8: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> Batch:
    """seqs: (number of keys in the cache, queries: n = the last n positions, "all",
    "sparse" = a shuffled random subset, or a list of positions). Blocks come shuffled out
    of a larger pool."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n, _ in seqs]
    pool = torch.randperm(sum(need) + 7, generator=g).tolist()
    blocks, at = [], 0
    for n in need:
        blocks.append(pool[at : at + n])
        at += n
    width = max(max(need), 1) + 1
    bt = torch.full((len(seqs), width), PAD, dtype=torch.int32)
    for i, blk in enumerate(blocks):
        bt[i, : len(blk)] = torch.tensor(blk, dtype=torch.int32)
    nb = len(pool)
    k = torch.randn(nb, BLOCK, hkv, d, generator=g)
    v = torch.randn(nb, BLOCK, hkv, d, generator=g)
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = fp8_scales(k, 2), fp8_scales(v, 2)
        k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    else:
        k, v = k.to(cache_dtype or dtype), v.to(cache_dtype or dtype)
    positions = [_queries(n, spec, g) for n, spec in seqs]
    counts = torch.tensor([len(p) for p in positions])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    nq = int(cu[-1])
    return Batch(
        q=torch.randn(nq, hq, d, generator=g).to(dtype),
        cache=LayerCache(k, v, k_scale, v_scale),
        meta=AttentionMeta(
            bt,
            torch.tensor([n for n, _ in seqs], dtype=torch.int32),
            cu,
            torch.tensor(sum(positions, []), dtype=torch.int32),
        ),
        scale=d**-0.5,
        blocks=blocks,
        positions=positions,
    )


def _dense_kv(
    cache: torch.Tensor, scale: torch.Tensor | None, blocks: list[int], n: int
) -> torch.Tensor:
    rows = torch.cat([cache[b] for b in blocks])[:n] if blocks else cache[:0, 0]
    return dequantize_fp8(rows, scale) if rows.dtype == FP8 else rows.float()


def dense_attention(b: Batch) -> torch.Tensor:
    """Plain attention per sequence in fp32 over its gathered KV."""
    out = torch.zeros(b.q.shape, dtype=torch.float32)
    hq, hkv = b.q.shape[1], b.cache.k.shape[2]
    for i, pos in enumerate(b.positions):
        cu, lens = b.meta.cu_seqlens_q, b.meta.seq_lens
        s, e, n = int(cu[i]), int(cu[i + 1]), int(lens[i])
        if s == e or n == 0:
            continue
        k, v = (
            _dense_kv(c, sc, b.blocks[i], n).repeat_interleave(hq // hkv, 1)
            for c, sc in b.cache.sides()
        )
        mask = torch.arange(n)[None, :] <= torch.tensor(pos)[:, None]
        o = F.scaled_dot_product_attention(
            b.q[s:e].float().transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=b.scale,
        )
        out[s:e] = o.transpose(0, 1)
    return out.to(b.q.dtype)
