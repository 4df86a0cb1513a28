"""The blend prefill: the step's only sequence, its whole prompt after any cached prefix (a
declared shared prefix found in the prefix cache or loaded exactly), whatever the per-step
token budget. The connector has scattered each reusable segment's cached KV into the
sequence's blocks, re-rotated to its position here. The rule (blend_rules.py) says which rows
run where:
- fixed rows run through every layer: every row not loaded (the question, missed segments),
  the last row (its logits are sampled), and with legolink each loaded segment's first tokens;
- with a ranking rule and ratio > 0, layers 0..check_layer-1 run in full on every row; at
  check_layer every row's fresh K/V is computed and written, the rule picks the top `ratio` of
  the loaded rows (cacheblend ranks by the fresh-vs-cached distance, read before the write;
  query_early by the question's attention there; query_late by the question's attention at
  3/4 depth from a question-only pass over the cached KV, run first), and the layer's
  attention and MLP run for the kept rows (fixed | picked) only;
- without one (or at ratio 0) the fixed rows alone run from layer 0;
- later layers run only the kept rows, whose queries attend over every key (the cached KV of
  the dropped rows, the fresh KV of the kept ones; with ape, the cached block through APE)
  and whose KV replaces the cache.
ratio 1.0 keeps every row whatever the rule: exactly a full prefill, APE with nothing cached.
The steps and their state are blend_pass.BlendPass's; this drives them, layer by layer.
"""

from __future__ import annotations

import torch

from tierkv.engine.blend import BlendParams, BlendReport, rows_of
from tierkv.engine.blend_pass import BlendPass
from tierkv.engine.blend_rules import sink_rows
from tierkv.engine.tiles import Pace, Work, prefill, qkv_rows, rows_layer


def blend_layers(
    runner,
    ctx,
    params: BlendParams,
    loaded: list[tuple[int, int]],
    segments: list[tuple[int, int, bool]],
    start: int,
    report: BlendReport,
    pace: Pace | None = None,
) -> Work:
    """The blend prefill of the step's only sequence, whose rows are its tokens from start on;
    returns the hidden states of the rows that reach the last layer and points
    ctx.logits_indices at the last prompt token. Piecewise (engine/tiles.py): a layer's rows go
    in chunks of at most pace.allow (a layer whole by default), except in the layers that rank
    every row at once (the check layer's ranking, gradual filtering, query_late's pass)."""
    pace = Pace() if pace is None else pace
    model, n = runner.model, ctx.num_tokens
    cand = rows_of([(a - start, b - start) for a, b in loaded], n)  # cached KV in the blocks
    report.loaded, report.computed = int(cand.sum()), int((~cand).sum())
    rule, layers = params.rule, len(model.layers)
    if not cand.any() or (params.ratio == 1.0 and rule.rank is None):
        report.recomputed = report.loaded  # nothing loaded, or everything recomputed
        report.full_layers = layers if cand.any() else 0
        return (yield from prefill(runner, ctx, pace))
    fixed = ~cand
    fixed[n - 1] = True
    if rule.sinks and params.ratio < 1.0:
        fixed |= sink_rows(segments, start, cand, params.sinks)
    bp = BlendPass(runner, ctx, params, report, pace, start, cand, fixed, rule.ape)
    gradual = params.gradual if rule.rank == "cacheblend" and params.metric != "random" else 0
    pace.left = n * layers
    if rule.rank == "query_late" and 0.0 < params.ratio < 1.0:
        bp.late = bp.late_mass()
        yield int((~cand).sum() + 1) * params.layer_of_query(layers)
    if rule.rank is None or params.ratio == 0.0:  # only the fixed rows, from layer 0
        bp.st, bp.written, bp.first, gradual = bp.kept(torch.nonzero(fixed).flatten()), fixed, 0, 0
        h = model.embed_tokens(ctx.input_ids[bp.st.rows])
    else:
        h = model.embed_tokens(ctx.input_ids)
        c = min(params.check_layer, layers - 1)
        for i in range(c):
            h = yield from rows_layer(runner, ctx, i, h, pace)
        # The check layer: fresh K/V of every row (they are exact: every layer before ran in
        # full), but attention and MLP only for the kept rows, the only ones read later on.
        layer = model.layers[c]
        q, k, v = yield from qkv_rows(layer, h, ctx.positions, pace)
        keep = fixed | bp.rank(c, q, k, v)
        report.full_layers, bp.first = c, c + 1
        if keep.all():  # everything kept: the rest is an ordinary prefill
            report.recomputed = report.loaded
            pace.left = n * (layers - c)
            if pace.allow >= n:
                h = layer.finish(h, runner.attend(c, q, k, v))
                pace.left -= n
                yield n
            else:
                runner.store(c, k, v)
                bp.st, bp.written = bp.kept(torch.arange(n)), torch.ones(n, dtype=torch.bool)
                h = torch.cat([(yield from bp.finish(c, h, q)), h[n:]])  # ctx's padding rows kept
            for i in range(bp.first, layers):
                h = yield from rows_layer(runner, ctx, i, h, pace)
            return h
        runner.store(c, k, v)
        bp.st, bp.written = bp.kept(torch.nonzero(keep).flatten()), torch.ones(n, dtype=torch.bool)
        pace.left = bp.st.rows.numel() * (layers - c)
        h = yield from bp.finish(c, h, q)
        bp.written = keep
    for i in range(bp.first, layers):
        pace.left = bp.st.rows.numel() * (layers - i)
        if i - bp.first >= gradual:
            h = yield from bp.subset(i, h)
            continue
        h, rows = bp.filtered(i, h)
        yield rows
    pace.left = 0
    report.recomputed = int(cand[bp.st.rows.cpu()].sum())
    ctx.logits_indices = torch.tensor([h.shape[0] - 1], device=h.device)
    ctx.num_sampled = 1
    return h
