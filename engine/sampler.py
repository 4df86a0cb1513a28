"""Sampler: greedy, temperature, top-k, top-p, each request with its own generator."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierkv.engine.outputs import token_logprobs
from tierkv.engine.sequence import Sequence


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude from one row of fp32 logits [V]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of logits [B, V] (fp32); greedy rows in one argmax."""
    out = logits.argmax(-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = filter_logits(logits[i] / p.temperature, p.top_k, p.top_p)
        out[i] = int(torch.multinomial(row.softmax(-1), 1, generator=seq.generator))
    return out


def sample_step(
    logits: torch.Tensor, samplers: list[Sequence], fork: Callable[[Sequence, int], Sequence]
) -> tuple[list[Sequence], list[tuple[Sequence, Sequence]], dict[int, int], dict[int, tuple]]:
    """A step's sampling: logits row i is samplers[i]'s; the first token of a request of n > 1
    samples also draws its other samples (fork(seq, k) makes sample k) from that row. Returns
    (every sequence that sampled, the (parent, child) forks, token by seq_id, (logprob, top)
    by seq_id for the sequences that ask for logprobs)."""
    rows, seqs, children = [], [], []
    for i, seq in enumerate(samplers):
        rows.append(i)
        seqs.append(seq)
        if seq.params.n > 1 and seq.sample_index == 0 and seq.num_output_tokens == 0:
            for k in range(1, seq.params.n):  # the other samples share this prompt's KV
                child = fork(seq, k)
                children.append((seq, child))
                rows.append(i)
                seqs.append(child)
    picked = logits if len(rows) == logits.shape[0] else logits[rows]  # no copy without forks
    tokens = dict(zip((s.seq_id for s in seqs), sample(picked, seqs))) if seqs else {}
    logprobs = {
        s.seq_id: token_logprobs(logits[r], tokens[s.seq_id], s.params.logprobs)
        for r, s in zip(rows, seqs)
        if s.params.logprobs is not None
    }
    return seqs, children, tokens, logprobs
