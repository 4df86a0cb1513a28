"""Layered prefill (Lee et al., "Layered Prefill", arXiv 2510.08055): a long prompt's prefill
goes along the layer axis instead of the token axis. Its whole prompt runs through a share of
the layers per step, beside the running decodes, which run through every layer every step: a
decode never waits for a whole prefill, and each layer's weights are read about once per
prompt instead of once per chunk.

With `prefill_mode="layered"`, a prompt whose uncached tokens exceed the step's token budget
(`max_num_batched_tokens`) is admitted this way, one at a time, FCFS; shorter prompts are
scheduled as in chunked mode; a blend prefill always goes this way. Its prefill runs as pieces
of rows through one layer (engine/tiles.py): a step runs pieces up to the step's work
(layering.step_work), so a layer of a long prompt spans steps in row chunks. The scheduler owns
the Layering (the step's work, and which step is its last); the runner carries the prompt's
pieces from step to step and, in its last step, samples the first token like any prefill's.
The decodes beside it take the runner's reused decode context. The connector's loads are all
awaited in the admission step (before any later piece reads them; a step's load ends with its
step); its saves of the prompt's chunks run in the last step, once every layer's KV is in the
blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierkv.engine.blend_step import blend_steps, blending
from tierkv.engine.context import Context, build_context
from tierkv.engine.schedule_output import SchedulerOutput
from tierkv.engine.tiles import Pace, Work, prefill

if TYPE_CHECKING:
    from tierkv.engine.model_runner import ModelRunner


def final(out: SchedulerOutput) -> bool:
    """Whether the step is the layered prefill's last (its sequence then samples)."""
    assert out.layered is not None
    return bool(out.seqs) and out.seqs[-1] is out.layered


def layered_forward(runner: ModelRunner, out: SchedulerOutput) -> torch.Tensor:
    """A step with a layered prefill: the other sequences through every layer, the prompt its
    step's share of pieces (all that is left, in its last step). Returns the hidden states of
    the rows that sample, in out.seqs' order (the prompt's last row last, in its final step)."""
    seq = out.layered
    assert seq is not None
    st = seq.layering
    assert st is not None and seq.num_computed_tokens == st.start
    last = final(out)
    rest = SchedulerOutput(out.seqs[:-1] if last else list(out.seqs))
    rest.num_new_tokens = out.num_new_tokens[: len(rest.seqs)]
    ctx = (runner.decodes.build(rest) or context_of(runner, rest)) if rest.seqs else None
    if st.ctx is None:  # its first step
        st.ctx = runner.ctx = context_of(runner, SchedulerOutput([seq], [st.rows]))
        if blending(seq):
            st.steps = blend_steps(runner, st.ctx, seq, st.pace)
        else:
            st.steps = prefill(runner, st.ctx, st.pace)
    mine, model, conn = st.ctx, runner.model, runner.connector
    runner.saving = False  # one save per layer, once both row sets wrote their KV
    try:
        runner.ctx = mine  # the pieces' context whenever they resume (engine/tiles.py)
        if st.steps is not None:
            st.hidden = pieces(st.steps, st.pace, st.work, last)
            st.steps = None if st.hidden is not None else st.steps
        h = model.embed_tokens(ctx.input_ids) if ctx is not None else None
        for i, layer in enumerate(model.layers):
            conn.wait_for_layer_load(i)  # every load lands in the admission step
            if ctx is not None and h is not None:
                runner.ctx = ctx
                h = layer(i, h, ctx.positions, runner.attend)
            conn.save_kv_layer(i, runner.kv_caches[i], ctx)
    finally:
        runner.saving = True
    runner.ctx = ctx if ctx is not None else mine
    rows = [] if ctx is None or h is None else [h[ctx.logits_indices][: ctx.num_sampled]]
    if last:  # the rows its work returned, and which of them samples (blend_forward points it)
        assert st.hidden is not None
        rows.append(st.hidden[mine.logits_indices[: mine.num_sampled]])
    if rows:
        return torch.cat(rows)
    w = model.embed_tokens.weight
    return w.new_zeros(0, w.shape[1])  # nothing samples this step


def pieces(work: Work, pace: Pace, budget: int, last: bool) -> torch.Tensor | None:
    """Run work's pieces up to budget rows x layers (to its end in its last step); its result
    once it ended, else None."""
    used = 0
    while last or used < budget:
        pace.allow = budget - used if used < budget else budget
        try:
            used += next(work)
        except StopIteration as done:
            pace.left = 0
            return done.value
    return None


def context_of(runner: ModelRunner, out: SchedulerOutput) -> Context:
    """out's Context through build_context (the general path: prompts, mixed steps)."""
    c, r = runner.config, runner
    triton = r.decodes.triton
    return build_context(out, c.block_size, r.num_blocks, r.one_decode_group, triton, r.device)
