"""Worker side: tierkv.connector.worker's core over vLLM's paged layouts (found from the
registered tensors), vLLM's layer names, and its metadata's saves.

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

from tierkv.connector.plan import SavePlan
from tierkv.connector.transfer import Layout, LoadJob, PagedKV
from tierkv.connector.worker import WorkerCore
from tierkv.storage_backends.segment import KVSegment, dtype_name
from tierkv.vllm import layout as paged_io
from tierkv.vllm.layout import PagedLayout, detect_layout, probe_tiles
from tierkv.vllm.scheduler import TierKVMetadata

log = logging.getLogger("tierkv.vllm")
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(slots=True, eq=False)
class VllmKV(PagedKV):
    """vLLM's paged cache, one tensor per layer in any layout detect_layout knows; KV is
    stored in the cache's own dtype."""

    layout: Layout
    dtype: torch.dtype
    scaled: bool
    paged: PagedLayout
    caches: list[torch.Tensor]

    def gather(self, saves: list[SavePlan], layer: int, kv_layer: torch.Tensor) -> None:
        for p in saves:
            kv = paged_io.gather(self.paged, kv_layer, p.block_ids, p.chunk.start, p.chunk.end)
            p.staging[layer].copy_(kv)

    def scatter(self, job: LoadJob, segs: list[list[KVSegment]], layer: int) -> None:
        cache = self.caches[layer]
        for plan, good in zip(job.plans, segs):
            stop = plan.end if plan.failed_from is None else plan.failed_from
            for seg, c in zip(good, plan.chunks):
                lo, hi = max(plan.start, c.start), min(stop, c.end)
                if hi > lo:
                    part = seg.layer(layer)[:, lo - c.start : hi - c.start]
                    paged_io.scatter(self.paged, cache, part, plan.block_ids, lo)


@dataclass(slots=True, eq=False)
class WorkerSide:
    """vLLM's worker hooks over the core: layer names, the metadata's saves, held blocks."""

    core: WorkerCore
    fingerprint: bytes  # the salt's: every segment this worker reads or writes carries it
    index: dict[str, int] = field(default_factory=dict)  # layer name -> layer
    had_saves: set[str] = field(default_factory=set)  # requests the scheduler holds blocks for
    closing: set[str] = field(default_factory=set)  # finished requests waiting for their saves

    def register(
        self, kv_caches: dict[str, torch.Tensor], heads: int, head_dim: int, write: Writer | None
    ) -> None:
        self.index = {name: i for i, name in enumerate(kv_caches)}
        caches = list(kv_caches.values())
        first = caches[0]
        paged = detect_layout(first, heads, head_dim)
        if any(t.shape != first.shape or t.dtype != first.dtype for t in caches):
            raise ValueError("tierkv.vllm needs every layer's KV tensor alike (one KV group)")
        if paged.kind == "cpu_heads_first":
            if write is None:
                raise ValueError("the CPU layout needs the attention backend's KV writer")
            probe_tiles(paged, first.dtype, write)
        name = dtype_name(first.dtype)
        if name is None:
            raise ValueError(f"no segment can hold a {first.dtype} cache")
        layout = Layout(len(caches), heads, head_dim, name, self.fingerprint, paged.block_size)
        self.core.register(VllmKV(layout, first.dtype, False, paged, caches))
        log.info("tierkv.vllm: %d layers, layout %s %s", len(caches), paged.kind, list(first.shape))

    def bind(self, meta: TierKVMetadata) -> None:
        """A new step: stage its saves (the buffers the forward's layers are copied into)."""
        staged = []
        for s in meta.saves:
            self.had_saves.add(s.request_id)
            plan = self.core.stage(s.request_id, s.block_ids, s.chunk, s.tokens)
            if plan is not None:
                staged.append(plan)
        self.core.bind(staged)

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
