"""The scheduler's side of layered prefill (engine/layered.py has the runner's): which prompt is
admitted to it, and which layers it runs each step. One prompt at a time; it holds blocks for
its whole prompt from admission, is the first preempted when blocks run out (its progress is
dropped: it starts over), and joins the running sequences in its last step, where it samples.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.engine.blend_step import admit, blending
from tierkv.engine.schedule_output import SchedulerOutput
from tierkv.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    import torch

    from tierkv.engine.context import Context
    from tierkv.engine.scheduler import Scheduler


@dataclass(slots=True)
class Layering:
    """A sequence's layered prefill in flight: tokens start..start+rows of its prompt."""

    start: int  # tokens found cached (prefix cache, connector) at admission
    rows: int  # the prompt tokens it computes
    per_step: int  # layers a step
    next: int = 0  # the first layer of the next step's group
    hidden: torch.Tensor | None = None  # [rows, hidden] after layer next-1 (the runner's)
    ctx: Context | None = None  # its rows' context, built in its first step (the runner's)
    # a blend prefill's layers (blend_step.blend_steps), started in its first step
    steps: Generator[None, None, torch.Tensor] | None = None


SHARE = 4  # auto groups: a step's prefill work is at most 1/SHARE of a full chunk's


def layers_per_step(rows: int, num_layers: int, budget: int, groups: int) -> int:
    """groups > 0: the layers split into that many groups; else as many layers as keep a step's
    prefill work (tokens x layers) within 1/SHARE of a full chunk's (budget tokens through every
    layer): the decodes beside it wait a quarter of what a chunk makes them wait, and the
    prompt's first token comes a few decode steps later than in chunks."""
    if groups > 0:
        return math.ceil(num_layers / min(groups, num_layers))
    return max(1, min(num_layers, budget * num_layers // (SHARE * rows)))


def blend_layered(sched: Scheduler) -> bool:
    """Whether the head of the queue is a blend prefill to layer (layered mode)."""
    head = sched.waiting[0] if sched.waiting else None
    return sched.config.prefill_mode == "layered" and head is not None and blending(head)


def wants_layers(sched: Scheduler, seq: Sequence, todo: int) -> bool:
    """Whether a prompt with todo tokens left to compute goes layered (its mode, its length)."""
    c = sched.config
    return c.prefill_mode == "layered" and todo > c.max_num_batched_tokens and seq.blend is None


def admit_layered(
    sched: Scheduler, seq: Sequence, hit: int, ext: int, out: SchedulerOutput
) -> bool:
    """Start seq's layered prefill (blocks for its whole prompt, its loads planned); False,
    nothing changed, when another is in flight or its blocks do not fit yet."""
    copies = None if sched.layering is not None else sched.blocks.allocate(seq, len(seq))
    if copies is None:
        sched.blocks.free_seq(seq)
        seq.num_computed_tokens = 0
        return False
    sched.waiting.popleft()
    sched.connector.update_state_after_alloc(seq, list(seq.block_table), ext)
    seq.num_computed_tokens = hit + ext
    begin(sched, seq, hit, ext, copies, out)
    return True


def admit_blend(sched: Scheduler, seq: Sequence, out: SchedulerOutput) -> bool:
    """Layered mode: start seq's blend prefill as a layered one (blend_step.admit: its whole
    prompt's blocks, its loads planned); False, nothing changed, when another layered prefill
    is in flight or its blocks do not fit yet."""
    admitted = None if sched.layering is not None else admit(seq, sched.blocks, sched.connector)
    if admitted is None:
        return False
    copies, hit, ext = admitted
    sched.waiting.popleft()
    begin(sched, seq, hit, ext, copies, out)
    return True


def begin(
    sched: Scheduler,
    seq: Sequence,
    hit: int,
    ext: int,
    copies: list[tuple[int, int]],
    out: SchedulerOutput,
) -> None:
    if not seq.admitted:
        seq.admitted = True
        seq.metrics.num_cached_tokens, seq.metrics.num_external_tokens = hit, ext
    seq.status = Status.RUNNING
    rows = len(seq) - seq.num_computed_tokens
    c = sched.config
    per = layers_per_step(rows, sched.num_layers, c.max_num_batched_tokens, c.layer_groups)
    seq.layering = Layering(seq.num_computed_tokens, rows, per)
    sched.layering = seq
    out.copies += copies


def advance(sched: Scheduler, out: SchedulerOutput) -> None:
    """The step's group of the layered prefill in flight; in its last, the sequence joins
    this step's sequences (all its prompt tokens at once) and the running ones."""
    seq = sched.layering
    if seq is None:
        return
    st = seq.layering
    assert st is not None
    lo, hi = st.next, min(sched.num_layers, st.next + st.per_step)
    out.layered, st.next = (seq, lo, hi), hi
    if hi == sched.num_layers:
        out.seqs.append(seq)
        out.num_new_tokens.append(st.rows)
        out.blend = seq if blending(seq) else None
        sched.layering = None
        bisect.insort(sched.running, seq, key=lambda s: s.seq_id)


def drop(sched: Scheduler, out: SchedulerOutput | None = None) -> Sequence | None:
    """Preempt the layered prefill in flight (blocks freed; it starts over later)."""
    seq = sched.layering
    if seq is None:
        return None
    sched.layering, seq.layering = None, None
    sched.blocks.free_seq(seq)
    seq.num_computed_tokens = 0
    seq.status = Status.WAITING
    seq.metrics.num_preemptions += 1
    sched.waiting.appendleft(seq)
    if out is not None:
        out.preempted.append(seq)
    return seq


def settle(sched: Scheduler, out: SchedulerOutput, failed_blocks: set[int]) -> None:
    """After the step: a layered prefill whose load failed starts over (the layers it ran read
    that KV); one that finished forgets its state."""
    if out.layered is None:
        return
    seq = out.layered[0]
    if sched.layering is seq and any(b in failed_blocks for b in seq.block_table):
        drop(sched)  # a blend starts over as a blend: its loads are planned again
    elif sched.layering is not seq:
        seq.layering = None
