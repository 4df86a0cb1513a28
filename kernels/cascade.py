"""Cascade decode attention: decode sequences whose block tables start with the same block ids
(the prefix cache hands them the same blocks for the same prompt prefix) attend over those
shared keys once per step, all their queries together, and over their own suffixes one by one;
the two partial results are merged by log-sum-exp, which is exact (up to summation order).

This module holds the groups (CascadeGroups), how they are found in a batch's block tables
(find_groups), the torch reference (cascade_decode_ref), which computes each part as its own
attention with its log-sum-exp and merges them, and the Triton kernel's work list (part_items);
the C++ kernel is cpu.paged_decode_cascade, the Triton one triton_cascade.cascade_decode_triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tierkv.kernels.fp8 import is_fp8, need_scale

if TYPE_CHECKING:  # args.py imports this module (AttentionMeta.cascade)
    from tierkv.kernels.args import LayerCache

MIN_SHARED_BLOCKS = 1  # whole shared blocks that make a group (see find_groups)
MIN_MEMBERS = 2


@dataclass(slots=True)
class CascadeGroups:
    """Groups of decode sequences (indices into the batch) and, per group, the keys [0, shared)
    that every member reads through the same block ids. No sequence is in two groups."""

    members: list[list[int]]
    shared: list[int]
    _made: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        """make(), once per key for these groups (a kernel's tensors, made on the first layer of
        a step and kept while the engine keeps the groups)."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(members [M], starts [ng + 1], shared [ng]) int64 on device (the C++ op's form)."""

        def make() -> tuple[torch.Tensor, ...]:
            starts = [0]
            for m in self.members:
                starts.append(starts[-1] + len(m))
            flat = [i for m in self.members for i in m]
            cols = (flat, starts, self.shared)
            return tuple(torch.tensor(x, dtype=torch.int64, device=device) for x in cols)

        return self.cached(("cpp", device), make)  # type: ignore[no-any-return]


