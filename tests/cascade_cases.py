"""Decode batches whose sequences share leading blocks, for the cascade attention tests (C++,
Triton, torch reference). No tests here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierkv.kernels import AttentionMeta, LayerCache, fp8_scales, quantize_fp8
from tierkv.kernels.cascade import CascadeGroups


@dataclass(slots=True)
class Case:
    q: torch.Tensor  # [b, Hq, D]
    cache: LayerCache
    ids: torch.Tensor  # int64 [b, nblk], valid ids everywhere
    seen: torch.Tensor  # int64 [b]
    groups: CascadeGroups
    scale: float

    def __repr__(self) -> str:  # hypothesis prints failing cases: shapes, not values
        return (
            f"Case(q={tuple(self.q.shape)} {self.q.dtype}, cache={tuple(self.cache.k.shape)} "
            f"{self.cache.k.dtype}, seen={self.seen.tolist()}, groups={self.groups.members} "
            f"shared={self.groups.shared})"
        )

    def meta(self) -> AttentionMeta:
        """The plain decode's metadata (one query per sequence at its last key), with the
        groups."""
        b = self.q.shape[0]
        pos = (self.seen - 1).clamp(min=0)
        cu = torch.arange(b + 1, dtype=torch.int32)
        return AttentionMeta(
            self.ids.int(), self.seen.int(), cu, pos.int(), 1, int(self.seen.max()), self.groups
        )


def make_case(
    seed: int,
    shared: list[int],
    sizes: list[int],
    suffix: list[int],
    heads: tuple[int, int, int],
    bs: int,
    dtype: torch.dtype,
    fp8: bool = False,
) -> Case:
    """Groups g of sizes[g] sequences sharing keys [0, shared[g]) through the same block ids
    (shuffled out of a pool; a part block is shared as a whole), then sequences in no group;
    sequence i sees suffix[i] more keys of its own blocks (len(suffix) sequences in all)."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = heads
    b = len(suffix)
    need = [-(-n // bs) for n in shared]
    starts, members = [0], []
    for n in sizes:
        members.append(list(range(starts[-1], starts[-1] + n)))
        starts.append(starts[-1] + n)
    assert starts[-1] <= b
    lead = [0] * b
    for g, m in enumerate(members):
        for i in m:
            lead[i] = shared[g]
    seen = [lead[i] + suffix[i] for i in range(b)]
    own = [-(-s // bs) - -(-p // bs) for s, p in zip(seen, lead)]
    pool = torch.randperm(sum(need) + sum(own) + 3, generator=gen).tolist()
    at, tables = 0, [[] for _ in range(b)]
    for g, m in enumerate(members):
        blocks = pool[at : at + need[g]]
        at += need[g]
        for i in m:
            tables[i] = list(blocks)
    for i in range(b):
        tables[i] += pool[at : at + own[i]]
        at += own[i]
    width = max(1, max(len(t) for t in tables))
    ids = torch.tensor([t + [pool[-1]] * (width - len(t)) for t in tables], dtype=torch.int64)
    nb = len(pool)
    k, v = (torch.randn(nb, bs, hkv, d, generator=gen) for _ in range(2))
    if fp8:
        ks, vs = fp8_scales(k, 2), fp8_scales(v, 2)
        cache = LayerCache(quantize_fp8(k, ks), quantize_fp8(v, vs), ks, vs)
    else:
        cache = LayerCache(k.to(dtype), v.to(dtype))
    q = torch.randn(b, hq, d, generator=gen).to(dtype)
    groups = CascadeGroups(members, [shared[g] for g in range(len(members))])
    return Case(q, cache, ids, torch.tensor(seen), groups, d**-0.5)
