"""The state and the steps of one blend prefill, which blend_forward.py drives: the rows each
layer runs (Kept) and their attention over every key of the prompt, the check layer's ranking,
query_late's question-only pass, gradual filtering, and the layers run in row chunks."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

import torch

from tierkv.engine import blend_rules
from tierkv.engine.blend import BlendParams, BlendReport
from tierkv.engine.blend_ape import ape_attention, attention_mass, read, seq_kv
from tierkv.engine.blend_rules import count, question_rows, top_attended
from tierkv.engine.tiles import Pace, Work
from tierkv.kernels import AttentionMeta

if TYPE_CHECKING:
    from tierkv.engine.context import Context
    from tierkv.engine.model import DecoderLayer
    from tierkv.engine.model_runner import ModelRunner


@dataclass(slots=True)
class Kept:
    """The rows a layer runs, with their positions, cache slots and attention metadata (every
    key of the prompt), indexed once for every layer that runs them."""

    rows: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    meta: AttentionMeta


@dataclass(slots=True)
class BlendPass:
    """One blend prefill of the step's only sequence, whose rows are its tokens from start on."""

    runner: ModelRunner
    ctx: Context
    params: BlendParams
    report: BlendReport
    pace: Pace
    start: int
    cand: torch.Tensor  # the loaded rows: cached KV in the blocks
    fixed: torch.Tensor  # the rows that run through every layer
    # The kept rows see the stale loaded rows through APE (rule.ape; off in query_late's pass).
    ape: bool
    st: Kept = field(init=False)  # the rows the current layer runs
    written: torch.Tensor = field(init=False)  # the rows whose fresh KV the current layer wrote
    late: torch.Tensor = field(init=False)  # query_late: the question's attention per row
    first: int = 0  # the first layer after the check layer: gradual filtering counts from it

    def __post_init__(self) -> None:
        self.st, self.written = self.kept(torch.nonzero(self.fixed).flatten()), self.fixed
        self.late = torch.zeros(0)

    @property
    def n(self) -> int:
        return self.ctx.num_tokens

    def layer(self, i: int) -> DecoderLayer:
        return cast("DecoderLayer", self.runner.model.layers[i])

    def kept(self, rows: torch.Tensor) -> Kept:
        ctx = self.ctx
        pos = ctx.positions[rows]
        cu = torch.tensor([0, rows.numel()], dtype=torch.int32, device=pos.device)
        meta = replace(
            ctx.all.meta, cu_seqlens_q=cu, q_positions=pos.to(torch.int32), max_seqlen_q=len(rows)
        )
        return Kept(rows, pos, ctx.slot_mapping[rows], meta)

    def attention(self, layer: int, q: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
        """The kept rows' queries q over every key of the prompt; written: the rows whose fresh
        KV this layer wrote (with ape, the other loaded rows are the cached context block)."""
        runner, stale = self.runner, self.cand & ~written
        if self.ape and stale.any():
            k, v = seq_kv(runner, self.ctx, layer, self.start + self.n)
            block = torch.cat([torch.zeros(self.start, dtype=torch.bool), stale]).to(k.device)
            t, s = self.params.ape_temperature, self.params.ape_scale
            return ape_attention(q, self.st.pos, k, v, block, runner.scale, t, s)
        return runner.ops.attention(q, runner.layer_caches[layer], self.st.meta, runner.scale)

    def mask(self, rows: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(self.n, dtype=torch.bool)
        m[rows.cpu()] = True
        return m

    def subset_attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.runner.connector.wait_for_layer_load(layer)
        self.runner.ops.write_kv(k, v, self.runner.layer_caches[layer], self.st.slots)
        return self.attention(layer, q, self.written)

    def question_mass(self, layer: int, q: torch.Tensor, qrows: torch.Tensor) -> torch.Tensor:
        """Per row, the attention the question's queries (q of rows qrows) give it at layer."""
        ctx, total = self.ctx, self.start + self.n
        k, _ = seq_kv(self.runner, ctx, layer, total)
        pos = ctx.positions[qrows.to(ctx.positions.device)]
        return attention_mass(q, pos, k, self.runner.scale)[self.start : total]

    def late_mass(self) -> torch.Tensor:
        """query_late: the rows not loaded run alone over the cached KV up to the query layer
        (their KV is rewritten by the prefill after); the question's attention there. Plain
        attention: APE applies to the prefill only."""
        runner, ctx, model = self.runner, self.ctx, self.runner.model
        self.ape = False
        ql = self.params.layer_of_query(len(model.layers))
        pre = ~self.cand
        pre[self.n - 1] = True
        self.st = self.kept(torch.nonzero(pre).flatten())
        self.written = self.mask(self.st.rows)
        h = model.embed_tokens(ctx.input_ids[self.st.rows])
        for i in range(ql):
            h = model.layers[i](i, h, self.st.pos, self.subset_attend)
        layer = self.layer(ql)
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), self.st.pos)
        runner.connector.wait_for_layer_load(ql)
        runner.ops.write_kv(k, v, runner.layer_caches[ql], self.st.slots)
        qrows = question_rows(self.cand)
        sel, self.ape = torch.searchsorted(self.st.rows.cpu(), qrows), self.params.rule.ape
        return self.question_mass(ql, q[sel.to(q.device)], qrows)

    def rank(self, c: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Mask of the loaded rows the ranking rule picks at the check layer c (cacheblend
        reads the cache before it is written; the query rules after)."""
        runner, ctx, params, cand, n = self.runner, self.ctx, self.params, self.cand, self.n
        runner.connector.wait_for_layer_load(c)
        rows = torch.nonzero(cand).flatten()
        if params.ratio == 1.0:  # every loaded row, whatever the ranking
            return cand.clone()
        if params.rule.rank == "query_late":
            return top_attended(self.late, cand, params.ratio, params.smooth)
        if params.rule.rank == "query_early":  # fresh K/V first (runner.store saves it after)
            runner.ops.write_kv(k, v, runner.layer_caches[c], ctx.slot_mapping)
            qrows = question_rows(cand)
            mass = self.question_mass(c, q[qrows.to(q.device)], qrows)
            return top_attended(mass, cand, params.ratio, params.smooth)
        if params.metric == "random":
            return self.mask(blend_rules.random_rows(rows, params.share(0)))
        which = 0 if params.metric == "k" else 1
        at = ctx.slot_mapping[:n][cand]
        fresh = (k if which == 0 else v)[:n][cand]
        picked = blend_rules.select(fresh, read(runner, c, which, at), params.share(0))
        return self.mask(rows[picked])

    def narrow(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Gradual filtering: of the kept rows (indices into them), the fixed ones and the
        loaded ones whose cached K at layer is farthest from the fresh K, down to the layer's
        share of all loaded rows."""
        st = self.st
        self.runner.connector.wait_for_layer_load(layer)
        rows = torch.nonzero(self.cand[st.rows.cpu()]).flatten()
        m = count(self.params.share(layer - self.first + 1), self.report.loaded)
        keep = self.fixed[st.rows.cpu()]
        if m and rows.numel():
            at = st.slots[rows.to(st.slots.device)]
            top = blend_rules.select(k[rows], read(self.runner, layer, 0, at), m / rows.numel())
            keep[rows[top]] = True
        return torch.nonzero(keep).flatten()

    def filtered(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A gradual filtering layer i: fresh K/V of every kept row (written), then attention
        and MLP only for the rows that stay (narrow) -> their hidden states, the rows it ran."""
        runner, layer = self.runner, self.layer(i)
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), self.st.pos)
        sub = self.narrow(i, k)
        runner.connector.wait_for_layer_load(i)
        runner.ops.write_kv(k, v, runner.layer_caches[i], self.st.slots)
        wrote = self.mask(self.st.rows)
        rows = self.st.rows.numel()
        self.st = self.kept(self.st.rows[sub.to(self.st.rows.device)])
        sub = sub.to(h.device)
        h = layer.finish(h[sub], self.attention(i, q[sub], wrote))
        self.written = self.mask(self.st.rows)
        return h, rows

    def subset(self, i: int, h: torch.Tensor) -> Work:
        """Layer i over the kept rows st (h: theirs), in row chunks of at most pace.allow."""
        layer, pace = self.layer(i), self.pace
        whole, m, a, out = self.st, self.st.rows.numel(), 0, h
        while a < m:
            b = min(m, a + max(1, pace.allow))
            if (a, b) != (0, m):
                self.st, out = self.kept(whole.rows[a:b]), h.clone() if out is h else out
                out[a:b] = layer(i, h[a:b], self.st.pos, self.subset_attend)
            else:
                out = layer(i, h, self.st.pos, self.subset_attend)
            self.st = whole
            pace.left -= b - a
            yield b - a
            a = b
        return out

    def finish(self, c: int, h: torch.Tensor, q: torch.Tensor) -> Work:
        """The check layer c's attention and MLP for the kept rows st (h and q: every row's),
        their K/V and every other row's written, in row chunks of at most pace.allow."""
        layer, pace = self.layer(c), self.pace
        whole, m, a, parts = self.st, self.st.rows.numel(), 0, []
        while a < m:
            b = min(m, a + max(1, pace.allow))
            self.st = whole if (a, b) == (0, m) else self.kept(whole.rows[a:b])
            sel = self.st.rows.to(h.device)
            parts.append(layer.finish(h[sel], self.attention(c, q[sel], self.written)))
            self.st = whole
            pace.left -= b - a
            yield b - a
            a = b
        return parts[0] if len(parts) == 1 else torch.cat(parts)
