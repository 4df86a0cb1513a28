"""Dense attention for a blend prefill's few rows, in torch: the keys of the whole sequence
gathered from the paged cache, the question's attention mass per key (the query rules'
ranking), and APE's attention with a per-block temperature (not in the C++/Triton kernels).

APE (arXiv 2502.05431), for a query with s = q.k / sqrt(d) over the keys it sees: the
still-cached context block C (loaded rows whose KV this layer did not recompute) and the rest R
(the prefix, recomputed and computed rows) are two blocks whose log-masses are T*S*LSE(s_C/T)
and LSE(s_R); inside C the weights are softmax(s_C/T), inside R softmax(s_R). With C empty
(every row recomputed) this is plain attention, exactly; T = S = 1 is plain attention too.
"""

from __future__ import annotations

import torch

ROWS = 256  # queries per chunk: the scores [Hq, rows, keys] of one chunk are in memory at once


def seq_slots(ctx, block_size: int, total: int) -> torch.Tensor:
    """Cache slots of positions 0..total-1 of the step's only sequence."""
    table = ctx.all.meta.block_tables[0].long()
    p = torch.arange(total, device=table.device)
    return table[p // block_size] * block_size + p % block_size


def read(runner, layer: int, which: int, slots: torch.Tensor) -> torch.Tensor:
    """The cached K (which=0) or V of cache slots, [len, Hkv, D]; an fp8 cache dequantized
    (float32)."""
    cache = runner.kv_caches[layer]
    flat = cache[which].view(-1, *cache.shape[3:])
    if flat.dtype.itemsize == 1:  # fp8: index its bytes, return real units
        x = flat.view(torch.uint8).index_select(0, slots).view(flat.dtype).float()
        return x * runner.kv_scales[layer, which].view(-1, 1)
    return flat.index_select(0, slots)


def seq_kv(runner, ctx, layer: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [total, Hkv, D] (float32) of the sequence's positions 0..total-1 at layer, as the
    cache holds them now."""
    slots = seq_slots(ctx, runner.config.block_size, total)
    return read(runner, layer, 0, slots).float(), read(runner, layer, 1, slots).float()


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """s [Hkv, rep, M, T] of q [M, Hq, D] over k [T, Hkv, D] (GQA: rep query heads per KV
    head)."""
    m, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(m, hkv, hq // hkv, d).permute(1, 2, 0, 3)
    return qg @ k.permute(1, 2, 0)[:, None] * scale


def attention_mass(
    q: torch.Tensor, qpos: torch.Tensor, k: torch.Tensor, scale: float
) -> torch.Tensor:
    """The attention probability each key [T] gets from the queries q [M, Hq, D] at positions
    qpos (causal), summed over heads and queries."""
    out = torch.zeros(k.shape[0], device=k.device)
    kpos = torch.arange(k.shape[0], device=k.device)
    for a in range(0, q.shape[0], ROWS):
        s = _scores(q[a : a + ROWS], k, scale)
        s = s.masked_fill(kpos[None, :] > qpos[a : a + ROWS, None], float("-inf"))
        out += s.softmax(-1).sum(dim=(0, 1, 2))
    return out


def ape_attention(
    q: torch.Tensor,
    qpos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cached: torch.Tensor,
    scale: float,
    temperature: float,
    mass_scale: float,
) -> torch.Tensor:
    """APE attention of q [M, Hq, D] at positions qpos over k, v [T, Hkv, D] (causal); cached
    [T] marks the context block. Returns [M, Hq, D] in q's dtype."""
    m, hq, d = q.shape
    kpos = torch.arange(k.shape[0], device=k.device)
    vg = v.permute(1, 0, 2)[:, None]  # [Hkv, 1, T, D]
    out = torch.empty(m, hq, d, dtype=q.dtype, device=q.device)
    inf = float("-inf")
    for a in range(0, m, ROWS):
        s = _scores(q[a : a + ROWS], k, scale)
        seen = kpos[None, :] <= qpos[a : a + ROWS, None]
        sc = (s / temperature).masked_fill(~(seen & cached), inf)
        sr = s.masked_fill(~(seen & ~cached), inf)
        lc, lr = torch.logsumexp(sc, -1), torch.logsumexp(sr, -1)
        # A query that sees no cached key: softmax of nothing is NaN, its block weighs 0.
        oc = torch.nan_to_num(sc.softmax(-1)) @ vg
        orest = torch.nan_to_num(sr.softmax(-1)) @ vg
        w = torch.stack([temperature * mass_scale * lc, lr]).softmax(0)[..., None]
        o = w[0] * oc + w[1] * orest  # [Hkv, rep, rows, D]
        out[a : a + ROWS] = o.permute(2, 0, 1, 3).reshape(-1, hq, d).to(q.dtype)
    return out
