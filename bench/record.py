"""What the blend benches (blend, blend_quality, blend_task, blend_encoding) record of a reply
against full prefill's: the logits its first token was sampled from, the KL between two such
distributions and the first greedy token that differs."""

from __future__ import annotations

from typing import Any

import torch

from tierkv.engine import LLM, RequestOutput, SamplingParams


class FirstLogits:
    """Runs one prompt at a time on an engine and keeps, in fp32, the logits its first token was
    sampled from (a logits hook: observes, changes nothing)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.seen: list[torch.Tensor] = []
        llm.logits_hooks.append(lambda logits: self.seen.append(logits[-1].float().clone()))

    def run(self, prompt: Any, params: SamplingParams) -> tuple[RequestOutput, torch.Tensor]:
        """The output and the logits its first token was sampled from: generate() may run
        steps before the prompt's own (the ingest of segments the store lacks); one token per
        step after."""
        self.seen = []
        out = self.llm.generate([prompt], params, use_tqdm=False)[0]
        return out, self.seen[-len(out.token_ids)]


def kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """KL(ref || got) of the next-token distributions of two fp32 logits vectors."""
    return float(
        torch.nn.functional.kl_div(
            got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum"
        )
    )


def first_diff(a: list[int], b: list[int]) -> int:
    """The index of the first token where a and b differ (the shorter length if none does)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
