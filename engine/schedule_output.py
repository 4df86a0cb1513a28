"""What one step runs (the scheduler's output), and the rule that holds a request back one step
when a sequence in the step completes a prefix block it would otherwise compute again."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.engine.block_manager import BlockManager, tree_key
from tierkv.engine.sequence import Sequence


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # query tokens per sequence this step
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)
    connector_meta: object = None
    blend: Sequence | None = None  # chunked mode's blend prefill: this step's only sequence
    # The layered prefills in flight this step (engine/layered.py), first come first served:
    # each runs its share of the step's work; one is in seqs (after the others, in this order)
    # only in its final step, where it samples.
    layered: list[Sequence] = field(default_factory=list)
    ran: tuple[int, float] = (0, 0.0)  # rows x layers the layered pieces ran, their seconds

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self) -> list[bool]:
        """Whether each sequence reaches its last token this step (and so samples one)."""
        return [s.num_computed_tokens + n == len(s) for s, n in zip(self.seqs, self.num_new_tokens)]


def computed_this_step(blocks: BlockManager, seq: Sequence, out: SchedulerOutput) -> bool:
    """True when a sequence already in this step completes a block of its prefix that seq
    would match (requests sharing a system prompt arriving together): seq then waits one
    step and hits that block in the prefix cache instead of computing it a second time."""
    if blocks.tree is None or not seq.exact_kv:
        return False
    bs, key = blocks.block_size, None
    for other, n in zip(out.seqs, out.num_new_tokens):
        end = (other.num_computed_tokens // bs + 1) * bs  # the first block it completes now
        if end > other.num_computed_tokens + n or end > len(seq) - 1 or not other.exact_kv:
            continue
        if other.token_ids[end - bs : end] != seq.token_ids[end - bs : end]:
            continue  # a cheap look at the block itself first
        key = tree_key(seq, len(seq) - 1) if key is None else key
        if tree_key(other, end) == key[:end]:
            return True
    return False