def find_groups(
    block_ids: list[list[int]],
    seen: list[int],
    block_size: int,
    min_blocks: int = MIN_SHARED_BLOCKS,
    min_members: int = MIN_MEMBERS,
) -> CascadeGroups:
    """Sequences grouped by their first block id; a group's shared keys are its members' longest
    common run of leading block ids, cut to the whole blocks every member has filled (a decode
    writes only into a block of its own: the engine copies a shared block before writing). Groups
    of fewer than min_members sequences or min_blocks shared blocks are dropped: their sequences
    take the plain decode. A prefix shared by only some members of a group (a tree of prefixes)
    counts as far as all of them share it. Cost: one pass over the shared block ids."""
    by_first: dict[int, list[int]] = {}
    for i, ids in enumerate(block_ids):
        if ids and seen[i] >= block_size:
            by_first.setdefault(ids[0], []).append(i)
    members, shared = [], []
    for group in by_first.values():
        if len(group) < min_members:
            continue
        lead = block_ids[group[0]]
        n = min(len(lead), *(seen[i] // block_size for i in group))
        for i in group[1:]:
            ids = block_ids[i]
            k = 0
            while k < n and ids[k] == lead[k]:
                k += 1
            n = k
        if n >= min_blocks:
            members.append(group)
            shared.append(n * block_size)
    return CascadeGroups(members, shared)


def attend_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of q [n, Hq, D] over all of k, v [T, Hkv, D] in fp32: (out [n, Hq, D], lse
    [n, Hq]); no keys: zeros and -inf."""
    n, hq, d = q.shape
    if k.shape[0] == 0:
        return q.new_zeros(n, hq, d, dtype=torch.float32), q.new_full(
            (n, hq), -torch.inf, dtype=torch.float32
        )
    g = hq // k.shape[1]
    kk = k.float().repeat_interleave(g, dim=1)  # [T, Hq, D]
    vv = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,thd->nht", q.float(), kk) * scale
    lse = torch.logsumexp(s, dim=2)
    out = torch.einsum("nht,thd->nhd", torch.exp(s - lse[..., None]), vv)
    return out, lse


def merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Two attentions of the same queries over disjoint key sets, each normalized with its
    log-sum-exp, as one attention over the union: weights exp(lse_i - lse). Both empty: zeros."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w1, w2 = torch.exp(lse1 - safe)[..., None], torch.exp(lse2 - safe)[..., None]
    return o1 * w1 + o2 * w2


def _keys(cache: LayerCache, blocks: torch.Tensor, k0: int, k1: int) -> tuple[torch.Tensor, ...]:
    """Keys [k0, k1) of a sequence with these block ids, dequantized: (k, v) [k1 - k0, Hkv, D]."""
    bs = cache.k.shape[1]
    t = torch.arange(k0, k1, device=blocks.device)
    out = []
    for side, sc in cache.sides():
        x = side[blocks[t // bs].long(), t % bs]
        if is_fp8(side):
            x = x.float() * need_scale(sc).view(1, -1, 1)
        out.append(x)
    return out[0], out[1]


def cascade_decode_ref(
    q: torch.Tensor,
    cache: LayerCache,
    ids: torch.Tensor,
    seen: torch.Tensor,
    groups: CascadeGroups,
    scale: float,
) -> torch.Tensor:
    """q [b, Hq, D], one query per sequence, over keys [0, seen[i]) of blocks ids[i] -> [b, Hq, D]
    in q's dtype: each group's shared keys gathered once for all its members' queries, each
    suffix on its own, merged by log-sum-exp. The plain decode (ref_attention) within fp32
    rounding. Contract: as cpu.paged_decode_cascade, on any device (slow: a test reference)."""
    b = q.shape[0]
    skip = [0] * b
    o_pre = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse_pre = torch.full(q.shape[:2], -torch.inf, device=q.device)
    for m, p in zip(groups.members, groups.shared):
        k, v = _keys(cache, ids[m[0]], 0, p)
        o_pre[m], lse_pre[m] = attend_lse(q[m], k, v, scale)
        for i in m:
            skip[i] = p
    out = torch.empty_like(q)
    for i in range(b):
        k, v = _keys(cache, ids[i], skip[i], int(seen[i]))
        o, lse = attend_lse(q[i : i + 1], k, v, scale)
        out[i] = merge(o_pre[i : i + 1], lse_pre[i : i + 1], o, lse)[0].to(q.dtype)
    return out


def part_items(
    groups: CascadeGroups, b: int, r: int, keys: int, device: torch.device
) -> tuple[int, list[torch.Tensor]]:
    """The Triton cascade's work list (kernels/triton_cascade.py) for a batch of b sequences:
    (n, [seq [n, r], lead [n], k0 [n], k1 [n], suffix [3, b], slots [b, S]]) int32 on device:
    n shared-keys items (r sequences of a group, `keys` keys each); the suffix items of
    the second launch, one per sequence (its index, first key, -1: to its length); each
    sequence's part slots (-1 padded)."""
    pre, skip = [], [0] * b
    for m, p in zip(groups.members, groups.shared):
        for a in range(0, len(m), r):
            for k0 in range(0, p, keys):
                pre.append((m[a : a + r], k0, min(p, k0 + keys)))
        for i in m:
            skip[i] = p
    parts: list[list[int]] = [[] for _ in range(b)]
    for n, (seqs, _, _) in enumerate(pre):
        for j, i in enumerate(seqs):
            parts[i].append(n * r + j)
    base = len(pre) * r  # the suffix launch's slots come after
    for i in range(b):
        parts[i].append(base + i)
    s = 1 << (max(len(x) for x in parts) - 1).bit_length()
    rows = [x + [-1] * (r - len(x)) for x, _, _ in pre] or [[-1] * r]
    cols = [
        rows,
        [x[0] for x, _, _ in pre] or [0],
        [k0 for _, k0, _ in pre] or [0],
        [k1 for _, _, k1 in pre] or [0],
        [list(range(b)), skip, [-1] * b],
        [x + [-1] * (s - len(x)) for x in parts],
    ]
    return len(pre), [torch.tensor(c, dtype=torch.int32, device=device) for c in cols]
