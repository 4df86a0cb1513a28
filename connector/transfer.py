"""How KV moves between segments and an engine's paged cache: `PagedKV`, the interface each
engine implements for the worker core (connector.worker), what a load checks, and tierkv's own
engine's gather and scatter (the stream itself is in connector.loading).

Safety contract: nothing reaches the paged cache before its segment has passed the tier's
checksum check and this module's header check (key, parent, fingerprint, tokens, shape,
dtype). A load that fails, times out or is cancelled scatters nothing more and names the
blocks to recompute. After `cancel()` returns, no scatter of that job runs any more.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tierkv.connector.config import ConnectorConfig
from tierkv.connector.plan import LoadPlan, SavePlan
from tierkv.kernels import FP8, LayerCache, RotaryEmbedding, gather_kv, rerotate_k, scatter_kv
from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.keys import Salt
from tierkv.storage_backends.segment import VERSION, KVSegment, dtype_name


@dataclass(slots=True)
class Layout:
    """What a segment of this engine must look like."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # storage dtype name (segment.dtype)
    fingerprint: bytes
    block_size: int
    rope: RotaryEmbedding | None = None  # for re-rotating reused segments
    # [L, 2, H]: the fp8 scales a segment must carry exactly, for a cache that holds fixed
    # scales (vLLM's, per layer) and cannot requantize; None: any (tierkv's engine rescales)
    scales: np.ndarray | None = None


@dataclass(slots=True)
class LoadJob:
    plans: list[LoadPlan]
    events: list[threading.Event]
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    scattering: bool = False  # some layer may be in the cache already
    started: float = field(default_factory=time.perf_counter)
    # PagedKV.scatter_on_wait: each layer's verified segments, kept for wait_layer to scatter
    staged: dict[int, list[list[KVSegment]]] | None = None
    waited: int = 0  # layers wait_layer scattered (scatter_on_wait)

    def cancel(self) -> None:
        with self.lock:  # waits for a scatter in progress; none starts after this
            self.cancelled = True
        for p in self.plans:
            if p.failed_from is None:
                p.failed_from = p.start


Scatter = Callable[[list[list[KVSegment]], int], None]  # (each plan's good segments, layer)


class PagedKV(ABC):
    """An engine's paged KV cache as the worker core reads and writes it: the only code that
    touches the engine's blocks.

    Safety contract: `scatter` is handed only segments that passed the checksum and header
    checks, and writes each plan's tokens [start, failed_from or end) into that plan's own
    blocks and nowhere else; it runs under the job's lock, so after `LoadJob.cancel()`
    returns it writes nothing more. It runs on the connector's loop thread as each layer
    arrives or, with `scatter_on_wait`, on the engine's thread in `wait_layer` (the engine's
    own threads make the copies while the loop thread receives the next layer). `gather` has
    copied its tokens out of the blocks when it returns: after the step the engine may free or
    reuse them.
    """

    __slots__ = ()
    layout: Layout  # what this engine's segments look like
    dtype: torch.dtype  # a save's staging dtype (the storage dtype)
    scaled: bool  # fp8 storage: a save stages its per-layer scales too
    scatter_on_wait: bool = False  # scatter in wait_layer, on the engine's thread

    @abstractmethod
    def gather(self, saves: list[SavePlan], layer: int, kv_layer: torch.Tensor) -> None:
        """Copy layer's K/V of each save's chunk out of kv_layer into its staging[layer]."""

    @abstractmethod
    def scatter(self, job: LoadJob, segs: list[list[KVSegment]], layer: int) -> None:
        """Write layer's K/V of segs[i], the verified segments of job.plans[i], into its blocks."""


def why_unusable(seg: SegmentHeader, plan: LoadPlan, i: int, layout: Layout) -> str | None:
    """Why the segment a header announces cannot be injected as chunk i of plan, or None when
    it can."""
    c = plan.chunks[i]
    if seg.key != c.key or seg.parent != c.parent:
        return "key or parent differs"
    if seg.fingerprint != layout.fingerprint:
        return "fingerprint differs (other model, dtype or format)"
    if (seg.num_layers, seg.num_kv_heads, seg.head_dim, seg.dtype) != (
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.dtype,
    ):
        return "shape or dtype differs"
    if layout.scales is not None and (
        seg.scales is None or not np.array_equal(seg.scales, layout.scales)
    ):
        return "fp8 scales differ"
    if seg.num_tokens != c.end - c.start or not np.array_equal(
        seg.tokens, plan.tokens[c.start : c.end]
    ):
        return "tokens differ"
    return None


