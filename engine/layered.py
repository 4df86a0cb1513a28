"""Layered prefill (Lee et al., "Layered Prefill", arXiv 2510.08055): a long prompt's prefill
goes along the layer axis instead of the token axis. Its whole prompt runs through a share of
the layers per step, beside the running decodes, which run through every layer every step: a
decode never waits for a whole prefill, and each layer's weights are read about once per
prompt instead of once per chunk.

With `prefill_mode="layered"`, a prompt whose uncached tokens exceed the step's token budget
(`max_num_batched_tokens`) is admitted this way, up to `max_layered` at once, FCFS; shorter
prompts are scheduled as in chunked mode; a blend prefill always goes this way. A prefill runs
as pieces of rows through one layer (engine/tiles.py): a step runs each one's pieces up to its
share of the step's work (engine/layering.py), so a layer of a long prompt spans steps in row
chunks. The scheduler owns the Layering (the share, and which step is its last); the runner
carries each prompt's pieces from step to step (each with its own Context, runner.ctx while
its pieces run) and, in its last step, samples its first token like any prefill's. The
decodes beside them take the runner's reused decode context. Where a prompt's admission step
loads for it alone, its load is held past the step (KVConnector.hold_load, connector/held.py):
its pieces wait for a layer's load only when they are about to read it, in whichever step that
is, and the step's other rows never wait on it; its failures are reported in its last step
(the sequence then recomputes from the first failed block, as any prefill whose load failed).
Otherwise the step's load is awaited within the step. Its saves of a prompt's chunks run in its
last step, once every layer's KV is in the blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierkv.engine.blend_step import blend_steps, blending
from tierkv.engine.context import Context, build_context
from tierkv.engine.pacer import clock
from tierkv.engine.schedule_output import SchedulerOutput
from tierkv.engine.tiles import Pace, Work, prefill

if TYPE_CHECKING:
    from tierkv.engine.model_runner import ModelRunner
    from tierkv.engine.sequence import Sequence


def finishing(out: SchedulerOutput) -> list[Sequence]:
    """The layered prefills whose last step it is: they sample, last in out.seqs, in order."""
    k = sum(s in out.seqs for s in out.layered)
    return out.seqs[len(out.seqs) - k :]


def layered_forward(runner: ModelRunner, out: SchedulerOutput) -> torch.Tensor:
    """A step with layered prefills: each one's share of pieces (all that is left, in its last
    step), then the other sequences through every layer. Returns the hidden states of the rows
    that sample, in out.seqs' order (each finishing prompt's last row, after the others'). Sets
    out.ran to the pieces' rows x layers and seconds."""
    last = finishing(out)
    rest = SchedulerOutput(out.seqs[: len(out.seqs) - len(last)])
    rest.num_new_tokens = out.num_new_tokens[: len(rest.seqs)]
    ctx = (runner.decodes.build(rest) or context_of(runner, rest)) if rest.seqs else None
    model, conn = runner.model, runner.connector
    paced, dev = runner.config.layered_gap > 0, runner.device.type
    runner.saving = False  # one save per layer, once every row set wrote its KV
    units, seconds = 0, 0.0
    try:
        for seq in out.layered:  # before any piece waits: a load of its admission step alone
            st = seq.layering  # goes on past the step
            if st is not None and st.ctx is None:
                st.held = conn.hold_load(seq.request_id)
        for seq in out.layered:
            st = seq.layering
            assert st is not None and seq.num_computed_tokens == st.start
            rid = seq.request_id
            conn.resume_held(rid if st.held else None)  # its pieces wait on its held load
            if st.ctx is None:  # its first step
                st.ctx = runner.ctx = context_of(runner, SchedulerOutput([seq], [st.rows]))
                if blending(seq):
                    st.steps = blend_steps(runner, st.ctx, seq, st.pace)
                else:
                    st.steps = prefill(runner, st.ctx, st.pace)
            if st.steps is None:
                continue  # its work ended early: this is its last step
            runner.ctx = st.ctx  # its pieces' context whenever they resume (engine/tiles.py)
            t0 = clock(dev, paced)
            st.hidden, used = pieces(st.steps, st.pace, st.work, seq in last)
            seconds, units = seconds + clock(dev, paced) - t0, units + used
            conn.resume_held(None)
            st.steps = None if st.hidden is not None else st.steps
            if st.held and st.hidden is not None:  # every layer ran: what failed is reported now
                conn.end_held(rid)
        h = model.embed_tokens(ctx.input_ids) if ctx is not None else None
        for i, layer in enumerate(model.layers):
            conn.wait_for_layer_load(i)  # the step's own load (not one held for a prefill)
            if ctx is not None and h is not None:
                runner.ctx = ctx
                h = layer(i, h, ctx.positions, runner.attend)
            conn.save_kv_layer(i, runner.kv_caches[i], ctx)
    finally:
        runner.saving = True
        conn.resume_held(None)
    out.ran = (units, seconds)
    mine = out.layered[-1].layering
    runner.ctx = ctx if ctx is not None or mine is None else mine.ctx
    rows = [] if ctx is None or h is None else [h[ctx.logits_indices][: ctx.num_sampled]]
    for seq in last:  # the rows its work returned, and which samples (blend_forward points it)
        st = seq.layering
        assert st is not None and st.hidden is not None and st.ctx is not None
        rows.append(st.hidden[st.ctx.logits_indices[: st.ctx.num_sampled]])
    if rows:
        return torch.cat(rows)
    w = model.embed_tokens.weight
    return w.new_zeros(0, w.shape[1])  # nothing samples this step


def pieces(work: Work, pace: Pace, budget: int, last: bool) -> tuple[torch.Tensor | None, int]:
    """Run work's pieces up to budget rows x layers (to its end in its last step): its result
    once it ended, else None; and the rows x layers run."""
    used = 0
    while last or used < budget:
        pace.allow = budget - used if used < budget else budget
        try:
            used += next(work)
        except StopIteration as done:
            pace.left = 0
            return done.value, used
    return None, used


def context_of(runner: ModelRunner, out: SchedulerOutput) -> Context:
    """out's Context through build_context (the general path: prompts, mixed steps)."""
    c, r = runner.config, runner
    triton = r.decodes.triton
    return build_context(out, c.block_size, r.num_blocks, r.one_decode_group, triton, r.device)
