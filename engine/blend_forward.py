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
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tierkv.engine import blend_rules
from tierkv.engine.blend import BlendParams, BlendReport, rows_of
from tierkv.engine.blend_ape import ape_attention, attention_mass, read, seq_kv
from tierkv.engine.blend_rules import count, question_rows, sink_rows, top_attended
from tierkv.engine.tiles import Pace, Work, prefill, qkv_rows, rows_layer
from tierkv.kernels import AttentionMeta


@dataclass(slots=True)
class Kept:
    """The rows a layer runs, with their positions, cache slots and attention metadata (every
    key of the prompt), indexed once for every layer that runs them."""

    rows: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    meta: AttentionMeta


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
    model, conn, n = runner.model, runner.connector, ctx.num_tokens
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
    total, ape = start + n, rule.ape
    st: Kept  # the rows the current layer runs
    written: torch.Tensor  # the rows whose fresh KV the current layer wrote

    def kept(rows: torch.Tensor) -> Kept:
        pos = ctx.positions[rows]
        cu = torch.tensor([0, rows.numel()], dtype=torch.int32, device=pos.device)
        meta = replace(
            ctx.all.meta, cu_seqlens_q=cu, q_positions=pos.to(torch.int32), max_seqlen_q=len(rows)
        )
        return Kept(rows, pos, ctx.slot_mapping[rows], meta)

    def attention(layer: int, q: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
        """The kept rows' queries q over every key of the prompt; written: the rows whose fresh
        KV this layer wrote (with ape, the other loaded rows are the cached context block)."""
        stale = cand & ~written
        if ape and stale.any():
            k, v = seq_kv(runner, ctx, layer, total)
            block = torch.cat([torch.zeros(start, dtype=torch.bool), stale]).to(k.device)
            t, s = params.ape_temperature, params.ape_scale
            return ape_attention(q, st.pos, k, v, block, runner.scale, t, s)
        return runner.ops.attention(q, runner.layer_caches[layer], st.meta, runner.scale)

    def mask(rows: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(n, dtype=torch.bool)
        m[rows.cpu()] = True
        return m

    def subset_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        conn.wait_for_layer_load(layer)
        runner.ops.write_kv(k, v, runner.layer_caches[layer], st.slots)
        return attention(layer, q, written)

    def question_mass(layer: int, q: torch.Tensor, qrows: torch.Tensor) -> torch.Tensor:
        """Per row, the attention the question's queries (q of rows qrows) give it at layer."""
        k, _ = seq_kv(runner, ctx, layer, total)
        pos = ctx.positions[qrows.to(ctx.positions.device)]
        return attention_mass(q, pos, k, runner.scale)[start:total]

    def late_mass() -> torch.Tensor:
        """query_late: the rows not loaded run alone over the cached KV up to the query layer
        (their KV is rewritten by the prefill after); the question's attention there. Plain
        attention: APE applies to the prefill only."""
        nonlocal st, written, ape
        ape = False
        ql = params.layer_of_query(layers)
        pre = ~cand
        pre[n - 1] = True
        st = kept(torch.nonzero(pre).flatten())
        written = mask(st.rows)
        h = model.embed_tokens(ctx.input_ids[st.rows])
        for i in range(ql):
            h = model.layers[i](i, h, st.pos, subset_attend)
        layer = model.layers[ql]
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), st.pos)
        conn.wait_for_layer_load(ql)
        runner.ops.write_kv(k, v, runner.layer_caches[ql], st.slots)
        qrows = question_rows(cand)
        sel, ape = torch.searchsorted(st.rows.cpu(), qrows), rule.ape
        return question_mass(ql, q[sel.to(q.device)], qrows)

    def rank(c: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Mask of the loaded rows the ranking rule picks at the check layer c (cacheblend
        reads the cache before it is written; the query rules after)."""
        conn.wait_for_layer_load(c)
        rows = torch.nonzero(cand).flatten()
        if params.ratio == 1.0:  # every loaded row, whatever the ranking
            return cand.clone()
        if rule.rank == "query_late":
            return top_attended(late, cand, params.ratio, params.smooth)
        if rule.rank == "query_early":  # fresh K/V first (runner.store saves it after)
            runner.ops.write_kv(k, v, runner.layer_caches[c], ctx.slot_mapping)
            qrows = question_rows(cand)
            mass = question_mass(c, q[qrows.to(q.device)], qrows)
            return top_attended(mass, cand, params.ratio, params.smooth)
        if params.metric == "random":
            return mask(blend_rules.random_rows(rows, params.share(0)))
        which = 0 if params.metric == "k" else 1
        at = ctx.slot_mapping[:n][cand]
        fresh = (k if which == 0 else v)[:n][cand]
        return mask(rows[blend_rules.select(fresh, read(runner, c, which, at), params.share(0))])

    def narrow(layer: int, k: torch.Tensor) -> torch.Tensor:
        """Gradual filtering: of the kept rows (indices into them), the fixed ones and the
        loaded ones whose cached K at layer is farthest from the fresh K, down to the layer's
        share of all loaded rows."""
        conn.wait_for_layer_load(layer)
        rows = torch.nonzero(cand[st.rows.cpu()]).flatten()
        m = count(params.share(layer - first + 1), report.loaded)
        keep = fixed[st.rows.cpu()]
        if m and rows.numel():
            at = st.slots[rows.to(st.slots.device)]
            top = blend_rules.select(k[rows], read(runner, layer, 0, at), m / rows.numel())
            keep[rows[top]] = True
        return torch.nonzero(keep).flatten()

    def subset(i: int, h: torch.Tensor) -> Work:
        """Layer i over the kept rows st (h: theirs), in row chunks of at most pace.allow."""
        nonlocal st
        whole, m, a, out = st, st.rows.numel(), 0, h
        while a < m:
            b = min(m, a + max(1, pace.allow))
            if (a, b) != (0, m):
                st, out = kept(whole.rows[a:b]), h.clone() if out is h else out
                out[a:b] = model.layers[i](i, h[a:b], st.pos, subset_attend)
            else:
                out = model.layers[i](i, h, st.pos, subset_attend)
            st = whole
            pace.left -= b - a
            yield b - a
            a = b
        return out

    def finish(c: int, h: torch.Tensor, q: torch.Tensor) -> Work:
        """The check layer c's attention and MLP for the kept rows st (h and q: every row's),
        their K/V and every other row's written, in row chunks of at most pace.allow."""
        nonlocal st
        whole, m, a, parts = st, st.rows.numel(), 0, []
        while a < m:
            b = min(m, a + max(1, pace.allow))
            st = whole if (a, b) == (0, m) else kept(whole.rows[a:b])
            sel = st.rows.to(h.device)
            parts.append(model.layers[c].finish(h[sel], attention(c, q[sel], written)))
            st = whole
            pace.left -= b - a
            yield b - a
            a = b
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    st, written, late = kept(torch.nonzero(fixed).flatten()), fixed, torch.zeros(0)
    gradual = params.gradual if rule.rank == "cacheblend" and params.metric != "random" else 0
    pace.left = n * layers
    if rule.rank == "query_late" and 0.0 < params.ratio < 1.0:
        late = late_mass()
        yield int((~cand).sum() + 1) * params.layer_of_query(layers)
    if rule.rank is None or params.ratio == 0.0:  # only the fixed rows, from layer 0
        st, written, first, gradual = kept(torch.nonzero(fixed).flatten()), fixed, 0, 0
        h = model.embed_tokens(ctx.input_ids[st.rows])
    else:
        h = model.embed_tokens(ctx.input_ids)
        c = min(params.check_layer, layers - 1)
        for i in range(c):
            h = yield from rows_layer(runner, ctx, i, h, pace)
        # The check layer: fresh K/V of every row (they are exact: every layer before ran in
        # full), but attention and MLP only for the kept rows, the only ones read later on.
        layer = model.layers[c]
        q, k, v = yield from qkv_rows(layer, h, ctx.positions, pace)
        keep = fixed | rank(c, q, k, v)
        report.full_layers, first = c, c + 1
        if keep.all():  # everything kept: the rest is an ordinary prefill
            report.recomputed = report.loaded
            pace.left = n * (layers - c)
            if pace.allow >= n:
                h = layer.finish(h, runner.attend(c, q, k, v))
                pace.left -= n
                yield n
            else:
                runner.store(c, k, v)
                st, written = kept(torch.arange(n)), torch.ones(n, dtype=torch.bool)
                h = torch.cat([(yield from finish(c, h, q)), h[n:]])  # ctx's padding rows kept
            for i in range(first, layers):
                h = yield from rows_layer(runner, ctx, i, h, pace)
            return h
        runner.store(c, k, v)
        st, written = kept(torch.nonzero(keep).flatten()), torch.ones(n, dtype=torch.bool)
        pace.left = st.rows.numel() * (layers - c)
        h = yield from finish(c, h, q)
        written = keep
    for i in range(first, layers):
        pace.left = st.rows.numel() * (layers - i)
        if i - first >= gradual:
            h = yield from subset(i, h)
            continue
        # Gradual filtering: fresh K/V of every kept row (written), then attention and MLP
        # only for the rows that stay.
        layer = model.layers[i]
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), st.pos)
        sub = narrow(i, k)
        conn.wait_for_layer_load(i)
        runner.ops.write_kv(k, v, runner.layer_caches[i], st.slots)
        wrote = mask(st.rows)
        rows = st.rows.numel()
        st = kept(st.rows[sub.to(st.rows.device)])
        sub = sub.to(h.device)
        h = layer.finish(h[sub], attention(i, q[sub], wrote))
        written = mask(st.rows)
        yield rows
    pace.left = 0
    report.recomputed = int(cand[st.rows.cpu()].sum())
    ctx.logits_indices = torch.tensor([h.shape[0] - 1], device=h.device)
    ctx.num_sampled = 1
    return h
