"""Any-position reuse (CacheBlend): prompts as parts, a blend prefill's parameters and its
report. Which loaded rows a blend prefill recomputes is its rule (blend_rules.py); the forward
is blend_forward.py, APE's attention blend_ape.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierkv.engine.blend_rules import Rule, parse_rule


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
    """One blend prefill's knobs (EngineConfig documents each; SamplingParams overrides rule,
    ratio and check layer)."""

    ratio: float  # share of loaded tokens a ranking rule recomputes; 1.0: full prefill, any rule
    check_layer: int  # layers before it run in full; ranking rules pick the rows there
    # cacheblend's ranking: "k" or "v" fresh-vs-cached distance, or "random": a seeded random
    # choice, the baseline a ranking must beat (benchmarks)
    metric: str = "k"
    gradual: int = 0  # cacheblend: layers after check_layer over which the share narrows from 2x
    rule: Rule = field(default_factory=lambda: parse_rule("cacheblend"))
    sinks: int = 16  # legolink: first tokens of each loaded segment recomputed
    query_layer: int | None = None  # query_late: the question's ranking layer; None: 3/4 depth
    smooth: int = 2  # query rules: a row's score sums its attention and its w neighbours' each side
    ape_temperature: float = 0.9  # ape: T on the cached-context block's logits
    ape_scale: float = 0.9  # ape: S, the context block's log-mass is T*S*LSE(s/T)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"blend_ratio must be in [0, 1], got {self.ratio}")
        if self.check_layer < 0:
            raise ValueError(f"blend_check_layer must be >= 0, got {self.check_layer}")
        if self.metric not in ("k", "v", "random"):
            raise ValueError(f"blend_metric must be 'k', 'v' or 'random', got {self.metric!r}")
        if self.gradual < 0:
            raise ValueError(f"blend_gradual must be >= 0, got {self.gradual}")
        check_knobs(self.sinks, self.query_layer, self.smooth, self.ape_temperature, self.ape_scale)

    def share(self, step: int) -> float:
        """The share of loaded rows picked at check_layer + step: ratio without gradual
        filtering; with it, 2x ratio at the check layer narrowing linearly to ratio."""
        if not self.gradual:
            return self.ratio
        return min(1.0, self.ratio * (2.0 - min(step, self.gradual) / self.gradual))

    def layer_of_query(self, layers: int) -> int:
        """query_late's ranking layer in a model of `layers` layers."""
        q = round(0.75 * layers) if self.query_layer is None else self.query_layer
        return min(q, layers - 1)


def check_knobs(
    sinks: int, query_layer: int | None, smooth: int, temperature: float, scale: float
) -> None:
    """The rules' knobs (EngineConfig's and BlendParams' checks): ValueError naming the field."""
    if sinks < 0:
        raise ValueError(f"blend_sink_tokens must be >= 0, got {sinks}")
    if query_layer is not None and query_layer < 0:
        raise ValueError(f"blend_query_layer must be >= 0 or None, got {query_layer}")
    if smooth < 0:
        raise ValueError(f"blend_query_smooth must be >= 0, got {smooth}")
    if not temperature > 0.0:
        raise ValueError(f"blend_ape_temperature must be > 0, got {temperature}")
    if not scale > 0.0:
        raise ValueError(f"blend_ape_scale must be > 0, got {scale}")


@dataclass(slots=True)
class BlendReport:
    """What a blend prefill did (copied into the request's metrics)."""

    loaded: int = 0  # context tokens whose cached KV was used
    recomputed: int = 0  # of those, run through the last layer (ranked, sinks, a loaded last)
    computed: int = 0  # tokens run through every layer (question, missed segments)
    full_layers: int = 0  # layers run in full on every token (the check layer's K/V excluded)

    def as_dict(self) -> dict:
        return {
            "loaded": self.loaded,
            "recomputed": self.recomputed,
            "computed": self.computed,
            "full_layers": self.full_layers,
        }


def rows_of(ranges: list[tuple[int, int]], n: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    for a, b in ranges:
        mask[max(a, 0) : min(b, n)] = True
    return mask
