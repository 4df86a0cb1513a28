"""Block prefetch: the last hop of a workflow prefetch, from the connector's local tier into free
KV blocks, indexed in the prefix cache as if computed (the next step's agent then hits it).

A prompt queued by a workflow step (engine/workflow.py) is tried at the start of each engine
step: the part the prefix cache lacks and the connector's local tier holds (its
get_num_prefetched_tokens) is loaded through the connector's ordinary, verified load path
alongside that step's own loads, into at most `max_blocks` free blocks, and inserted in the
radix tree after the step. A long prompt arrives over several steps.

Safety contract: never takes a block the queued or running sequences may need in the step
(their remaining need is reserved) and evicts nothing but, under "hinted" eviction, cached
prefixes whose next use is farther than the next step; only KV the connector verified is
indexed (a failed load indexes the blocks before it); a prompt that a waiting request will load
itself is dropped (that request loads normally, also the part still to come of a prompt
arriving over several steps); every block taken is in the prefix cache or free again when the
step ends (`land`, or `cancel` when the step runs nothing).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierkv.engine.invariants import invariant
from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.sequence import Sequence
from tierkv.storage_backends.hints import KVHint

if TYPE_CHECKING:
    from tierkv.engine.scheduler import Scheduler

MAX_QUEUED = 16  # prompts waiting for their local-tier copy (the oldest go first)
MAX_LOOKUPS = 4  # queued prompts looked up in the local tier per step
MAX_TRIES = 256  # steps a queued prompt waits for its local-tier copy before it is dropped
NEXT_STEP = 1.0  # a prefetched prompt's next use: cached prefixes needed later may make room
ID = "\x00blocks/"  # request ids of the loads (no client sends a NUL)


@dataclass(slots=True)
class BlockPrefetchStats:
    issued: int = 0  # loads started
    landed_blocks: int = 0  # blocks indexed in the prefix cache
    failed_blocks: int = 0  # blocks whose load failed (freed, never indexed)
    dropped: int = 0  # prompts dropped: a request loaded them itself, or they never arrived
    loaded_tokens: dict[str, int] = field(default_factory=dict)  # per tier of the connector


@dataclass(slots=True)
class Wanted:
    tokens: list[int]
    salt: str | None
    hint: KVHint | None
    tries: int = 0


@dataclass(slots=True, eq=False)
class BlockPrefetch:
    """Owned by the engine; every call is on the engine's thread, between or around a step."""

    scheduler: Scheduler
    max_blocks: int  # per step; 0: off
    queue: OrderedDict[tuple[tuple[int, ...], str | None], Wanted] = field(
        default_factory=OrderedDict
    )
    seq: Sequence | None = None  # the load in flight this step
    hint: KVHint | None = None  # its prompt's agent (the radix nodes are tagged with it)
    stats: BlockPrefetchStats = field(default_factory=BlockPrefetchStats)
    _next: int = 0

    def want(self, tokens: list[int], salt: str | None, hint: KVHint | None) -> None:
        """A prompt expected soon (its connector prefetch has started)."""
        if self.max_blocks <= 0 or self.scheduler.blocks.tree is None:
            return
        key = (tuple(tokens[: self.scheduler.blocks.block_size]), salt)
        self.queue.pop(key, None)
        self.queue[key] = Wanted(list(tokens), salt, hint)
        while len(self.queue) > MAX_QUEUED:
            self.queue.popitem(last=False)
            self.stats.dropped += 1

    def issue(self) -> None:
        """Before the step's schedule: start loading the first queued prompt that its local-tier
        copy lets grow, into free blocks left over the sequences' reserve (under "hinted"
        eviction also blocks of cached prefixes needed later than the next step)."""
        sched, blocks = self.scheduler, self.scheduler.blocks
        if self.seq is not None or not self.queue or blocks.tree is None:
            return
        head = sched.waiting[0] if sched.waiting else None
        if head is not None and head.blend is not None:
            return  # a blend prefill runs alone and loads its own way
        self._drop_claimed()
        bs = blocks.block_size
        for key in list(self.queue)[:MAX_LOOKUPS]:
            w, seq = self.queue[key], self._seq(self.queue[key])
            last = (len(seq) - 1) // bs * bs  # the most a prefix can hold (its last token runs)
            seq.num_computed_tokens = cached = blocks.cached_tokens(seq)  # changes nothing
            ext = max(0, int(sched.connector.get_num_prefetched_tokens(seq, cached)))
            end = min(cached + ext, last, cached + self.max_blocks * bs) // bs * bs
            hit = blocks.match_prefix(seq, end) if end > cached else cached  # locked if it loads
            short = (end - hit) // bs - (len(blocks.free) - self._reserve())
            if end > hit and short > 0:  # what "hinted" eviction would drop for it anyway
                blocks.evict_beyond(short, NEXT_STEP)
            end = min(end, hit + max(0, len(blocks.free) - self._reserve()) * bs)
            if end <= hit:
                self._finish(seq)
                w.tries += 1
                if hit >= last or w.tries >= MAX_TRIES:
                    del self.queue[key]  # all cached already, or it never arrived
                    self.stats.dropped += hit < last
                continue
            seq.num_computed_tokens = hit
            copies = blocks.allocate(seq, end)  # within the room: never None, never a copy
            invariant(copies == [], "block prefetch allocation failed or copied a block")
            sched.connector.update_state_after_alloc(seq, list(seq.block_table), end - hit)
            seq.num_computed_tokens = end
            self.seq, self.hint = seq, w.hint
            self.stats.issued += 1
            return

    def _reserve(self) -> int:
        """Free blocks the running and queued sequences may take in the step (a queued one's
        cached prefix aside): block prefetch leaves them."""
        sched, blocks = self.scheduler, self.scheduler.blocks
        need = sum(blocks.blocks_needed(s, len(s)) for s in sched.running)
        for s in sched.waiting:
            cached = 0 if s.block_table else blocks.cached_tokens(s) // blocks.block_size
            need += blocks.blocks_needed(s, len(s)) - cached
        return need

    def land(self, failed: set[int]) -> None:
        """After the step's forward (failed: its blocks whose load failed): the verified blocks
        go into the prefix cache, the rest are freed."""
        seq, self.seq = self.seq, None
        if seq is None:
            return
        blocks, bs = self.scheduler.blocks, self.scheduler.blocks.block_size
        bad = next((i for i, b in enumerate(seq.block_table) if b in failed), None)
        if bad is not None and bad * bs < seq.num_computed_tokens:
            self.stats.failed_blocks += len(seq.block_table) - bad
            seq.num_computed_tokens = bad * bs
        before = seq.num_indexed_blocks
        blocks.cache_blocks(seq)
        self.stats.landed_blocks += max(0, seq.num_indexed_blocks - before)
        if self.hint is not None and seq.lock is not None and blocks.tree is not None:
            blocks.tree.tag(seq.lock, self.hint)
        self._finish(seq)

    def cancel(self) -> None:
        """The step ran nothing (its loads never ran): the blocks taken are freed."""
        seq, self.seq = self.seq, None
        if seq is not None:
            seq.num_computed_tokens = 0
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        sched = self.scheduler
        if sched.connector.request_finished(seq, list(seq.block_table)):
            sched.held[seq.request_id] = seq  # freed when the connector reports it
        else:
            sched.blocks.free_seq(seq)
        loaded = sched.connector.request_metrics(seq.request_id).get("loaded_tokens", {})
        for tier, n in loaded.items():
            self.stats.loaded_tokens[tier] = self.stats.loaded_tokens.get(tier, 0) + n

    def _drop_claimed(self) -> None:
        """Prompts a waiting request starts with: that request loads them itself."""
        if not self.queue:
            return
        bs = self.scheduler.blocks.block_size
        for s in self.scheduler.waiting:
            if self.queue.pop((tuple(s.token_ids[:bs]), s.params.cache_salt), None) is not None:
                self.stats.dropped += 1

    def _seq(self, w: Wanted) -> Sequence:
        self._next += 1
        seq = Sequence(
            -self._next,
            f"{ID}{self._next}",
            f"{ID}{self._next}",
            list(w.tokens),
            len(w.tokens),
            SamplingParams(max_tokens=1, cache_salt=w.salt),
        )
        return seq  # unhinted: the connector's advice went with its own prefetch
