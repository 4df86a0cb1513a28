"""The scheduler's side of layered prefill (engine/layered.py has the runner's): which prompt is
admitted to it, how much of its work a step holds, and which step is its last. One prompt at a
time; it holds blocks for its whole prompt from admission, is the first preempted when blocks
run out (its progress is dropped: it starts over), and joins the running sequences in its last
step, where it samples.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.engine.blend_step import admit, blending
from tierkv.engine.schedule_output import SchedulerOutput
from tierkv.engine.sequence import Sequence, Status
from tierkv.engine.tiles import Pace, Work

if TYPE_CHECKING:
    import torch

    from tierkv.engine.config import EngineConfig
    from tierkv.engine.context import Context
    from tierkv.engine.scheduler import Scheduler


@dataclass(slots=True)
class Layering:
    """A sequence's layered prefill in flight: tokens start..start+rows of its prompt."""

    start: int  # tokens found cached (prefix cache, connector) at admission
    rows: int  # the prompt tokens it computes
    work: int  # rows x layers a step runs of it (its pieces' budget)
    pace: Pace  # its pieces' pace; pace.left (the work's bound on what is left) sets its last step
    hidden: torch.Tensor | None = None  # its last layer's rows, once its work ended (the runner's)
    ctx: Context | None = None  # its rows' context, built in its first step (the runner's)
    # its prefill as pieces (tiles.prefill, or blend_step.blend_steps), started in its first step
    steps: Work | None = None


SHARE = 4  # auto: a step's prefill work is at most 1/SHARE of a full chunk's


def step_work(rows: int, num_layers: int, c: EngineConfig) -> int:
    """Rows x layers a step runs of a layered prefill of rows tokens: layered_step_rows when
    set; else with layer_groups > 0 a group of whole layers (the layers split into that many
    groups); else 1/SHARE of a full chunk's work (max_num_batched_tokens tokens through every
    layer): the decodes beside it wait a quarter of what a chunk makes them wait, and the
    prompt's first token comes a few decode steps later than in chunks. A layer whose rows
    exceed it runs in row chunks over several steps (engine/tiles.py)."""
    if c.layered_step_rows > 0:
        return c.layered_step_rows
    if c.layer_groups > 0:
        return rows * math.ceil(num_layers / min(c.layer_groups, num_layers))
    return max(1, c.max_num_batched_tokens * num_layers // SHARE)


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
    work = step_work(rows, sched.num_layers, sched.config)
    seq.layering = Layering(seq.num_computed_tokens, rows, work, Pace(left=rows * sched.num_layers))
    sched.layering = seq
    out.copies += copies


def advance(sched: Scheduler, out: SchedulerOutput) -> None:
    """The step's share of the layered prefill in flight; in its last (what is left of its work
    fits the step's), the sequence joins this step's sequences (all its prompt tokens at once)
    and the running ones."""
    seq = sched.layering
    if seq is None:
        return
    st = seq.layering
    assert st is not None
    out.layered = seq
    if st.pace.left <= st.work:
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
    seq = out.layered
    if sched.layering is seq and any(b in failed_blocks for b in seq.block_table):
        drop(sched)  # a blend starts over as a blend: its loads are planned again
    elif sched.layering is not seq:
        seq.layering = None
