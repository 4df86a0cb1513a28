"""The scheduler side's plans for a step: what a request loads into its new blocks, and
which of the chunks its step completes are to be saved."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tierkv.connector.plan import Chunk, ConnectorStats, LoadPlan, RequestState
from tierkv.engine.blend_step import blending
from tierkv.engine.kv_connector import ConnectorRequest


def load_plans(
    request: ConnectorRequest, st: RequestState, block_ids: list[int], num_external_tokens: int
) -> list[LoadPlan]:
    """The loads of a request given its blocks: its present prefix chunks over the external
    tokens (a blend request's exact prefix), and for a blend request each segment hit."""
    request_id = request.request_id
    blocks = torch.tensor(block_ids, dtype=torch.int32)
    blend = blending(request)
    start, end = (
        st.exact
        if blend
        else (request.num_computed_tokens, request.num_computed_tokens + num_external_tokens)
    )
    plans = [prefix_load(request_id, blocks, st, start, end)] if end > start else []
    for c, hit, tier in zip(st.chunks, st.hits if blend else [], st.tiers):
        if hit:  # a segment: re-rotated from where it was computed to where it is now
            plans.append(
                LoadPlan(
                    request_id,
                    blocks,
                    c.start,
                    c.end,
                    [c],
                    [tier],
                    st.tokens,
                    rotate=True,
                )
            )
    return plans


def prefix_load(
    request_id: str, blocks: torch.Tensor, st: RequestState, start: int, end: int
) -> LoadPlan:
    """The load of tokens start..end of the request's present prefix run, exactly where they
    were computed, from the chunks that hold them."""
    idx = [i for i, c in enumerate(st.chunks[: st.present]) if c.end > start and c.start < end]
    chunks, tiers = [st.chunks[i] for i in idx], [st.tiers[i] for i in idx]
    return LoadPlan(request_id, blocks, start, end, chunks, tiers, st.tokens)


def chunks_to_save(
    st: RequestState, start: int, stop: int, stats: ConnectorStats
) -> Iterator[Chunk]:
    """The request's chunks that its step (tokens start..stop) completes, in order, less those
    the store holds or that were computed before the connector could see them (counted)."""
    while st.saved_upto < len(st.chunks) and st.chunks[st.saved_upto].end <= stop:
        c = st.chunks[st.saved_upto]
        st.saved_upto += 1
        if c.index < st.present or c.end <= start:
            stats.save_skipped += 1  # in the store, or computed before we could see it
            continue
        yield c
