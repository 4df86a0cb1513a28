"""A step's attention metadata: the scheduled sequences' new tokens flattened into rows, their
positions and cache slots, and how the CPU path splits them into kernel calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierkv.engine.scheduler import SchedulerOutput
from tierkv.kernels import AttentionMeta, cpu

DECODE_GROUP_RATIO = 2  # a decode group's shortest sequence is at least 1/2 of its longest


def bucket(n: int) -> int:
    """Row count a step is padded to: CPU matmul libraries build a kernel per new shape, so a
    few dozen shapes beat a new one every step (the padding rows are a few percent). Up to 8
    rows none: a GEMM of 8 rows costs 2-3x one of 1 where the weights' reads dominate."""
    if n <= 8:
        return n
    step = 8 if n <= 64 else 64 if n <= 1024 else 256
    return -(-n // step) * step


@dataclass(slots=True)
class PagedBatch:
    """The sequences that attend through the paged cache (decodes, chunks over a cached prefix)."""

    rows: torch.Tensor | None  # int64 query rows of these sequences; None = all real rows
    # int32 tensors, block tables -1 padded, seq_lens the keys after this step's write
    meta: AttentionMeta


@dataclass(slots=True)
class Context:
    """Attention metadata of one step: the scheduled sequences' new tokens, flattened and
    padded to bucket(num_tokens) rows (padding rows write no KV and attend to nothing)."""

    input_ids: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N] absolute positions
    slot_mapping: torch.Tensor  # int64 [N] cache slot of each new token, -1 for padding
    num_tokens: int  # real rows
    logits_indices: torch.Tensor  # int64 rows whose logits are sampled (padded to a bucket)
    num_sampled: int
    all: PagedBatch  # every sequence (what the connector and the Triton path see)
    paged: list[PagedBatch]  # the sequences not in `fresh`, in kernel calls
    fresh: list[tuple[int, int]]  # row ranges of whole prompts with no cached prefix (causal SDPA)
    # Decodes only, served by the C++ decode kernel: (block ids [B, nblk] int64, keys seen [B]
    # int64, keys per task), checked once here for the step instead of once per layer; None
    # otherwise.
    decode: tuple[torch.Tensor, torch.Tensor, int] | None
    seq_ids: list[int]  # seq_id of each sequence
    block_ids: list[list[int]]  # block table of each sequence (valid during this step only)


def build_context(
    out: SchedulerOutput,
    block_size: int,
    num_blocks: int,
    one_decode_group: bool,
    triton: bool,
    device: torch.device,
) -> Context:
    """The step's Context. one_decode_group: the C++ decode kernel serves this engine's caches,
    so decodes of any lengths go in one call (the torch reference pads to the longest).
    triton: the Triton kernel serves attention (the whole step in one call)."""
    bs, ids, counts, starts = block_size, [], [], []
    for seq, n in zip(out.seqs, out.num_new_tokens):
        start = seq.num_computed_tokens
        ids += seq.token_ids[start : start + n]
        counts.append(n)
        starts.append(start)
    b, n, dev = len(out.seqs), len(ids), device
    width = max(len(s.block_table) for s in out.seqs)
    tables = torch.full((b, width), -1, dtype=torch.int32)
    for i, s in enumerate(out.seqs):
        tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    count_t, start_t = torch.tensor(counts), torch.tensor(starts)
    cu = torch.zeros(b + 1, dtype=torch.int64)
    cu[1:] = count_t.cumsum(0)
    row = torch.repeat_interleave(torch.arange(b), count_t)
    positions = start_t[row] + torch.arange(n) - cu[:-1][row]
    slots = tables[row, positions // bs].long() * bs + positions % bs
    pad = bucket(n) - n
    sampled = (cu[1:] - 1)[torch.tensor(out.samples(), dtype=torch.bool)]
    lens = start_t + count_t
    full = PagedBatch(
        None,
        AttentionMeta(
            tables.to(dev),
            lens.to(torch.int32).to(dev),
            cu.to(torch.int32).to(dev),
            positions.to(torch.int32).to(dev),
            max(counts),
            int(lens.max()),
        ),
    )
    decode = None
    if triton:  # the Triton kernel takes the whole step at once
        fresh, paged = [], [full]
    else:
        # CPU path. Whole prompts with nothing cached attend only to themselves: causal SDPA,
        # no gather. The torch reference pads a decode batch to its longest sequence, so there
        # decodes go in groups of similar length; chunks over a cached prefix go in one more
        # call.
        is_fresh = (start_t == 0) & (count_t > 1)
        fresh = [(int(cu[i]), int(cu[i + 1])) for i in torch.nonzero(is_fresh).flatten().tolist()]
        dec = sorted((i for i in range(b) if counts[i] == 1), key=lambda i: -starts[i])
        groups: list[list[int]] = []
        cur: list[int] = []
        for i in dec:
            if (
                cur
                and not one_decode_group
                and (starts[i] + 1) * DECODE_GROUP_RATIO < starts[cur[0]] + 1
            ):
                groups.append(cur)
                cur = []
            cur.append(i)
        groups += [cur] if cur else []
        groups += [g] if (g := torch.nonzero(~is_fresh & (count_t > 1)).flatten().tolist()) else []
        paged = [_batch(g, tables, lens, count_t, cu, positions, bs, dev) for g in groups]
        if len(paged) == 1 and paged[0].rows is not None and paged[0].rows.numel() == n:
            paged = [full]
        if one_decode_group and len(dec) == b:
            # Block tables come from the block manager (valid ids; -1 padding clamped, never
            # read): the kernel's contract holds without the reference's per-call checks.
            nblk = -(-int(lens.max()) // bs)
            ids_t = tables[:, :nblk].long().clamp(0, num_blocks - 1).to(dev)
            decode = (ids_t, lens.to(dev), cpu.decode_chunk(int(lens.sum())))
    return Context(
        input_ids=F.pad(torch.tensor(ids), (0, pad)).to(dev),
        positions=F.pad(positions, (0, pad)).to(dev),
        slot_mapping=F.pad(slots, (0, pad), value=-1).to(dev),
        num_tokens=n,
        logits_indices=F.pad(sampled, (0, bucket(len(sampled)) - len(sampled))).to(dev),
        num_sampled=len(sampled),
        all=full,
        paged=paged,
        fresh=fresh,
        decode=decode,
        seq_ids=[s.seq_id for s in out.seqs],
        block_ids=[list(s.block_table) for s in out.seqs],
    )


def _batch(
    idx: list[int],
    tables: torch.Tensor,
    lens: torch.Tensor,
    counts: torch.Tensor,
    cu: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    dev: torch.device,
) -> PagedBatch:
    sel = torch.tensor(idx)
    c = counts[sel]
    kcu = torch.zeros(len(idx) + 1, dtype=torch.int64)
    kcu[1:] = c.cumsum(0)
    rows = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in idx])
    width = max(1, int((lens[sel].max() + block_size - 1) // block_size))
    return PagedBatch(
        rows.to(dev),
        AttentionMeta(
            tables[sel, :width].to(dev),
            lens[sel].to(torch.int32).to(dev),
            kcu.to(torch.int32).to(dev),
            positions[rows].to(torch.int32).to(dev),
            int(c.max()),
            int(lens[sel].max()),
        ),
    )
