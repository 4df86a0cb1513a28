"""Per-request sampling settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.engine.blend_rules import parse_rule


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 1.0  # softmax temperature; 0 = greedy
    top_k: int = 0  # sample among the k most likely tokens; 0 = no limit
    top_p: float = 1.0  # sample within the smallest set of this total probability; 1.0 = all
    max_tokens: int = 16  # most tokens generated
    seed: int | None = None  # per-request generator; None draws from the engine's seeded stream
    stop_token_ids: list[int] = field(default_factory=list)  # also end at any of these tokens
    ignore_eos: bool = False  # generate past the model's end-of-sequence tokens
    n: int = 1  # parallel samples sharing the prompt's KV blocks (copy-on-write)
    blend_ratio: float | None = (
        None  # segment prompts: share of reused tokens recomputed (None: engine's)
    )
    blend_check_layer: int | None = (
        None  # segment prompts: the layer whose deviation ranks rows (None: engine's)
    )
    # segment prompts: which loaded rows are recomputed, rule names joined by "+" (EngineConfig
    # .blend_rule, docs/cacheblend.md); None: the engine's
    blend_rule: str | None = None
    logprobs: int | None = None  # also record each sampled token's logprob and this many top ones
    # Tenant isolation: KV is shared (prefix cache, connector keys) only between requests with
    # the same salt; None shares with every unsalted request.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.blend_rule is not None:
            parse_rule(self.blend_rule, "blend_rule")
        if self.blend_check_layer is not None and self.blend_check_layer < 0:
            raise ValueError(f"blend_check_layer must be >= 0, got {self.blend_check_layer}")
        if self.blend_ratio is not None and not 0.0 <= self.blend_ratio <= 1.0:
            raise ValueError(f"blend_ratio must be in [0, 1], got {self.blend_ratio}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
