"""What the engine reports: a live Request while it runs, its RequestOutput once read, and
the engine's own step counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.sequence import Sequence
from tierkv.engine.tokenizer import Tokenizer


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    tokens: int = 0  # computed through the model
    kv_slots: int = 0  # allocated KV slots, summed over steps
    kv_slots_empty: int = 0  # of those, slots holding no token

    def add(self, tokens: int, kv_slots: int, kv_slots_empty: int) -> None:
        """One step: its computed tokens and its KV slots (allocated, holding no token)."""
        self.steps += 1
        self.tokens += tokens
        self.kv_slots += kv_slots
        self.kv_slots_empty += kv_slots_empty

    @property
    def kv_unused_share(self) -> float:
        return self.kv_slots_empty / self.kv_slots if self.kv_slots else 0.0


@dataclass(slots=True)
class RequestMetrics:
    ttft: float  # seconds from arrival to the first token
    decode_time: float  # seconds from the first token to the last
    prompt_tokens: int
    cached_tokens: int  # hit in the local prefix cache
    external_tokens: int  # loaded through the connector
    computed_tokens: int  # run through the model (prefill, decode and any recompute)
    preemptions: int
    connector: dict[str, Any] = field(
        default_factory=dict
    )  # the connector's own report (per tier, ...)
    blend: dict[str, Any] = field(
        default_factory=dict
    )  # a blend prefill's report (loaded, recomputed, ...)
    blend_rule: str = ""  # a prompt in parts: "cacheblend@0.15", or "uncalibrated" (no blend)


@dataclass(slots=True)
class Completion:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: RequestMetrics


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]  # one per sample (SamplingParams.n)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics


@dataclass(slots=True, eq=False)
class Request:
    """A request in the engine, updated by every step: its samples, each a Sequence (output_ids,
    logprobs, finish_reason, metrics). The n > 1 samples join when the first one samples its
    first token."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)

    def output(self, tokenizer: Tokenizer | None) -> RequestOutput:
        """Its outputs so far, the text decoded by tokenizer (None: no text)."""
        outs = []
        for s in sorted(self.seqs, key=lambda s: s.sample_index):
            m, blend = s.metrics, s.blend
            report = blend.report.as_dict() if blend is not None and blend.report else {}
            text = tokenizer.decode(s.output_ids) if tokenizer is not None else None
            metrics = RequestMetrics(
                m.first_token_time - m.arrival_time,
                m.finish_time - m.first_token_time,
                s.num_prompt_tokens,
                m.num_cached_tokens,
                m.num_external_tokens,
                m.num_computed_tokens,
                m.num_preemptions,
                m.connector,
                report,
                m.blend_rule,
            )
            outs.append(Completion(s.output_ids, text, s.finish_reason or "length", metrics))
        return RequestOutput(self.request_id, list(self.prompt_token_ids), outs)


def token_logprobs(row: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's (unscaled) log-probability of token, and its k most likely tokens."""
    lp = row.float().log_softmax(-1)
    top = lp.topk(k) if k else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return float(lp[token]), pairs
