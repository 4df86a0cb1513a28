"""What the connector decides per request and per step, and what it counts."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class Chunk:
    index: int  # position of the chunk in the prompt
    key: bytes
    parent: bytes  # the previous chunk's key; zeros for the first
    start: int  # tokens [start, end) of the prompt
    end: int


@dataclass(slots=True)
class RequestState:
    """Scheduler-side state of one request; lives from its first lookup to request_finished."""

    chunks: list[Chunk]
    tokens: np.ndarray  # the prompt, int32
    present: int = 0  # leading chunks the store held at the last lookup (prefix chunks)
    prefix_chunks: int = (
        0  # leading chunks that may load as a prefix run (a segment prompt: its declared prefix)
    )
    exact: tuple[int, int] = (
        0,
        0,
    )  # blend requests: declared-prefix tokens [a, b) loaded as a prefix
    hits: list[bool] = field(default_factory=list)  # each chunk found as a segment (blend requests)
    tiers: list[str] = field(default_factory=list)  # tier of each present chunk
    saved_upto: int = 0  # chunks below this index were saved or skipped
    loaded: dict[str, int] = field(default_factory=dict)  # tokens loaded per tier
    recomputed: int = 0  # tokens whose load failed and were computed instead


@dataclass(slots=True)
class LoadPlan:
    """Load tokens [start, end) of one request into its blocks from chunks[...]."""

    request_id: str
    block_ids: torch.Tensor  # int32; valid only while the request holds them (this step)
    start: int
    end: int
    chunks: list[Chunk]
    tiers: list[str]
    tokens: np.ndarray
    rotate: bool = False  # a segment reused at another position: re-rotate K from its base position
    failed_from: int | None = None  # first token not loaded, when the load fails


@dataclass(slots=True)
class SavePlan:
    request_id: str
    block_ids: torch.Tensor
    chunk: Chunk
    tokens: np.ndarray  # this chunk's tokens
    staging: torch.Tensor  # [L, 2, T, H, D] in the storage dtype, filled layer by layer
    scales: torch.Tensor | None  # [L, 2, H] for fp8 storage
    head: int = 0  # a part of a chunk (tierkv.vllm's KV head parts): its first head in the cache


@dataclass(slots=True)
class StepMeta:
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


@dataclass(slots=True)
class ConnectorStats:
    lookups: int = 0
    lookup_hit_tokens: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    load_misses: int = 0  # a chunk gone between lookup and load
    load_rejected: int = (
        0  # a chunk whose header (tokens, parent, fingerprint, shape) did not match
    )
    load_timeouts: int = 0
    load_errors: int = 0  # exceptions from a tier or the scatter
    recomputed_tokens: int = 0
    saved_chunks: int = 0
    saved_bytes: int = 0
    save_skipped: int = 0  # already present in the store
    save_dropped: int = 0  # too many pending saves, or the put failed
    load_seconds: list[float] = field(default_factory=list)  # recent load latencies (bounded)
    save_seconds: list[float] = field(default_factory=list)

    def record(self, which: list[float], seconds: float) -> None:
        which.append(seconds)
        if len(which) > 1024:
            del which[:512]
