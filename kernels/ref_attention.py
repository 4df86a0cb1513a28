"""Torch reference of paged attention: the engine's CPU path, vectorized over sequences.

Decode sequences (one query each) run as one padded batch over whole blocks; a sequence
with several queries (prefill, chunked prefill, CacheBlend's sparse recompute) runs as its
own SDPA call, so a long prefill never pads the decodes beside it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierkv.kernels import cpu
from tierkv.kernels.args import AttentionMeta, LayerCache, check_values
from tierkv.kernels.fp8 import is_fp8, need_scale

PLANS = 8  # plans kept per thread: an engine step makes one call per decode group and layer
CHUNK = 64  # query rows per masked SDPA call: each call reads keys only up to its last position


class _Workspace(threading.local):
    """Per-thread scratch for gathered K/V, reused across calls: a fresh multi-MiB tensor per
    call costs more in page faults than the gather itself. Grows to the largest batch seen.
    Also the last PLANS calls' plans."""

    def __init__(self) -> None:
        self.bufs: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self.plans: list[_Plan] = []  # the latest first, see _plan

    def get(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self.bufs.get((slot, dtype, device))
        if buf is None or buf.numel() < numel:
            # A normal tensor even when the first caller runs under inference_mode: an inference
            # tensor could not be written by a later caller outside it.
            with torch.inference_mode(False):
                buf = torch.empty(numel, dtype=dtype, device=device)
            self.bufs[(slot, dtype, device)] = buf
        return buf[:numel]


_WS = _Workspace()


def head_rows(
    block_tables: torch.Tensor, length: int, num_blocks: int, block_size: int, heads: int
) -> torch.Tensor:
    """Row ids into a cache viewed as [num_blocks * block_size * heads, D] that lay keys
    [0, length) of each block table out as [B, heads, length] (SDPA's layout)."""
    nblk = -(-length // block_size)
    bt = block_tables[:, :nblk].long().clamp(0, num_blocks - 1)  # padding entries may hold anything
    dev = bt.device
    rows = (
        bt[:, None, :, None] * (block_size * heads)
        + torch.arange(heads, device=dev)[None, :, None, None]
        + torch.arange(0, block_size * heads, heads, device=dev)
    )
    return rows.flatten(2)[:, :, :length].reshape(-1)


def gather_heads(
    cache: torch.Tensor, rows: torch.Tensor, batch: int, length: int, slot: int
) -> torch.Tensor:
    """cache rows `rows` as [batch, H, length, D], in one index_select into workspace `slot`
    (overwritten by the next call with that slot)."""
    d = cache.shape[3]
    out = _WS.get(slot, rows.numel() * d, cache.dtype, cache.device).view(-1, d)
    src = cache.view(torch.uint8) if is_fp8(cache) else cache  # CPU index_select lacks fp8
    torch.index_select(src.reshape(-1, d), 0, rows, out=out.view(src.dtype))
    return out.view(batch, cache.shape[2], length, d)


def _dense_kv(
    cache: LayerCache, bt: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = head_rows(bt, length, *cache.k.shape[:3])
    out = []
    for i, (side, scale) in enumerate(cache.sides()):
        x = gather_heads(side, rows, bt.shape[0], length, i)
        if is_fp8(side):
            x = (x.float() * need_scale(scale).view(1, -1, 1, 1)).to(dtype)
        out.append(x if x.dtype == dtype else x.to(dtype))
    return out[0], out[1]


def gather_blocks(cache: torch.Tensor, ids: torch.Tensor, batch: int, slot: int) -> torch.Tensor:
    """Blocks `ids` (flattened [batch, nblk], valid ids) as [batch, nblk * block_size, Hkv, D], in
    one index_select of whole blocks (contiguous rows of bs * Hkv * D) into workspace `slot`:
    memcpy speed, where a per-token head-major gather moves rows of D elements."""
    nb, bs, hkv, d = cache.shape
    src = cache.view(torch.uint8) if is_fp8(cache) else cache  # CPU index_select lacks fp8
    out = _WS.get(slot, ids.numel() * bs * hkv * d, src.dtype, cache.device).view(-1, bs * hkv * d)
    torch.index_select(src.view(nb, -1), 0, ids, out=out)
    return out.view(cache.dtype).view(batch, -1, hkv, d)


@dataclass(slots=True)
class _Plan:
    """What the reference derives from the metadata alone (checked once): reused while equal
    metadata comes back, as it does for every layer of an engine step (one per call group)."""

    key: list  # copies of the metadata it was built from, then (Nq, cache shape, device)
    pos: torch.Tensor  # int64 [Nq]
    dec_rows: torch.Tensor | None  # query row of each decode sequence; None: no decodes
    dec_all: bool  # the decode rows are all of q, in order
    dec_ids: torch.Tensor | None  # int64 [b * nblk] cache blocks of the decodes, padding clamped
    dec_visible: torch.Tensor | None  # bool [b, 1, 1, nblk * bs]: key j of decode i is visible
    dec_seen: torch.Tensor | None  # int64 [b]: keys visible to decode i (a prefix of its blocks)
    # The others: (sequence, first row, end row, keys, row chunks of _chunks).
    prefills: list[tuple[int, int, int, int, list[tuple[int, int, int]]]]


def _plan(q: torch.Tensor, cache: LayerCache, meta: AttentionMeta) -> _Plan:
    ts = (meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.q_positions)
    geo = (q.shape[0], tuple(cache.k.shape), q.device)
    plans = _WS.plans
    for i, old in enumerate(plans):
        # By value (a few hundred ints): inference tensors keep no version counter to trust.
        if old.key[4] == geo and all(
            x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ts, old.key)
        ):
            plans.insert(0, plans.pop(i))
            return old
    key = [t.clone() for t in ts] + [geo]
    check_values(q, cache, meta)
    lens, cu, pos = meta.seq_lens.long(), meta.cu_seqlens_q.long(), meta.q_positions.long()
    counts = cu[1:] - cu[:-1]
    dec = torch.nonzero((counts == 1) & (lens > 0)).flatten()
    rows = ids = visible = seen = None
    if dec.numel():
        rows, bs = cu[dec], cache.k.shape[1]
        nblk = -(-int(lens[dec].max()) // bs)
        ids = meta.block_tables[dec, :nblk].long().clamp(0, cache.k.shape[0] - 1).flatten()
        seen = torch.minimum(lens[dec], pos[rows] + 1)  # key j is seen iff j < seq_len and j <= pos
        visible = (torch.arange(nblk * bs, device=q.device) < seen[:, None])[:, None, None, :]
    # A sequence with no keys has nothing to attend to: its rows stay zero.
    pre = [
        (b, int(cu[b]), int(cu[b + 1]), int(lens[b]), _chunks(pos[cu[b] : cu[b + 1]], int(lens[b])))
        for b in torch.nonzero((counts > 1) & (lens > 0)).flatten().tolist()
    ]
    dec_all = rows is not None and rows.numel() == q.shape[0]  # one row each: rows are 0..Nq-1
    plans.insert(0, _Plan(key, pos, rows, dec_all, ids, visible, seen, pre))
    del plans[PLANS:]
    return plans[0]


def _chunks(pos: torch.Tensor, length: int) -> list[tuple[int, int, int]]:
    """Row chunks of a masked prefill with the keys each needs (up to its last visible
    position): sparse or offset queries then cost about their causal share of the key
    rectangle, not all of it. [] for a whole prompt from position 0 (SDPA's causal path)."""
    n = pos.shape[0]
    if n == length and torch.equal(pos, torch.arange(n, device=pos.device)):
        return []
    top = F.pad(pos, (0, -n % CHUNK), value=-1).view(-1, CHUNK).amax(1).add_(1).clamp_(max=length)
    return [(i * CHUNK, min(n, (i + 1) * CHUNK), t) for i, t in enumerate(top.tolist())]


def _decode(
    q: torch.Tensor, plan: _Plan, cache: LayerCache, scale: float, cpu_kernel: bool
) -> torch.Tensor:
    """One query per sequence: q [b, Hq, D] over the plan's decode blocks -> [b, Hq, D].

    Keys stay in the gathered token-major layout [b, T, Hkv, D] and reach SDPA as a strided
    head-major view, each KV head's query group as its query rows: CPU SDPA's flash path then
    reads K and V once and does its fp32 math in tiles, where a bf16 bmm can fall back to a
    slow GEMM on CPUs without native bf16."""
    b, hq, d = q.shape
    dec_ids, dec_seen = plan.dec_ids, plan.dec_seen
    assert dec_ids is not None and dec_seen is not None  # called only for a plan with decodes
    if cpu_kernel and cpu.decode_fits(q, cache):
        return cpu.paged_decode(q, cache, dec_ids.view(b, -1), dec_seen, scale)
    hkv = cache.k.shape[2]
    kv = []
    for i, (side, sc) in enumerate(cache.sides()):
        x = gather_blocks(side, dec_ids, b, i)
        if is_fp8(side):
            x = x.float() * need_scale(sc).view(1, 1, -1, 1)
        kv.append((x if x.dtype == q.dtype else x.to(q.dtype)).transpose(1, 2))
    o = F.scaled_dot_product_attention(
        q.view(b, hkv, hq // hkv, d), kv[0], kv[1], attn_mask=plan.dec_visible, scale=scale
    )
    return o.reshape(b, hq, d)


def _prefill(
    q: torch.Tensor,
    pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[tuple[int, int, int]],
    scale: float,
) -> torch.Tensor:
    """Several queries of one sequence: q [Lq, Hq, D], k/v [1, Hkv, T, D] -> [Lq, Hq, D]."""
    qt = q.transpose(0, 1)[None]
    if not chunks:  # a whole prompt from position 0: SDPA's own causal mask skips masked tiles
        out = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    out = torch.empty_like(q)
    for s, e, t in chunks:  # t >= 1: keys and positions are checked non-negative
        mask = torch.arange(t, device=q.device)[None, :] <= pos[s:e, None]
        o = F.scaled_dot_product_attention(
            qt[:, :, s:e], k[:, :, :t], v[:, :, :t], attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[s:e] = o[0].transpose(0, 1)
    return out


def paged_attention_ref(
    q: torch.Tensor,
    cache: LayerCache,
    meta: AttentionMeta,
    scale: float,
    cpu_kernel: bool = False,
) -> torch.Tensor:
    """Arguments as kernels.paged_attention checks them; the values are checked here, once per
    plan. cpu_kernel: the C++ kernels (kernels/cpu.py) are on and built, so decodes and prefills
    go through them where their limits admit the call (the engine's CPU path); False keeps
    everything in torch (the reference proper)."""
    if q.shape[0] == 0:
        check_values(q, cache, meta)
        return torch.zeros_like(q)
    plan = _plan(q, cache, meta)
    if plan.dec_all:
        return _decode(q, plan, cache, scale, cpu_kernel)
    out = torch.zeros_like(q)
    if plan.dec_rows is not None:
        out[plan.dec_rows] = _decode(q[plan.dec_rows], plan, cache, scale, cpu_kernel)
    # The prefill kernel also needs the cache in q's dtype.
    kernel = cpu_kernel and cpu.prefill_fits(q, cache.k[0], cache.v[0])
    bs = cache.k.shape[1]
    for b, s, e, t, chunks in plan.prefills:
        bt = meta.block_tables[b : b + 1]
        if kernel:  # whole blocks gathered token-major, then the C++ kernel
            ids = bt[0, : -(-t // bs)].long()
            k, v = (gather_blocks(c, ids, 1, i)[0, :t] for i, c in enumerate((cache.k, cache.v)))
            out[s:e] = cpu.prefill_attention(q[s:e], k, v, plan.pos[s:e], scale)
            continue
        k, v = _dense_kv(cache, bt, t, q.dtype)
        out[s:e] = _prefill(q[s:e], plan.pos[s:e], k, v, chunks, scale)
    return out
