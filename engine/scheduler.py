"""Scheduler: owns the waiting and running queues and decides each step's tokens.

Continuous batching under a per-step token budget: running sequences first (decodes and
prefill chunks, oldest first), then waiting ones FCFS while budget and blocks last. When
blocks run out the newest running sequence is preempted (its KV freed, recomputed later).
Nothing depends on hashing, nor on time but with layered_gap > 0, where the layered prefills'
pace follows measured step times (engine/pacer.py; their tokens do not: row chunks are exact).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from tierkv.engine.blend_step import blend_alone, blending, unblend
from tierkv.engine.block_manager import BlockManager
from tierkv.engine.config import EngineConfig
from tierkv.engine.invariants import check_invariants_enabled, invariant
from tierkv.engine.kv_connector import KVConnector
from tierkv.engine.layering import (
    admit_blend,
    admit_layered,
    advance,
    blend_layered,
    drop,
    settle,
    wants_layers,
)
from tierkv.engine.pacer import Pacer
from tierkv.engine.schedule_output import SchedulerOutput, computed_this_step
from tierkv.engine.sequence import Sequence, Status

__all__ = ["Scheduler", "SchedulerOutput"]


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockManager,
        connector: KVConnector,
        eos_token_ids: list[int],
        max_model_len: int,
        num_layers: int = 1,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.connector = connector
        self.eos = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by seq_id (arrival)
        self.held: dict[str, Sequence] = {}  # finished, blocks kept by the connector
        self.layering: list[Sequence] = []  # layered prefills in flight, FCFS (engine/layering.py)
        self.num_layers = num_layers
        self.pacer = Pacer(config.layered_gap, num_layers)  # their step's work with layered_gap
        self.check_invariants = check_invariants_enabled()  # check_integrity when idle

    def add(self, seq: Sequence) -> None:
        if len(seq) < 1:
            raise ValueError("empty prompt")
        if len(seq) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(seq)} tokens does not fit max_model_len {self.max_model_len}"
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.layering)

    def preempt(self, seq: Sequence, out: SchedulerOutput | None) -> None:
        """seq's blocks freed, back at the queue's head; it is recomputed when admitted again."""
        self.blocks.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        if out is not None:
            out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        if self.config.prefill_mode == "chunked" and (alone := blend_alone(self)) is not None:
            alone.connector_meta = self.connector.build_connector_meta(alone)
            return alone  # layered mode: a blend prefill goes beside the running ones, below
        out = SchedulerOutput()
        budget, i = self.config.max_num_batched_tokens, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            copies = self.blocks.allocate(seq, seq.num_computed_tokens + n)
            while copies is None and self.layering:  # layered prefills go first, the newest first
                drop(self, self.layering[-1], out)
                copies = self.blocks.allocate(seq, seq.num_computed_tokens + n)
            while copies is None:
                victim = self.running.pop()  # the newest; never one already scheduled this step
                self.preempt(victim, out)
                if victim is seq:
                    break
                copies = self.blocks.allocate(seq, seq.num_computed_tokens + n)
            if copies is None:
                break
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            out.copies += copies
            budget -= n
            i += 1
        if blend_layered(self) and not out.preempted:  # after the running ones took their blocks
            admit_blend(self, self.waiting[0], out)
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) + len(self.layering) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            if blending(seq):
                break  # admitted alone, above
            if computed_this_step(self.blocks, seq, out):
                break  # next step it hits that block in the prefix cache
            hit = self.blocks.match_prefix(seq)
            seq.num_computed_tokens = hit
            ext = self.connector.get_num_new_matched_tokens(seq, hit)
            ext = max(0, min(int(ext), len(seq) - 1 - hit))  # the last prompt token is computed
            if wants_layers(self, seq, len(seq) - hit - ext):
                admit_layered(self, seq, hit, ext, out)
                break  # FCFS: the prompts behind it wait for the next step
            n = min(len(seq) - hit - ext, budget)
            copies = self.blocks.allocate(seq, hit + ext + n)
            if copies is None:
                self.blocks.free_seq(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.connector.update_state_after_alloc(seq, list(seq.block_table), ext)
            seq.num_computed_tokens += ext
            self.start(seq, hit, ext)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            out.copies += copies
            budget -= n
        advance(self, out)
        out.connector_meta = self.connector.build_connector_meta(out)
        return out

    def start(self, seq: Sequence, hit: int, ext: int) -> None:
        """seq runs from this step on; its first admission sets what it found cached."""
        if not seq.admitted:
            seq.admitted = True
            seq.metrics.num_cached_tokens, seq.metrics.num_external_tokens = hit, ext
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.seq_id)

    def postprocess(
        self,
        out: SchedulerOutput,
        tokens: dict[int, int],
        failed_blocks: set[int],
        children: Iterable[tuple[Sequence, Sequence]] = (),
    ) -> list[Sequence]:
        """Advance each scheduled sequence by its step and append its sampled token (tokens is by
        seq_id); roll back sequences whose loaded blocks failed (from the first failed block, the
        sample dropped); add the n > 1 children of parents that sampled their first token.
        Returns the sequences that finished."""
        bs = self.blocks.block_size
        finished: list[Sequence] = []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            seq.num_computed_tokens += n
            seq.metrics.num_computed_tokens += n
            bad = next((j for j, b in enumerate(seq.block_table) if b in failed_blocks), None)
            if bad is not None and (seq is out.blend or (seq in out.layered and blending(seq))):
                unblend(seq, bad * bs, n)
                continue
            if bad is not None and bad * bs < seq.num_computed_tokens:
                m = seq.metrics
                m.num_external_tokens -= min(
                    m.num_external_tokens,
                    max(0, m.num_cached_tokens + m.num_external_tokens - bad * bs),
                )
                seq.num_computed_tokens = bad * bs
                continue
            token = tokens.get(seq.seq_id)
            if token is not None:
                self._append(seq, token, finished)
            if seq.exact_kv:  # blended KV is approximate: never offered to the prefix cache
                self.blocks.cache_blocks(seq)
        settle(self, out, failed_blocks)
        for parent, child in children:
            if (
                parent.num_output_tokens != 1
                or parent.num_computed_tokens != parent.num_prompt_tokens
            ):
                continue  # the parent was rolled back; it forks when it samples again
            self.blocks.fork(parent, child)
            child.status, child.admitted = Status.RUNNING, True
            m, p = child.metrics, parent.metrics
            m.arrival_time = p.arrival_time
            m.num_cached_tokens, m.num_external_tokens = p.num_cached_tokens, p.num_external_tokens
            bisect.insort(self.running, child, key=lambda s: s.seq_id)
            self._append(child, tokens[child.seq_id], finished)
        for seq in finished:
            self.running.remove(seq)
            if self.connector.request_finished(seq, list(seq.block_table)):
                self.held[seq.request_id] = seq
            else:
                self.blocks.free_seq(seq)
        if finished and self.check_invariants and not self.has_work():
            self.check_integrity()  # TIERKV_CHECK_INVARIANTS=1: whenever the queues empty
        return finished

    def _append(self, seq: Sequence, token: int, finished: list[Sequence]) -> None:
        seq.token_ids.append(token)
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.status = Status.FINISHED
            finished.append(seq)

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Drop unfinished seqs (their client went away): out of the queues, their blocks freed,
        or held while the connector still reads them."""
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.layering:
                self.layering.remove(seq)
                seq.layering = None
                self.connector.end_held(seq.request_id, cancel=True)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
            if self.connector.request_finished(seq, list(seq.block_table)):
                self.held[seq.request_id] = seq
            else:
                self.blocks.free_seq(seq)

    def release_saved(self, request_ids: set[str]) -> None:
        """Free the blocks of finished requests whose save the connector reports done."""
        for rid in request_ids:
            seq = self.held.pop(rid, None)
            if seq is not None:
                self.blocks.free_seq(seq)

    def kv_slots(self) -> tuple[int, int]:
        """(allocated KV slots, slots holding no token): blocks in use * block_size, and the
        unfilled tails of the running sequences' blocks."""
        used = (self.blocks.num_blocks - len(self.blocks.free)) * self.blocks.block_size
        empty = sum(
            len(s.block_table) * self.blocks.block_size - s.num_computed_tokens
            for s in self.running
        )
        return used, empty

    def check_integrity(self) -> None:
        live = self.running + list(self.held.values()) + [s for s in self.waiting if s.block_table]
        live += self.layering
        self.blocks.check_integrity(live)
        invariant(
            all(a.seq_id < b.seq_id for a, b in zip(self.running, self.running[1:])),
            "running unsorted",
        )