def scatter_layer(
    job: LoadJob,
    segs: list[list[KVSegment]],
    layer: int,
    caches: list[torch.Tensor],
    kv_scales: torch.Tensor | None,
    rope: RotaryEmbedding | None,
) -> None:
    """Write layer's K/V of every verified chunk into its request's blocks."""
    cache = LayerCache.of(caches[layer], None if kv_scales is None else kv_scales[layer])
    for plan, good in zip(job.plans, segs):
        stop = plan.end if plan.failed_from is None else plan.failed_from
        parts = []
        for seg, c in zip(good, plan.chunks):
            lo, hi = max(plan.start, c.start), min(stop, c.end)
            if hi <= lo:
                continue
            part = seg.layer(layer)[:, lo - c.start : hi - c.start]
            if plan.rotate and c.start != seg.header.base_position:  # R(p + d) = R(d) R(p)
                if rope is None:
                    raise ValueError("re-rotating a reused segment needs the model's rope")
                part = torch.stack(
                    [rerotate_k(part[0], c.start - seg.header.base_position, rope), part[1]]
                )
            if seg.header.scales is not None:  # fp8 chunks carry their own scales: one scatter each
                scales = torch.from_numpy(seg.header.scales[layer])
                scatter_kv(part, cache, plan.block_ids, lo, scales)
                copied("connector.scatter", part.numel() * part.element_size())
            else:
                parts.append(part)
        if parts:
            # One scatter for the plan's run of chunks: a join costs less than a scatter call
            # per chunk (about 0.1 ms each: 30 ms at 8K tokens, 90 ms at 32K).
            src = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            if len(parts) > 1:
                copied("connector.join", src.numel() * src.element_size())
            scatter_kv(src, cache, plan.block_ids, plan.start)
            copied("connector.scatter", src.numel() * src.element_size())


@dataclass(slots=True, eq=False)
class EngineKV(PagedKV):
    """tierkv's engine cache: per layer [2, blocks, block_size, heads, dim]; an fp8 cache
    dequantizes with kv_scales [L, 2, heads]."""

    layout: Layout
    dtype: torch.dtype
    scaled: bool
    caches: list[torch.Tensor]
    kv_scales: torch.Tensor | None

    def gather(self, saves: list[SavePlan], layer: int, kv_layer: torch.Tensor) -> None:
        scales = self.kv_scales
        cache = LayerCache.of(kv_layer, None if scales is None else scales[layer])
        for p in saves:
            out_scales = None if p.scales is None else p.scales[layer]
            gather_kv(cache, p.block_ids, p.chunk.start, p.staging[layer], out_scales)
            copied("connector.gather", p.staging[layer].numel() * p.staging.element_size())

    def scatter(self, job: LoadJob, segs: list[list[KVSegment]], layer: int) -> None:
        scatter_layer(job, segs, layer, self.caches, self.kv_scales, self.layout.rope)


def engine_kv(
    kv_caches: list[torch.Tensor],
    model_id: str,
    kv_scales: torch.Tensor | None,
    rope: RotaryEmbedding | None,
    config: ConnectorConfig,
    namespace: str,
) -> tuple[Salt, EngineKV]:
    """tierkv's engine cache as the worker core sees it, and the salt of its keys (the model,
    the segment format its KV is stored in, the chunking); refuses a cache it cannot store."""
    chunk_size = config.chunk_size
    _, _, block_size, heads, dim = kv_caches[0].shape
    if chunk_size % block_size:
        raise ValueError(f"chunk_size {chunk_size} is not a multiple of block size {block_size}")
    cache_dtype = kv_caches[0].dtype
    if cache_dtype == FP8 and kv_scales is None:
        raise ValueError("an fp8 engine cache needs its kv_scales in bind_model")
    store_dtype = FP8 if config.kv_dtype == "fp8" else cache_dtype
    name = dtype_name(store_dtype)
    if name is None:
        raise ValueError(f"no segment can hold a {store_dtype} cache")
    quant = "fp8_e4m3" if store_dtype == FP8 else "none"
    salt = Salt(
        model_fingerprint=model_id,
        kv_format=f"tkvs{VERSION}/layer-major/{name}/{quant}",
        chunk_size=chunk_size,
        namespace=namespace,
    )
    layout = Layout(len(kv_caches), heads, dim, name, salt.fingerprint(), block_size, rope)
    return salt, EngineKV(layout, store_dtype, store_dtype == FP8, kv_caches, kv_scales)
