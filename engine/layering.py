"""The scheduler's side of layered prefill (engine/layered.py has the runner's): which prompts
are admitted to it, how much of its work each holds in a step, and which step is its last. Up
to max_layered prompts are in flight at once, first come first served; each holds blocks for
its whole prompt from admission, they are the first preempted when blocks run out (the newest
first; its progress is dropped: it starts over), and each joins the running sequences in its
last step, where it samples. The step's layered work is shared evenly among those in flight.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.engine.blend_step import admit, blending
from tierkv.engine.pacer import Pacer
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
    work: int  # rows x layers it runs this step: its share of the step's work (the scheduler's)
    pace: Pace  # its pieces' pace; pace.left (the work's bound on what is left) sets its last step
    hidden: torch.Tensor | None = None  # its last layer's rows, once its work ended (the runner's)
    ctx: Context | None = None  # its rows' context, built in its first step (the runner's)
    # its prefill as pieces (tiles.prefill, or blend_step.blend_steps), started in its first step
    steps: Work | None = None
    held: bool = False  # its admission step's load goes on past that step (the runner's)


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


def room(sched: Scheduler) -> bool:
    """Whether another prompt may start its layered prefill (fewer than max_layered in flight,
    and fewer than max_num_seqs running or in flight)."""
    n, c = len(sched.layering), sched.config
    return n < c.max_layered and len(sched.running) + n < c.max_num_seqs


def admit_layered(
    sched: Scheduler, seq: Sequence, hit: int, ext: int, out: SchedulerOutput
) -> bool:
    """Start seq's layered prefill (blocks for its whole prompt, its loads planned); False,
    nothing changed, when max_layered are in flight or its blocks do not fit yet."""
    copies = sched.blocks.allocate(seq, len(seq)) if room(sched) else None
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
    prompt's blocks, its loads planned); False, nothing changed, when max_layered are in flight
    or its blocks do not fit yet."""
    admitted = admit(seq, sched.blocks, sched.connector) if room(sched) else None
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
    seq.layering = Layering(seq.num_computed_tokens, rows, 0, Pace(left=rows * sched.num_layers))
    sched.layering.append(seq)
    out.copies += copies


def shares(sched: Scheduler, pacer: Pacer, beside: bool) -> list[int]:
    """Each in-flight prefill's work this step: the step's work split evenly among them, at
    least 1 row x layer each. The step's work is the pacer's budget where it has one and other
    sequences run beside (layered_gap), else each prompt's fixed step_work."""
    paced = pacer.budget() if beside else None
    n, c, layers = len(sched.layering), sched.config, sched.num_layers
    whole = []
    for seq in sched.layering:
        assert seq.layering is not None
        whole.append(paced if paced is not None else step_work(seq.layering.rows, layers, c))
    return [max(1, w // n) for w in whole]


def advance(sched: Scheduler, out: SchedulerOutput) -> None:
    """The step's share of each layered prefill in flight; in its last (what is left of its work
    fits its share), a sequence joins this step's sequences (all its prompt tokens at once,
    after the others) and the running ones."""
    works = shares(sched, sched.pacer, bool(out.seqs))
    for seq, work in zip(list(sched.layering), works):
        st = seq.layering
        assert st is not None
        st.work = work
        out.layered.append(seq)
        if st.pace.left <= work:
            out.seqs.append(seq)
            out.num_new_tokens.append(st.rows)
            sched.layering.remove(seq)
            bisect.insort(sched.running, seq, key=lambda s: s.seq_id)


def drop(sched: Scheduler, seq: Sequence, out: SchedulerOutput | None = None) -> None:
    """Preempt seq's layered prefill (blocks freed; it starts over later, at the queue's head)."""
    sched.layering.remove(seq)
    seq.layering = None
    sched.connector.end_held(seq.request_id, cancel=True)  # nothing lands in its blocks after
    sched.preempt(seq, out)


def settle(sched: Scheduler, out: SchedulerOutput, failed_blocks: set[int]) -> None:
    """After the step: a layered prefill whose load failed starts over (the layers it ran read
    that KV); one that finished forgets its state. The newest goes back first, so the queue
    keeps their order."""
    for seq in reversed(out.layered):
        if seq in sched.layering and any(b in failed_blocks for b in seq.block_table):
            drop(sched, seq)  # a blend starts over as a blend: its loads are planned again
        elif seq not in sched.layering:
            seq.layering = None
