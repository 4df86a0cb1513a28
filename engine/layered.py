"""Layered prefill (Lee et al., "Layered Prefill", arXiv 2510.08055): a long prompt's prefill
goes along the layer axis instead of the token axis. Its whole prompt runs through one group
of layers per step, beside the running decodes, which run through every layer every step: a
decode never waits for a prefill, and each layer's weights are read once per prompt instead
of once per chunk.

With `prefill_mode="layered"`, a prompt whose uncached tokens exceed the step's token budget
(`max_num_batched_tokens`) is admitted this way, one at a time, FCFS; shorter prompts and
blend prefills are scheduled as in chunked mode. The scheduler owns the Layering (which layers
run this step); the runner carries the prompt's hidden states from step to step and, in its
last step, samples the first token like any prefill's. The connector's loads are all awaited
in the admission step (before any later group reads them); its saves of the prompt's chunks
run in the last step, once every layer's KV is in the blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierkv.engine.blend_forward import drive
from tierkv.engine.blend_step import blend_steps, blending
from tierkv.engine.context import Context, build_context
from tierkv.engine.schedule_output import SchedulerOutput

if TYPE_CHECKING:
    from tierkv.engine.model_runner import ModelRunner


def final(out: SchedulerOutput) -> bool:
    """Whether the step's layered prefill runs its last group (its sequence then samples)."""
    assert out.layered is not None
    return bool(out.seqs) and out.seqs[-1] is out.layered[0]


def layered_forward(runner: ModelRunner, out: SchedulerOutput) -> torch.Tensor:
    """A step with a layered prefill: the other sequences through every layer, the prompt
    through its group. Returns the hidden states of the rows that sample, in out.seqs' order
    (the prompt's last row last, in its final step)."""
    assert out.layered is not None
    seq, lo, hi = out.layered
    st = seq.layering
    assert st is not None and seq.num_computed_tokens == st.start
    last = final(out)
    rest = SchedulerOutput(out.seqs[:-1] if last else list(out.seqs))
    rest.num_new_tokens = out.num_new_tokens[: len(rest.seqs)]
    ctx = context_of(runner, rest) if rest.seqs else None
    if st.ctx is None:  # its first step
        st.ctx = context_of(runner, SchedulerOutput([seq], [st.rows]))
        if blending(seq):
            runner.ctx = st.ctx
            st.steps = blend_steps(runner, st.ctx, seq)
    mine, model, conn = st.ctx, runner.model, runner.connector
    h = model.embed_tokens(ctx.input_ids) if ctx is not None else None
    hl = st.hidden
    runner.saving = False  # one save per layer, once both row sets wrote their KV
    try:
        if st.steps is not None:  # a blend: its own rows per layer (engine/blend.py)
            runner.ctx = mine
            if last:  # the rows it returns, and which of them samples (blend_forward.blend_layers)
                hl = drive(st.steps)
                hl = hl[mine.logits_indices[: mine.num_sampled]]
            else:
                for _ in range(hi - lo):
                    next(st.steps)
        elif lo == 0:
            hl = model.embed_tokens(mine.input_ids)
        for i, layer in enumerate(model.layers):
            conn.wait_for_layer_load(i)  # every load lands in the admission step
            if st.steps is None and lo <= i < hi:
                assert hl is not None  # carried from the step before
                runner.ctx = mine
                hl = layer(i, hl, mine.positions, runner.attend)
            if ctx is not None and h is not None:
                runner.ctx = ctx
                h = layer(i, h, ctx.positions, runner.attend)
            conn.save_kv_layer(i, runner.kv_caches[i], ctx)
    finally:
        runner.saving = True
    st.hidden = None if last else hl
    runner.ctx = ctx if ctx is not None else mine
    rows = [] if ctx is None or h is None else [h[ctx.logits_indices][: ctx.num_sampled]]
    if last:
        assert hl is not None
        rows.append(hl if st.steps is not None else hl[mine.num_tokens - 1 : mine.num_tokens])
    if rows:
        return torch.cat(rows)
    w = model.embed_tokens.weight
    return w.new_zeros(0, w.shape[1])  # nothing samples this step


def context_of(runner: ModelRunner, out: SchedulerOutput) -> Context:
    c, r = runner.config, runner
    triton = r.decodes.triton
    return build_context(out, c.block_size, r.num_blocks, r.one_decode_group, triton, r.device)
