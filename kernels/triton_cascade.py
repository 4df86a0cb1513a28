"""Triton cascade decode attention (kernels/cascade.py): decode sequences that share leading
blocks attend over the shared keys once, their query heads stacked as one program's rows, and
over their own suffixes one program per (sequence, KV head); every part writes its normalized
output and log-sum-exp, and a second kernel merges each sequence's parts by log-sum-exp.

Items: a program (item, KV head) owns up to R sequences' rows (R * G_PAD <= BLOCK_M) and a key
range [k0, k1) of one block table; shared keys come in runs of PREFIX_KEYS so a few long prefixes
still fill the device. The items come from the groups on the host, once
(kernels/cascade.part_items, cached on the groups).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierkv.kernels.args import AttentionMeta, LayerCache
from tierkv.kernels.attention_launch import LAUNCH
from tierkv.kernels.cascade import part_items
from tierkv.kernels.triton_common import cdiv, launch, rmax, rsum
from tierkv.kernels.triton_softmax import attend_keys

PREFIX_ROWS = 64  # most query rows of a shared-keys program (sequences x padded GQA group)
PREFIX_KEYS = 512  # keys per shared-keys item
MIN_ROWS = 16  # tl.dot needs 16 rows


@triton.jit
def _part_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    lens_ptr,
    seq_ptr,
    lead_ptr,
    k0_ptr,
    k1_ptr,
    ks_ptr,
    vs_ptr,
    part_o,
    part_lse,
    scale,
    num_heads,
    s_qt,
    s_qh,
    s_kb,
    s_ks,
    s_kh,
    s_vb,
    s_vs,
    s_vh,
    s_bt,
    R: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    FP8: tl.constexpr,
    IEEE: tl.constexpr,
):
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    j = offs_m // G_PAD
    g = offs_m % G_PAD
    seq = tl.load(seq_ptr + item * R + j, mask=j < R, other=-1)
    row_ok = (j < R) & (g < G) & (seq >= 0)
    head = kvh * G + g
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_D
    q = tl.load(
        q_ptr + seq[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    lead = tl.load(lead_ptr + item)
    k0 = tl.load(k0_ptr + item)
    k1 = tl.load(k1_ptr + item)
    if k1 < 0:  # a suffix: to the sequence's own length
        k1 = tl.load(lens_ptr + lead)
    m_i, l_i, acc = attend_keys(
        q,
        seq,  # not read: the suffix and shared keys are all below each row's query
        k_ptr + kvh * s_kh,
        v_ptr + kvh * s_vh,
        bt_ptr + lead * s_bt,
        ks_ptr + kvh,
        vs_ptr + kvh,
        k0,
        0,
        cdiv(k1 - k0, TILE_N),
        k1,
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
        CAUSAL=False,
    )
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    slot = (item * R + j) * num_heads + head  # this row's part
    tl.store(part_o + slot[:, None] * D_PAD + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(part_lse + slot, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    part_o,
    part_lse,
    slots_ptr,
    out_ptr,
    s_ot,
    s_oh,
    num_heads,
    HEAD_D: tl.constexpr,
    D_PAD: tl.constexpr,
    S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + seq * S + tl.arange(0, S))  # -1: none
    row = tl.where(slot >= 0, slot, 0) * num_heads + head
    lse = tl.load(part_lse + row, mask=slot >= 0, other=float("-inf"))
    m = rmax(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # a part with no keys: 0
    offs_d = tl.arange(0, D_PAD)
    o = tl.load(
        part_o + row[:, None] * D_PAD + offs_d[None, :], mask=(slot >= 0)[:, None], other=0.0
    )
    total = rsum(w, 0)
    res = rsum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * s_ot + head * s_oh + offs_d,
        res.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_D,
    )


def cascade_decode_triton(
    q: torch.Tensor, cache: LayerCache, meta: AttentionMeta, scale: float
) -> torch.Tensor:
    """A decode batch (one query per sequence, at its last key; meta checked by the caller) with
    the groups of meta.cascade: the plain decode's result (paged_attention_triton) within the
    kernels' rounding. Contract: every member of group g holds the same block ids for keys
    [0, shared[g]) (find_groups' groups do), and sees them."""
    groups = meta.cascade
    assert groups is not None  # the caller's dispatch
    k_cache, v_cache = cache.k, cache.v
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    g_pad = triton.next_power_of_2(g)
    r = max(1, PREFIX_ROWS // g_pad)
    key = ("triton", q.device, r, b)
    n_pre, (seq, lead, k0, k1, suffix, slots) = groups.cached(
        key, lambda: part_items(groups, b, r, PREFIX_KEYS, q.device)
    )
    d_pad = triton.next_power_of_2(d)
    part_o = torch.empty((n_pre * r + b) * hq, d_pad, dtype=torch.float32, device=q.device)
    part_lse = torch.empty((n_pre * r + b) * hq, dtype=torch.float32, device=q.device)
    fp8 = cache.fp8
    ks = cache.k_scale if fp8 else part_lse
    vs = cache.v_scale if fp8 else part_lse
    common = (
        float(scale),
        hq,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_tables.stride(0),
    )
    consts = dict(G=g, G_PAD=g_pad, HEAD_D=d, D_PAD=d_pad, BLOCK_SIZE=bs, FP8=fp8)
    bt, lens = meta.block_tables, meta.seq_lens

    def part(n: int, rows: int, at: int, items: tuple[torch.Tensor, ...]) -> None:
        """n items of `rows` sequences each (seq, lead, k0, k1), parts from slot `at` on."""
        launch(_part_kernel, (n, hkv))(
            q,
            k_cache,
            v_cache,
            bt,
            lens,
            *items,
            ks,
            vs,
            part_o[at * hq :],
            part_lse[at * hq :],
            *common,
            R=rows,
            BLOCK_M=max(MIN_ROWS, triton.next_power_of_2(rows * g_pad)),
            TILE_N=LAUNCH.tile_n,
            IEEE=q.dtype == torch.float32,
            num_warps=LAUNCH.decode_warps,
            **consts,
        )

    if n_pre:  # the shared keys
        part(n_pre, r, 0, (seq, lead, k0, k1))
    part(b, 1, n_pre * r, (suffix[0].view(b, 1), suffix[0], suffix[1], suffix[2]))  # suffixes
    out = torch.empty_like(q)
    launch(_merge_kernel, (b, hq))(
        part_o,
        part_lse,
        slots,
        out,
        out.stride(0),
        out.stride(1),
        hq,
        HEAD_D=d,
        D_PAD=d_pad,
        S=slots.shape[1],
    )
    return out
