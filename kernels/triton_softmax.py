"""The online softmax of the Triton attention kernels: the walk over one block table's key tiles
(attend_keys), shared by the paged attention kernel (kernels/triton_attention.py) and the
cascade's part kernel (kernels/triton_cascade.py), and the split-K combine of the paged kernel's
partial results by log-sum-exp (combine_splits).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tierkv.kernels.triton_common import rmax, rsum


@triton.jit
def attend_keys(
    q,
    pos,
    k_ptr,
    v_ptr,
    bt_row,
    ks_ptr,
    vs_ptr,
    n0,
    t_lo,
    t_hi,
    kv_end,
    scale,
    s_kb,
    s_ks,
    s_vb,
    s_vs,
    BLOCK_M: tl.constexpr,
    HEAD_D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    FP8: tl.constexpr,
    IEEE: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """q [BLOCK_M, D_PAD] over the keys of tiles [t_lo, t_hi) (tile t: keys n0 + t * TILE_N on,
    those below kv_end) of the block table at bt_row -> (m, l, acc): per row the running max,
    the softmax denominator and the unnormalized weighted V, in fp32. k_ptr, v_ptr, ks_ptr,
    vs_ptr point at the KV head's first element and scale (the scales read only with FP8).
    CAUSAL: row r sees keys up to pos[r] (-1: none); else pos is not read."""
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_D
    if FP8:
        k_sc = tl.load(ks_ptr)
        v_sc = tl.load(vs_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_PAD], 0.0, tl.float32)
    for t in range(t_lo, t_hi):
        offs_n = n0 + t * TILE_N + tl.arange(0, TILE_N)
        n_ok = offs_n < kv_end
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = offs_n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + blk[:, None] * s_kb + off[:, None] * s_ks + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr + blk[:, None] * s_vb + off[:, None] * s_vs + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if FP8:
            k = (k.to(tl.float32) * k_sc).to(q.dtype)
            v = (v.to(tl.float32) * v_sc).to(q.dtype)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        if CAUSAL:
            allowed = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        else:
            allowed = n_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, rmax(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + rsum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def combine_splits(
    part_acc,
    part_ml,
    out_ptr,
    s_ot,
    s_oh,
    num_heads,
    HEAD_D: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One (token, head)'s split-K partials (unnormalized acc, and (m, l) per split) merged by
    log-sum-exp into out; a split with no keys weighs 0, no keys at all give zeros."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    row = (tok * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml + row * 2)
    l_split = tl.load(part_ml + row * 2 + 1)  # each split's softmax denominator
    m_max = rmax(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_safe)  # an empty split has m = -inf: weight 0
    total = rsum(w * l_split, 0)
    offs_d = tl.arange(0, D_PAD)
    acc = tl.load(part_acc + row[:, None] * D_PAD + offs_d[None, :])
    o = rsum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + tok * s_ot + head * s_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_D,
    )
