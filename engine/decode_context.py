"""The Context of a decode step (every sequence one new token) in few tensor ops: the rows'
token ids, positions, slots and key counts come from Python ints in one tensor, and the
block tables are reused from the last decode step while the same sequences hold the same
blocks. Steps with a prompt chunk take build_context's general path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierkv.engine.context import Context, PagedBatch, bucket
from tierkv.engine.scheduler import SchedulerOutput
from tierkv.engine.sequence import Sequence
from tierkv.kernels import AttentionMeta, cpu
from tierkv.kernels.cascade import CascadeGroups, find_groups


@dataclass(slots=True)
class Tables:
    """A decode batch's block tables on the device, kept while its sequences and blocks stay."""

    block_ids: list[list[int]]  # the lists they were made from (compared whole each step)
    nblk: int  # blocks the decode kernel reads per sequence
    tables: torch.Tensor  # int32 [B, width], -1 padded (AttentionMeta.block_tables)
    ids: torch.Tensor  # int64 [B, nblk], padding clamped to a valid id (the C++ decode kernel)
    cu: torch.Tensor  # int32 [B + 1]: one query row per sequence
    cascade: CascadeGroups | None  # sequences sharing leading blocks; None: none or off


@dataclass(slots=True)
class DecodeContexts:
    """Builds decode steps' Contexts for one runner (the tables of its last decode step)."""

    block_size: int
    num_blocks: int
    one_decode_group: bool  # the C++ decode kernel serves every decode in one call
    triton: bool  # the Triton kernel serves the whole step
    device: torch.device
    cascade: bool = False  # look for shared leading blocks (EngineConfig.cascade_attention)
    last: Tables | None = None

    def build(self, out: SchedulerOutput) -> Context | None:
        """The step's Context, or None when a sequence has more than one new token or neither
        kernel takes a decode batch whole (the torch reference groups them by length)."""
        if not (self.one_decode_group or self.triton) or any(n != 1 for n in out.num_new_tokens):
            return None
        bs, seqs, dev = self.block_size, out.seqs, self.device
        b = len(seqs)
        pos = [s.num_computed_tokens for s in seqs]
        ids = [s.token_ids[p] for s, p in zip(seqs, pos)]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
        sampled = [i for i, smp in enumerate(out.samples()) if smp]
        n, m = bucket(b), bucket(len(sampled))
        width = max(n, m)
        rows = torch.tensor(
            [
                ids + [0] * (width - b),
                pos + [0] * (width - b),
                slots + [-1] * (width - b),
                [p + 1 for p in pos] + [0] * (width - b),
                sampled + [0] * (width - len(sampled)),
            ]
        ).to(dev)
        lens = rows[3, :b]
        top = max(pos) + 1
        t = self._tables(seqs, -(-top // bs), [p + 1 for p in pos])
        q_pos = rows[1, :b].to(torch.int32)
        meta = AttentionMeta(t.tables, lens.to(torch.int32), t.cu, q_pos, 1, top, t.cascade)
        full = PagedBatch(None, meta)
        decode = None
        if not self.triton:
            decode = (t.ids, lens, cpu.decode_chunk(sum(pos) + b))
        return Context(
            input_ids=rows[0, :n],
            positions=rows[1, :n],
            slot_mapping=rows[2, :n],
            num_tokens=b,
            logits_indices=rows[4, :m],
            num_sampled=len(sampled),
            all=full,
            paged=[full],
            fresh=[],
            decode=decode,
            seq_ids=[s.seq_id for s in seqs],
            block_ids=t.block_ids,
        )

    def _tables(self, seqs: list[Sequence], nblk: int, seen: list[int]) -> Tables:
        """The step's tables, and its cascade groups: found from the keys seen now, they stay
        right while the tables do (the keys seen only grow, and a decode writes into a block of
        its own: the block manager copies a shared one first)."""
        block_ids = [list(s.block_table) for s in seqs]
        last = self.last
        if last is not None and last.nblk == nblk and last.block_ids == block_ids:
            return last
        width = max(len(x) for x in block_ids)
        tables = torch.tensor([x + [-1] * (width - len(x)) for x in block_ids], dtype=torch.int32)
        # Block ids from the block manager are valid; the -1 padding is clamped, never read.
        ids = tables[:, :nblk].long().clamp(0, self.num_blocks - 1)
        cu = torch.arange(len(seqs) + 1, dtype=torch.int32)
        dev = self.device
        groups = find_groups(block_ids, seen, self.block_size) if self.cascade else None
        cascade = groups if groups is not None and groups.members else None
        self.last = Tables(block_ids, nblk, tables.to(dev), ids.to(dev), cu.to(dev), cascade)
        return self.last
