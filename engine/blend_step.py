"""CacheBlend in the engine's step: the state a prompt in parts carries on its sequence, its
admission (alone, its whole prompt at once), the plain-prefill fallback when a load into it
fails, and the runner's blend prefill. The scheduler and the runner call these four; the
rest of the core knows only that a sequence may carry a BlendState."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tierkv.engine.blend import BlendParams, BlendReport
from tierkv.engine.blend_forward import blend_layers
from tierkv.engine.tiles import Pace, Work, drive

if TYPE_CHECKING:
    from tierkv.engine.block_manager import BlockManager
    from tierkv.engine.context import Context
    from tierkv.engine.kv_connector import ConnectorRequest, KVConnector
    from tierkv.engine.model_runner import ModelRunner
    from tierkv.engine.schedule_output import SchedulerOutput
    from tierkv.engine.scheduler import Scheduler
    from tierkv.engine.sequence import Sequence


@dataclass(slots=True)
class BlendState:
    """A sequence's prompt in parts: a blend prompt (its reusable segments' KV loaded wherever
    they lie, then blended) or an ingest (one segment whose KV is computed to be stored)."""

    segments: list[tuple[int, int, bool]]  # (start, end, reusable) of each part
    prefix_len: int = 0  # the declared shared prefix: reused exactly; segments computed after it
    params: BlendParams | None = None  # set while the prompt awaits its blend prefill
    ingest: bool = False
    exact_kv: bool = True  # False once blended KV is in its blocks: never indexed, never stored
    report: BlendReport | None = None  # what its last blend prefill did
    # Without a declared prefix: the tokens its segments are encoded after (engine/encoding.py;
    # keyed under them); () for the standalone encoding. An ingest's prompt starts with them.
    preamble: tuple[int, ...] = ()


def blending(request: ConnectorRequest) -> bool:
    """Whether the request awaits a blend prefill (its segments load wherever they lie)."""
    return request.blend is not None and request.blend.params is not None


def admit(
    seq: Sequence, blocks: BlockManager, connector: KVConnector
) -> tuple[list[tuple[int, int]], int, int] | None:
    """Allocate a blend prefill's blocks for its whole prompt and plan its loads: the declared
    shared prefix from the prefix cache, then from the connector exactly; the segments the
    connector holds, to blend. Returns (copy-on-write copies, prefix-cache hit, tokens to load),
    or None when its blocks do not fit yet (nothing changed).

    It runs alone, over the per-step token budget if need be: it is one selective prefill (the
    check layer ranks every loaded token at once); the running sequences wait that one step."""
    st = seq.blend
    assert st is not None  # admitted only while blending
    hit = blocks.match_prefix(seq, st.prefix_len) if st.prefix_len else 0
    copies = blocks.allocate(seq, len(seq))
    if copies is None:
        blocks.free_seq(seq)
        return None
    ext = max(0, int(connector.get_num_new_matched_tokens(seq, hit)))
    exact = connector.get_num_prefix_tokens(seq) if ext else 0
    connector.update_state_after_alloc(seq, list(seq.block_table), ext)
    seq.num_computed_tokens = hit + exact
    st.exact_kv = st.exact_kv and ext == exact  # segments loaded: the KV will be blended
    return copies, hit, ext


def blend_alone(sched: Scheduler) -> SchedulerOutput | None:
    """Chunked mode: the step of the blend prefill at the head of the queue, alone in it (its
    whole prompt at once); None when the head is no blend or it does not fit yet."""
    from tierkv.engine.schedule_output import SchedulerOutput  # it imports Sequence, and so this

    head = sched.waiting[0] if sched.waiting else None
    if head is None or not blending(head) or len(sched.running) >= sched.config.max_num_seqs:
        return None
    admitted = admit(head, sched.blocks, sched.connector)
    if admitted is None:
        return None
    cow, hit, ext = admitted
    sched.waiting.popleft()
    sched.start(head, hit, ext)
    return SchedulerOutput([head], [len(head) - head.num_computed_tokens], cow, blend=head)


def unblend(seq: Sequence, failed_from: int, n: int) -> None:
    """A load into this step's blend prefill of n tokens failed from token failed_from: blended
    KV is all or nothing, so the prompt is prefilled plainly from the step's start (or from a
    failed prefix load)."""
    st = seq.blend
    assert st is not None
    seq.num_computed_tokens = min(failed_from, seq.num_computed_tokens - n)
    seq.metrics.num_external_tokens = 0
    st.params = None


def blend_prefill(runner: ModelRunner, ctx: Context, seq: Sequence) -> torch.Tensor:
    """The runner's forward of a blend prefill (the step's only sequence)."""
    return drive(blend_steps(runner, ctx, seq))


def blend_steps(runner: ModelRunner, ctx: Context, seq: Sequence, pace: Pace | None = None) -> Work:
    """seq's blend prefill as pieces (engine/tiles.py; a layered prefill runs a step's share of
    them a step): once the loads are fetched and verified, the loaded ranges are known; their
    report goes on seq's state."""
    st = seq.blend
    assert st is not None and st.params is not None  # only a blending sequence is out.blend
    runner.connector.wait_for_layer_load(0)
    st.report = BlendReport()
    loaded = runner.connector.get_loaded_ranges(seq.request_id)
    start = seq.num_computed_tokens
    return blend_layers(runner, ctx, st.params, loaded, st.segments, start, st.report, pace)
