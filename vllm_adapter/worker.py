"""Worker side: tierkv.connector.worker's core over vLLM's paged layouts (found from the
registered tensors), vLLM's layer names, and its metadata's saves. Each rank saves and loads
the KV head parts (tierkv.vllm.ranks) of the heads its cache holds, and nothing else.

Safety contract: the core's (tierkv.connector.transfer.PagedKV): nothing reaches vLLM's cache
before its segment passed the tier's checksum and the header check, and a load that fails,
times out or is cancelled scatters nothing more and names the blocks vLLM must recompute.
A save copies its tokens into a staging buffer inside save_kv_layer, while vLLM still holds
the blocks; the request's blocks are released only when its last put has finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierkv.connector.plan import LoadPlan, SavePlan
from tierkv.connector.transfer import Layout, LoadJob, PagedKV
from tierkv.connector.worker import WorkerCore
from tierkv.storage_backends.segment import KVSegment, dtype_name
from tierkv.vllm.blocks import Blocks
from tierkv.vllm.kvdtype import Stored
from tierkv.vllm.layout import PagedLayout, detect_layout, probe_tiles
from tierkv.vllm.ranks import Heads, PartNames
from tierkv.vllm.scheduler import TierKVMetadata

log = logging.getLogger("tierkv.vllm")
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(slots=True, eq=False)
class VllmKV(PagedKV):
    """vLLM's paged cache, one tensor per layer in any layout detect_layout knows, holding
    `paged.num_kv_heads` heads; each segment is a part of `layout.num_kv_heads` of them (its
    plans' parts in head order). KV is stored as the cache holds it: in its dtype, or the
    float8 values of an fp8 cache (uint8 tensors) with the layers' scales (`layout.scales`)."""

    layout: Layout
    dtype: torch.dtype
    scaled: bool
    paged: PagedLayout
    caches: list[torch.Tensor]
    blocks: Blocks = field(init=False)
    # vLLM's threads make the copies in wait_for_layer_load while the loop thread receives
    scatter_on_wait: bool = True

    def __post_init__(self) -> None:
        self.blocks = Blocks.of(self.paged)

    def gather(self, saves: list[SavePlan], layer: int, kv_layer: torch.Tensor) -> None:
        n, last, kv = self.layout.num_kv_heads, None, None
        for p in saves:
            at = (p.request_id, p.chunk.index)
            if at != last:  # the parts of one chunk follow each other: gather it once
                kv = self.blocks.gather(kv_layer, p.block_ids, p.chunk.start, p.chunk.end)
                last = at
            assert kv is not None
            p.staging[layer].view(kv.dtype).copy_(kv[:, :, p.head : p.head + n])  # bytes as held
            if p.scales is not None and self.layout.scales is not None:
                p.scales[layer] = torch.from_numpy(self.layout.scales[layer])

    def scatter(self, job: LoadJob, segs: list[list[KVSegment]], layer: int) -> None:
        cache, n = self.caches[layer], self.paged.num_kv_heads // self.layout.num_kv_heads
        for plan, good in zip(job.plans, segs):
            stop = plan.end if plan.failed_from is None else plan.failed_from
            # good holds whole chunks: a failed part stops its plan at its chunk's start
            for i in range(0, len(good) - n + 1, n):
                c = plan.chunks[i]
                lo, hi = max(plan.start, c.start), min(stop, c.end)
                if hi > lo:
                    parts = [
                        s.layer(layer)[:, lo - c.start : hi - c.start].view(cache.dtype)
                        for s in good[i : i + n]
                    ]
                    part = parts[0] if n == 1 else torch.cat(parts, dim=2)
                    self.blocks.scatter(cache, part, plan.block_ids, lo)


@dataclass(slots=True, eq=False)
class WorkerSide:
    """vLLM's worker hooks over the core: layer names, the metadata's saves, held blocks."""

    core: WorkerCore
    fingerprint: bytes  # the salt's: every segment this worker reads or writes carries it
    heads: Heads  # the KV heads this rank holds
    names: PartNames = field(default_factory=PartNames)  # head-0 parts -> chunks (events)
    index: dict[str, int] = field(default_factory=dict)  # layer name -> layer
    had_saves: set[str] = field(default_factory=set)  # requests the scheduler holds blocks for
    closing: set[str] = field(default_factory=set)  # finished requests waiting for their saves

    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        head_dim: int,
        write: Writer | None,
        stored: Stored | None = None,
    ) -> None:
        """stored: what the caches hold (default: values of their own dtype)."""
        self.index = {name: i for i, name in enumerate(kv_caches)}
        caches = list(kv_caches.values())
        first = caches[0]
        paged = detect_layout(first, self.heads.count, head_dim)
        if any(t.shape != first.shape or t.dtype != first.dtype for t in caches):
            raise ValueError("tierkv.vllm needs every layer's KV tensor alike (one KV group)")
        stored = stored or Stored(first.dtype)
        name = dtype_name(stored.dtype)
        if name is None or stored.dtype.itemsize != first.dtype.itemsize:
            raise ValueError(f"no segment can hold a {first.dtype} cache of {stored.dtype}")
        if paged.kind == "cpu_heads_first":
            if write is None:
                raise ValueError("the CPU layout needs the attention backend's KV writer")
            probe_tiles(paged, first.dtype, stored.dtype, write)
        scales = stored.part_scales()
        layout = Layout(len(caches), 1, head_dim, name, self.fingerprint, paged.block_size)
        layout.scales = scales
        self.core.register(VllmKV(layout, stored.dtype, scales is not None, paged, caches))
        h = self.heads
        log.info(
            "tierkv.vllm: %d layers, layout %s %s, KV heads [%d, %d) of %d",
            len(caches),
            paged.kind,
            list(first.shape),
            h.first,
            h.first + h.count,
            h.total,
        )

    def bind(self, meta: TierKVMetadata) -> None:
        """A new step: stage its saves (the buffers the forward's layers are copied into)."""
        staged = []
        self.names.note([s.chunk.key for s in meta.saves])
        for s in meta.saves:
            self.had_saves.add(s.request_id)  # reported by every rank, saving or not
            if not self.heads.saves:  # a replica of a head another rank saves
                continue
            for j, part in enumerate(self.heads.parts(s.chunk)):
                plan = self.core.stage(s.request_id, s.block_ids, part, s.tokens, head=j)
                if plan is not None:
                    staged.append(plan)
        self.core.bind(staged)

    def start_load(self, loads: list[LoadPlan]) -> None:
        """The step's loads over this rank's parts of their chunks."""
        self.names.note([c.key for p in loads for c in p.chunks])
        self.core.start_load([self.heads.plan(p) for p in loads])

    def wait_layer(self, name: str) -> None:
        self.core.wait_layer(self.index[name])

    def save_layer(self, name: str, kv_layer: torch.Tensor) -> None:
        self.core.save_layer(self.index[name], kv_layer)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks vLLM may free now: finished, every save of theirs put. vLLM
        names a finished request once, in the step after it ended, and may idle after that
        step: so this waits (at most load_timeout_s) for the puts of the requests it names
        now, and their blocks go back in this step unless a put is slower than that."""
        new = finished_req_ids & self.had_saves
        self.had_saves -= new
        self.closing |= new
        done = self.core.settled(self.closing, new)
        self.closing -= done
        return done
