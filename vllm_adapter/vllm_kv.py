"""VllmKV: the connector's PagedKV (tierkv.connector.transfer) over vLLM's paged cache: the
gather of a save's tokens into its staging buffers, the scatter of loaded segments into the
blocks (safety contract: the worker side's, tierkv.vllm.worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tierkv.connector.plan import SavePlan
from tierkv.connector.transfer import Layout, LoadJob, PagedKV
from tierkv.storage_backends.segment import KVSegment
from tierkv.vllm.blocks import Blocks
from tierkv.vllm.groups import NULL, held_range
from tierkv.vllm.layout import PagedLayout


@dataclass(slots=True, eq=False)
class VllmKV(PagedKV):
    """vLLM's paged cache, one tensor per layer in any layout detect_layout knows, holding
    `paged.num_kv_heads` heads; each segment is a part of `layout.num_kv_heads` of them (its
    plans' parts in head order). KV is stored as the cache holds it: in its dtype, or the
    float8 values of an fp8 cache (uint8 tensors) with the layers' scales (`layout.scales`).
    Layer l lies in the blocks of group `group[l]`: a save's block_ids and `tables` (this
    step's loads) hold one row per group."""

    layout: Layout
    dtype: torch.dtype
    scaled: bool
    paged: PagedLayout
    caches: list[torch.Tensor]
    group: list[int]  # layer -> its KV cache group
    windowed: list[bool]  # group -> keeps only a sliding window (its table has nulls)
    tables: dict[str, torch.Tensor] = field(default_factory=dict)  # request -> [groups, blocks]
    blocks: Blocks = field(init=False)
    # vLLM's threads make the copies in wait_for_layer_load while the loop thread receives
    scatter_on_wait: bool = True

    def __post_init__(self) -> None:
        self.blocks = Blocks.of(self.paged)

    def gather(self, saves: list[SavePlan], layer: int, kv_layer: torch.Tensor) -> None:
        n, last, kv, g = self.layout.num_kv_heads, None, None, self.group[layer]
        bs = self.paged.block_size
        for p in saves:
            at = (p.request_id, p.chunk.index)
            if at != last:  # the parts of one chunk follow each other: gather it once
                c, ids = p.chunk, p.block_ids[g]
                kv = self.blocks.gather(kv_layer, ids, c.start, c.end)
                if self.windowed[g]:  # blocks vLLM may have handed on: zeros, not their bytes
                    gone = ids.to(torch.long)[torch.arange(c.start, c.end) // bs] == NULL
                    kv[:, gone.to(kv.device)] = 0
                last = at
            assert kv is not None
            p.staging[layer].view(kv.dtype).copy_(kv[:, :, p.head : p.head + n])  # bytes as held
            if p.scales is not None and self.layout.scales is not None:
                p.scales[layer] = torch.from_numpy(self.layout.scales[layer])

    def scatter(self, job: LoadJob, segs: list[list[KVSegment]], layer: int) -> None:
        cache, n = self.caches[layer], self.paged.num_kv_heads // self.layout.num_kv_heads
        g, bs = self.group[layer], self.paged.block_size
        for plan, good in zip(job.plans, segs):
            ids = self.tables[plan.request_id][g]
            stop = plan.end if plan.failed_from is None else plan.failed_from
            # good holds whole chunks: a failed part stops its plan at its chunk's start
            for i in range(0, len(good) - n + 1, n):
                c = plan.chunks[i]
                lo, hi = max(plan.start, c.start), min(stop, c.end)
                if self.windowed[g]:  # only the blocks vLLM allocated for the window
                    lo = held_range(ids, lo, hi, bs)
                if hi > lo:
                    parts = [
                        s.layer(layer)[:, lo - c.start : hi - c.start].view(cache.dtype)
                        for s in good[i : i + n]
                    ]
                    part = parts[0] if n == 1 else torch.cat(parts, dim=2)
                    self.blocks.scatter(cache, part, ids, lo)
