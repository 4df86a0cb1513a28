"""Any-position reuse (CacheBlend): prompts as segments, and the selective-recompute prefill.

A blend prefill is one step holding one sequence, its whole prompt after any cached prefix
(a declared shared prefix found in the prefix cache or loaded exactly), whatever the per-step
token budget. The connector has scattered each reusable segment's cached KV into the
sequence's blocks, re-rotated to its position here. Then:
- layers 0..check_layer-1 run in full on every token (fresh KV overwrites the cached KV);
- at check_layer every token's fresh K/V is computed and, before it is written, each loaded
  context token is ranked by the squared L2 distance between its fresh and cached K (or V);
  the top `ratio` of them are kept, with every token that was not loaded (the question,
  missed segments); the fresh K/V of all rows is written, and the layer's attention and MLP
  run for the kept rows only (nothing later reads the others' hidden states);
- layers after check_layer run only the kept rows, whose queries attend over all keys (the
  cached KV of the dropped rows, the fresh KV of the kept ones) and whose KV replaces the cache.
ratio 1.0 keeps every row (exactly a full prefill); ratio 0.0 drops the loaded rows before
layer 0 (exactly the concatenation of the re-rotated cached KV, nothing recomputed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace

import torch

from tierkv.kernels import paged_attention, write_kv


@dataclass(slots=True)
class PromptPart:
    """One part of a prompt given in parts, `[system, doc_a, doc_b, question]`. A reusable part
    (a RAG document, a tool result) has its KV computed once, stored under its position-free
    segment key and reused at any position; a non-reusable one (the question) is always
    computed. prefix=True declares the first part the shared prefix (a system prompt): it is
    reused exactly, as a prefix, and the reusable parts after it have their KV computed right
    after it (attending to it) and keyed under it, not standalone."""

    content: str | list[int]
    reusable: bool = True
    prefix: bool = False

    def __post_init__(self) -> None:
        if self.prefix and not self.reusable:
            raise ValueError(
                "a shared prefix part is reused as a prefix: it cannot be reusable=False"
            )


def join_parts(
    prompt: list[PromptPart], encode: Callable[[str], list[int]]
) -> tuple[list[int], list[tuple[int, int, bool]], int]:
    """A prompt in parts as its tokens, the (start, end, reusable) span of each part (the
    shared prefix's is not reusable: it is reused as a prefix) and the shared prefix's length."""
    tokens: list[int] = []
    spans: list[tuple[int, int, bool]] = []
    for i, s in enumerate(prompt):
        if s.prefix and i:
            raise ValueError(
                f"only the first part can be the shared prefix; part {i} has prefix=True"
            )
        ids = encode(s.content) if isinstance(s.content, str) else list(s.content)
        if not ids:
            raise ValueError("a prompt part must hold at least one token")
        spans.append((len(tokens), len(tokens) + len(ids), s.reusable and not s.prefix))
        tokens += ids
    return tokens, spans, spans[0][1] if prompt[0].prefix else 0


@dataclass(slots=True)
class BlendParams:
    ratio: float  # share of loaded context tokens recomputed after the check layer
    check_layer: int  # layers before it run in full; deviation is measured at its fresh KV
    # "k" or "v": which fresh-vs-cached distance ranks the tokens; "random": a seeded random
    # choice, the baseline a ranking must beat (benchmarks)
    metric: str = "k"
    gradual: int = 0  # layers after check_layer over which the picked share narrows from 2x

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"blend_ratio must be in [0, 1], got {self.ratio}")
        if self.check_layer < 0:
            raise ValueError(f"blend_check_layer must be >= 0, got {self.check_layer}")
        if self.metric not in ("k", "v", "random"):
            raise ValueError(f"blend_metric must be 'k', 'v' or 'random', got {self.metric!r}")
        if self.gradual < 0:
            raise ValueError(f"blend_gradual must be >= 0, got {self.gradual}")

    def share(self, step: int) -> float:
        """The share of loaded rows picked at check_layer + step: ratio without gradual
        filtering; with it, 2x ratio at the check layer narrowing linearly to ratio."""
        if not self.gradual:
            return self.ratio
        return min(1.0, self.ratio * (2.0 - min(step, self.gradual) / self.gradual))


@dataclass(slots=True)
class BlendReport:
    """What a blend prefill did (copied into the request's metrics)."""

    loaded: int = 0  # context tokens whose cached KV was used
    recomputed: int = 0  # of those, recomputed after the check layer
    computed: int = 0  # tokens run through every layer (question, missed segments)
    full_layers: int = 0  # layers run in full on every token (the check layer's K/V excluded)

    def as_dict(self) -> dict:
        return {
            "loaded": self.loaded,
            "recomputed": self.recomputed,
            "computed": self.computed,
            "full_layers": self.full_layers,
        }


def select(fresh: torch.Tensor, cached: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices (ascending) of the ceil(ratio * N) rows of fresh/cached [N, H, D] that differ
    most."""
    n = fresh.shape[0]
    m = min(n, math.ceil(ratio * n - 1e-9))
    if m == 0:
        return torch.zeros(0, dtype=torch.long, device=fresh.device)
    dev = (fresh.float() - cached.float()).pow(2).sum(dim=(1, 2))
    return torch.topk(dev, m, sorted=False).indices.sort().values


def random_rows(rows: torch.Tensor, ratio: float) -> torch.Tensor:
    """A seeded random ceil(ratio * N) of rows, ascending: the same prompt picks the same."""
    m = min(rows.numel(), math.ceil(ratio * rows.numel() - 1e-9))
    g = torch.Generator().manual_seed(rows.numel())
    return rows[torch.randperm(rows.numel(), generator=g)[:m].sort().values]


def rows_of(ranges: list[tuple[int, int]], n: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    for a, b in ranges:
        mask[a : min(b, n)] = True
    return mask


def blend_forward(
    runner, ctx, params: BlendParams, loaded: list[tuple[int, int]], start: int, report: BlendReport
) -> torch.Tensor:
    """blend_layers run through in one go."""
    return drive(blend_layers(runner, ctx, params, loaded, start, report))


def drive(layers: Generator[None, None, torch.Tensor]) -> torch.Tensor:
    """Run a layer generator to its end; its result."""
    while True:
        try:
            next(layers)
        except StopIteration as done:
            return done.value


def blend_layers(
    runner, ctx, params: BlendParams, loaded: list[tuple[int, int]], start: int, report: BlendReport
) -> Generator[None, None, torch.Tensor]:
    """The blend prefill of the step's only sequence, whose rows are its tokens from start on;
    returns the hidden states of the rows that reach the last layer and points
    ctx.logits_indices at the last prompt token. It yields after each of the model's layers
    (a layered prefill runs a group of them per step)."""
    model, conn, n = runner.model, runner.connector, ctx.num_tokens
    cand = rows_of(
        [(a - start, b - start) for a, b in loaded], n
    )  # rows whose cached KV is in the blocks
    report.loaded, report.computed = int(cand.sum()), int((~cand).sum())
    if not cand.any():  # nothing loaded: an ordinary prefill
        h = model.embed_tokens(ctx.input_ids)
        for i, layer in enumerate(model.layers):
            h = layer(i, h, ctx.positions, runner.attend)
            yield
        return h
    kv_dtype = runner.kv_caches[0].dtype

    def kept(rows: torch.Tensor):
        """rows (those that reach the last layer) with their positions, cache slots and
        attention metadata (every key of the prompt), indexed once for every layer that runs
        them."""
        pos = ctx.positions[rows]
        cu = torch.tensor([0, rows.numel()], dtype=torch.int32, device=rows.device)
        meta = replace(
            ctx.all.meta,
            cu_seqlens_q=cu,
            q_positions=pos.to(torch.int32),
            max_seqlen_q=rows.numel(),
        )
        return rows, pos, ctx.slot_mapping[rows], meta

    keep, pos, slots, meta = kept(torch.nonzero(~cand).flatten())

    def attention(layer: int, q: torch.Tensor) -> torch.Tensor:
        """The kept rows' queries q over the paged cache (every key of the prompt)."""
        return paged_attention(q, runner.layer_caches[layer], meta, runner.scale)

    def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(k, v, runner.layer_caches[layer], slots)

    def subset_attend(
        layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        conn.wait_for_layer_load(layer)
        write(layer, k, v)
        return attention(layer, q)

    def cached(layer: int, which: int, at: torch.Tensor) -> torch.Tensor:
        """The cached K (which=0) or V of cache slots `at`, before this step writes them."""
        cache = runner.kv_caches[layer]
        flat = cache[which].view(-1, *cache.shape[3:])
        if kv_dtype.itemsize == 1:  # fp8: index its bytes, compare in real units
            x = flat.view(torch.uint8).index_select(0, at).view(kv_dtype).float()
            return x * runner.kv_scales[layer, which].view(-1, 1)
        return flat.index_select(0, at)

    def rank(layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The rows kept from layer on: the loaded rows whose cached K (or V) is farthest from
        the fresh one, and every row that was not loaded. Reads the cache before it is written."""
        conn.wait_for_layer_load(layer)
        rows = torch.nonzero(cand).flatten()
        if params.metric == "random":
            picked = random_rows(rows, params.share(0))
        else:
            which = 0 if params.metric == "k" else 1
            fresh = (k if which == 0 else v)[:n][cand]
            picked = rows[
                select(fresh, cached(layer, which, ctx.slot_mapping[:n][cand]), params.share(0))
            ]
        mask = ~cand
        mask[picked] = True
        report.recomputed = int(picked.numel())
        return torch.nonzero(mask).flatten()

    def narrow(layer: int, k: torch.Tensor) -> torch.Tensor:
        """Gradual filtering: of the kept rows (indices into them), every one not loaded and
        the loaded ones whose cached K at layer is farthest from the fresh K, down to the
        layer's share of all loaded rows."""
        conn.wait_for_layer_load(layer)
        loaded = cand[keep]
        rows = torch.nonzero(loaded).flatten()
        m = min(rows.numel(), math.ceil(params.share(layer - first + 1) * report.loaded - 1e-9))
        mask = ~loaded
        if m:
            top = select(k[rows], cached(layer, 0, slots[rows]), m / rows.numel())
            mask[rows[top]] = True
        return torch.nonzero(mask).flatten()

    if params.ratio == 0.0:  # plain concatenation of the cached KV: only the rest is computed
        h, first = model.embed_tokens(ctx.input_ids[keep]), 0
    else:
        h = model.embed_tokens(ctx.input_ids)
        c = min(params.check_layer, len(model.layers) - 1)
        for i in range(c):
            h = model.layers[i](i, h, ctx.positions, runner.attend)
            yield
        # The check layer: fresh K/V of every row (they are exact: every layer before ran in
        # full), but attention and MLP only for the kept rows, the only ones read later on.
        layer = model.layers[c]
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), ctx.positions)
        keep, pos, slots, meta = kept(rank(c, k, v))
        report.full_layers, first = c, c + 1
        if keep.numel() == n:  # everything kept: the rest is an ordinary prefill
            h = layer.finish(h, runner.attend(c, q, k, v))
            yield
            for i in range(first, len(model.layers)):
                h = model.layers[i](i, h, ctx.positions, runner.attend)
                yield
            return h
        runner.store(c, k, v)
        h = layer.finish(h[keep], attention(c, q[keep]))
        yield
    for i in range(first, len(model.layers)):
        if params.metric == "random" or params.ratio == 0.0 or i - first >= params.gradual:
            h = model.layers[i](i, h, pos, subset_attend)
            yield
            continue
        # Gradual filtering: fresh K/V of every kept row (written), then attention and MLP
        # only for the rows that stay.
        layer = model.layers[i]
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), pos)
        sub = narrow(i, k)
        write(i, k, v)
        keep, pos, slots, meta = kept(keep[sub])
        report.recomputed = int(cand[keep].sum())
        h = layer.finish(h[sub], attention(i, q[sub]))
        yield
    ctx.logits_indices = torch.tensor([h.shape[0] - 1], device=h.device)
    ctx.num_sampled = 1
    return h
