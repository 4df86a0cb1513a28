"""Sequence: the token state of one generation (one of a request's n samples)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from tierkv.engine.blend_step import BlendState
from tierkv.engine.radix import Node
from tierkv.engine.sampling_params import SamplingParams
from tierkv.storage_backends.hints import KVHint

if TYPE_CHECKING:
    from tierkv.engine.layering import Layering


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True)
class SeqMetrics:
    arrival_time: float = 0.0
    first_token_time: float = 0.0
    finish_time: float = 0.0
    num_cached_tokens: int = 0  # hit in the local prefix cache (at first admission)
    num_external_tokens: int = 0  # loaded through the connector
    num_computed_tokens: int = 0  # run through the model, recomputation included
    num_preemptions: int = 0
    # a prompt in parts: the rule it blended with ("cacheblend@0.15"), or "uncalibrated" (it
    # ran as a plain prompt: prefix reuse); "" for a plain prompt
    blend_rule: str = ""
    connector: dict = field(
        default_factory=dict
    )  # what the connector reports (tokens per tier, ...)


@dataclass(slots=True, eq=False)
class Sequence:
    """Invariants: prompt = token_ids[:num_prompt_tokens]; the KV of token_ids[:num_computed_tokens]
    is in the blocks of block_table (block i holds tokens [i*bs, (i+1)*bs))."""

    seq_id: int  # arrival order; newer sequences have larger ids
    request_id: str  # unique per sequence ("7", or "7/1" for the second of n samples)
    group: str  # the request id of the request it is a sample of
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    lock: Node | None = None  # the radix node this sequence holds locked (prefix cache)
    num_indexed_blocks: int = 0  # leading blocks already offered to the prefix cache
    finish_reason: str | None = None
    sample_index: int = 0  # which of the request's n samples
    admitted: bool = False
    metrics: SeqMetrics = field(default_factory=SeqMetrics)
    blend: BlendState | None = None  # a prompt in parts (any-position reuse); None: plain
    kv_hint: KVHint | None = None  # the workflow step it runs for (advice to the caches)
    layering: Layering | None = None  # its layered prefill, while in flight (engine/layered.py)
    # With params.logprobs: per output token, (its logprob, [(token, logprob)] of the top ones).
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def exact_kv(self) -> bool:
        """Whether its blocks hold exactly the KV of its tokens (not blended): only then are
        they indexed in the prefix cache or stored."""
        return self.blend is None or self.blend.exact_kv

    @property
    def cache_salt(self) -> str | None:
        return self.params.cache_salt
