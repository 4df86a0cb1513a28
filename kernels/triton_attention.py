"""Triton paged attention: one kernel for prefill, chunked prefill over a cached prefix,
decode and sparse query subsets (the shape of vLLM's unified Triton attention), plus a
split-K (flash-decoding) mode for small batches with long contexts.

A program owns BLOCK_Q query tokens x the GQA group of one KV head (BLOCK_M rows), walks
that sequence's keys tile by tile through the block table, and keeps an fp32 online
softmax. Query blocks map to sequences by a binary search over cu_seqlens_q, so the grid
needs no host-side sequence lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierkv.kernels.args import AttentionMeta, LayerCache, check_values
from tierkv.kernels.attention_launch import choose_splits, launch_config, num_sms
from tierkv.kernels.triton_common import cdiv, launch, rmax
from tierkv.kernels.triton_softmax import attend_keys, combine_splits


@triton.jit
def _find_seq(cu_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence b owns query blocks [cu[b] // BLOCK_Q + b, ...): a safe over-count per sequence.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        val = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        if val <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    bt_ptr,
    lens_ptr,
    cu_ptr,
    pos_ptr,
    ks_ptr,
    vs_ptr,
    part_acc,
    part_ml,
    scale,
    num_seqs,
    num_heads,
    s_qt,
    s_qh,
    s_ot,
    s_oh,
    s_kb,
    s_ks,
    s_kh,
    s_vb,
    s_vs,
    s_vh,
    s_bt,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    FP8: tl.constexpr,
    IEEE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(cu_ptr, qb, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    local = qb - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    offs_m = tl.arange(0, BLOCK_M)
    qi = local * BLOCK_Q + offs_m // G_PAD
    g = offs_m % G_PAD
    row_ok = (qi < q_len) & (g < G)
    tok = q_start + qi
    head = kvh * G + g
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_D
    q = tl.load(
        q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)  # a padding row sees no key
    kv_end = tl.minimum(tl.load(lens_ptr + seq), rmax(pos, 0) + 1)
    tiles = cdiv(kv_end, TILE_N)
    if NUM_SPLITS > 1:
        per = cdiv(tiles, NUM_SPLITS)
        t_lo = split * per
        t_hi = tl.minimum(t_lo + per, tiles)
    else:
        t_lo = 0
        t_hi = tiles
    m_i, l_i, acc = attend_keys(
        q,
        pos,
        k_ptr + kvh * s_kh,
        v_ptr + kvh * s_vh,
        bt_ptr + seq * s_bt,
        ks_ptr + kvh,
        vs_ptr + kvh,
        0,
        t_lo,
        t_hi,
        kv_end,
        scale,
        s_kb,
        s_ks,
        s_vb,
        s_vs,
        BLOCK_M,
        HEAD_D,
        D_PAD,
        BLOCK_SIZE,
        TILE_N,
        FP8,
        IEEE,
        CAUSAL=True,
    )
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # Partial results of this split: unnormalized acc, and (m, l) per row.
        row = (tok * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc + row[:, None] * D_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml + row * 2, m_i, mask=row_ok)
        tl.store(part_ml + row * 2 + 1, l_i, mask=row_ok)


def paged_attention_triton(
    q: torch.Tensor,
    cache: LayerCache,
    meta: AttentionMeta,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as paged_attention_ref. num_splits forces the split-K mode (a power of 2).
    A decode batch with cascade groups (meta.cascade) goes to kernels/triton_cascade.py."""
    check_values(q, cache, meta)
    k_cache, v_cache = cache.k, cache.v
    bt, lens, cu = meta.block_tables, meta.seq_lens, meta.cu_seqlens_q
    nq, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    b = lens.shape[0]
    out = torch.empty_like(q)
    if nq == 0 or b == 0:
        return out
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q and the caches need a contiguous head dim")
    if meta.cascade is not None and meta.max_seqlen_q == 1 and nq == b and num_splits is None:
        from tierkv.kernels.triton_cascade import cascade_decode_triton

        return cascade_decode_triton(q, cache, meta, scale)
    g = hq // hkv
    g_pad = triton.next_power_of_2(g)
    max_q = meta.max_seqlen_q
    if max_q is None:
        max_q = int((cu[1:] - cu[:-1]).max())
    if num_splits is None:
        max_k = meta.max_seqlen_k
        if max_k is None and max_q == 1:
            max_k = int(lens.max())
        num_splits = choose_splits(b, hkv, max_q, max_k or 0, num_sms(q.device))
    if num_splits > 1 and max_q != 1:
        raise ValueError("split-K serves decode batches (one query per sequence) only")
    block_m, tile_n, num_warps = launch_config(max_q, g_pad, q.is_cuda)
    block_q = max(block_m // g_pad, 1)
    d_pad = triton.next_power_of_2(d)
    fp8 = cache.fp8
    if num_splits > 1:
        part_acc = torch.empty(nq * hq * num_splits, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(nq * hq * num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    ks = cache.k_scale if fp8 else out
    vs = cache.v_scale if fp8 else out
    grid = (nq // block_q + b, hkv, num_splits)
    launch(_attn_kernel, grid)(
        q,
        k_cache,
        v_cache,
        out,
        bt,
        lens,
        cu,
        meta.q_positions,
        ks,
        vs,
        part_acc,
        part_ml,
        float(scale),
        b,
        hq,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        bt.stride(0),
        G=g,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        HEAD_D=d,
        D_PAD=d_pad,
        BLOCK_SIZE=bs,
        TILE_N=tile_n,
        FP8=fp8,
        IEEE=q.dtype == torch.float32,
        NUM_SPLITS=num_splits,
        num_warps=num_warps,
    )
    if num_splits > 1:
        launch(combine_splits, (nq, hq))(
            part_acc,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            hq,
            HEAD_D=d,
            D_PAD=d_pad,
            NUM_SPLITS=num_splits,
        )
    return out
