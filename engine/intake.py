"""Intake: a client's prompt turned into token ids and its request's sequences (one per sample),
each with its own seeded generator."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from tierkv.engine.blend import BlendParams, PromptPart, join_parts
from tierkv.engine.blend_rules import parse_rule
from tierkv.engine.config import EngineConfig
from tierkv.engine.outputs import Request
from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.sequence import Sequence

# One prompt: text, token ids, or PromptParts (a CacheBlend prompt in parts).
Prompt = str | list[int] | list[PromptPart]
Span = tuple[int, int, bool]  # a part's tokens [start, end) and whether it is reusable


def prompt_tokens(
    prompt: Prompt, encode: Callable[[str], list[int]], vocab: int
) -> tuple[list[int], list[Span] | None, int]:
    """(token ids, the parts' spans or None for a plain prompt, the declared prefix's tokens).
    A bad prompt raises ValueError."""
    spans, prefix_len = None, 0
    if isinstance(prompt, str):
        prompt = encode(prompt)
    elif prompt and all(isinstance(s, PromptPart) for s in prompt):
        prompt, spans, prefix_len = join_parts(cast("list[PromptPart]", prompt), encode)
    if not prompt or any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt must be a non-empty list of token ids in [0, {vocab})")
    return cast("list[int]", prompt), spans, prefix_len  # every element checked just above


def new_seq(req: Request, index: int, seq_id: int, rng: torch.Generator) -> Sequence:
    """Sample `index` of req, as sequence seq_id (its arrival order)."""
    params = req.params
    seed = (
        params.seed + index
        if params.seed is not None
        else int(torch.randint(1 << 62, (1,), generator=rng))
    )
    seq = Sequence(
        seq_id,
        req.request_id if index == 0 else f"{req.request_id}/{index}",
        req.request_id,
        list(req.prompt_token_ids),
        len(req.prompt_token_ids),
        params,
        torch.Generator().manual_seed(seed),
        sample_index=index,
    )
    req.seqs.append(seq)
    return seq


def blend_params(c: EngineConfig, params: SamplingParams) -> BlendParams:
    """The engine's blend knobs, with the request's overrides (rule, ratio, check layer)."""
    ratio = c.blend_ratio if params.blend_ratio is None else params.blend_ratio
    layer = c.blend_check_layer if params.blend_check_layer is None else params.blend_check_layer
    rule = c.blend_rule if params.blend_rule is None else params.blend_rule
    return BlendParams(
        ratio,
        layer,
        c.blend_metric,
        c.blend_gradual,
        parse_rule(rule, "blend_rule"),
        c.blend_sink_tokens,
        c.blend_query_layer,
        c.blend_query_smooth,
        c.blend_ape_temperature,
        c.blend_ape_scale,
    )
