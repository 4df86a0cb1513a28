"""A prefill as pieces of work: a generator that runs at most `Pace.allow` rows through one
layer, then yields how many it ran. drive() runs one to its end (Pace's default allows a whole
layer, so each piece is a layer, run as a prefill in one step runs it); a layered prefill runs
a step's share of pieces a step (engine/layered.py), so a layer of a long prompt spans steps.

Row chunks of one layer are exact: a chunk's queries attend (causal, by position) over the
keys of the rows up to its own end, which this chunk and the chunks before it in the same layer
wrote into the paged cache; later rows' keys are masked. A layer starts only once every chunk
of the layer before it ran.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tierkv.engine.context import Context
    from tierkv.engine.model import DecoderLayer
    from tierkv.engine.model_runner import ModelRunner

# A projection alone (the check layer's q, k, v of every row) counts as 1/QKV_SHARE of a
# layer's work per row: it is about a seventh of a layer's linear FLOPs (docs/cacheblend.md)
# and no attention; a quarter errs toward short steps.
QKV_SHARE = 4

Work = Generator[int, None, torch.Tensor]  # yields the rows x layers each piece ran


@dataclass(slots=True)
class Pace:
    """A piecewise prefill's pace: set by whoever drives it, read and updated by the pieces."""

    allow: int = sys.maxsize  # rows the next piece may run through a layer (the driver's)
    left: int = sys.maxsize  # an upper bound on the rows x layers still to run (the work's)


def drive(work: Generator[int, None, torch.Tensor]) -> torch.Tensor:
    """Run a piecewise prefill to its end; its result."""
    while True:
        try:
            next(work)
        except StopIteration as done:
            return done.value


def part(ctx: Context, a: int, b: int) -> Context:
    """The Context of rows a..b of a one-sequence prefill step ctx (its prompt's rows in position
    order, one after another): their keys end at their last row."""
    start = ctx.all.meta.max_seqlen_k
    assert start is not None  # build_context sets it: the sequence's keys after the step
    top = start - ctx.num_tokens + b
    pos = ctx.positions[a:b]
    dev = pos.device
    meta = replace(
        ctx.all.meta,
        seq_lens=torch.tensor([top], dtype=torch.int32, device=dev),
        cu_seqlens_q=torch.tensor([0, b - a], dtype=torch.int32, device=dev),
        q_positions=pos.to(torch.int32),
        max_seqlen_q=b - a,
        max_seqlen_k=top,
    )
    batch = replace(ctx.all, rows=None, meta=meta)
    return replace(
        ctx,
        input_ids=ctx.input_ids[a:b],
        positions=pos,
        slot_mapping=ctx.slot_mapping[a:b],
        num_tokens=b - a,
        all=batch,
        paged=[batch],
        fresh=[],
        decode=None,
    )


def rows_layer(runner: ModelRunner, ctx: Context, i: int, h: torch.Tensor, pace: Pace) -> Work:
    """Layer i over every row of ctx (h: their hidden states, padded as ctx), whole when the pace
    allows it, else in row chunks; leaves runner.ctx at ctx. Returns the layer's output."""
    n, layer = ctx.num_tokens, runner.model.layers[i]
    if pace.allow >= n:
        runner.ctx = ctx
        h = layer(i, h, ctx.positions, runner.attend)
        pace.left -= n
        yield n
        return h
    out, a = h.clone(), 0  # padding rows as they were: they write no KV and are never read
    while a < n:
        b = min(n, a + max(1, pace.allow))
        runner.ctx = part(ctx, a, b)
        out[a:b] = layer(i, h[a:b], ctx.positions[a:b], runner.attend)
        runner.ctx = ctx
        pace.left -= b - a
        yield b - a
        a = b
    return out


def qkv_rows(
    layer: DecoderLayer, h: torch.Tensor, pos: torch.Tensor, pace: Pace
) -> Generator[int, None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """q, k and v of every row of h (at positions pos), in row chunks of QKV_SHARE x pace.allow
    rows."""
    m, a, parts = h.shape[0], 0, []
    while a < m:
        b = min(m, a + max(1, pace.allow) * QKV_SHARE)
        x = h if (a, b) == (0, m) else h[a:b]
        parts.append(layer.self_attn.qkv(layer.input_layernorm(x), pos[a:b]))
        cost = -(-(b - a) // QKV_SHARE)
        pace.left -= cost
        yield cost
        a = b
    if len(parts) == 1:
        return parts[0]
    q, k, v = (torch.cat(x) for x in zip(*parts))
    return q, k, v


def prefill(runner: ModelRunner, ctx: Context, pace: Pace) -> Work:
    """A plain prefill of ctx's rows (a one-sequence step) through every layer, piecewise;
    returns the last layer's hidden states of every row."""
    layers = runner.model.layers
    h = runner.model.embed_tokens(ctx.input_ids)
    for i in range(len(layers)):
        pace.left = ctx.num_tokens * (len(layers) - i)
        h = yield from rows_layer(runner, ctx, i, h, pace)
    return h
