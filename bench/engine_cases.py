"""The cases of bench.engine --vs vllm (bench/engine_vllm.py): their sizes, and each run on one
system (a bench.engine_worker.Worker, or anything with its `system` and `generate`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tqdm import tqdm


class Engine(Protocol):
    system: str

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]: ...


VOCAB = (100, 49000)  # token ids drawn from here: SmolLM2's vocabulary, clear of special tokens


@dataclass(frozen=True, slots=True)
class Sizes:
    """The workload of the engine benchmarks (bench.engine, bench.engine --vs vllm,
    bench.engine_profile): one meaning per name in all three."""

    rounds: int = 3  # each case this many times per system (medians reported)
    requests: int = 64  # throughput: requests
    prompt: tuple[int, int] = (128, 1024)  # throughput: prompt lengths, drawn uniformly
    output: tuple[int, int] = (32, 256)  # throughput: output lengths, drawn uniformly
    shared: int = 32  # shared prefix: requests
    system: int = 1024  # shared prefix: its tokens
    user: tuple[int, int] = (32, 128)  # shared prefix: each request's own suffix
    shared_output: int = 32  # shared prefix: tokens generated per request
    decode_prompt: int = 256  # single-request decode: prompt tokens
    decode_output: int = 64  # single-request decode: tokens generated
    decode_runs: int = 5  # single-request decode: runs per system (medians reported)
    sessions: int = 8  # chat: concurrent conversations
    turns: int = 8  # chat: turns per conversation
    opening: tuple[int, int] = (128, 256)  # chat: each conversation's first message
    reply: int = 48  # chat: tokens per reply
    chat_user: tuple[int, int] = (32, 96)  # chat: each later user message
    hf_batch: int = 32  # bench.engine: transformers' generate batch (its baseline)


FULL = Sizes()
QUICK = replace(
    FULL,
    rounds=1,
    requests=12,
    prompt=(64, 256),
    output=(16, 48),
    shared=8,
    system=512,
    user=(16, 64),
    shared_output=16,
    decode_prompt=128,
    decode_output=24,
    decode_runs=3,
    sessions=4,
    turns=4,
    reply=24,
    hf_batch=6,
)


def ids(r: random.Random, n: int) -> list[int]:
    return [r.randrange(*VOCAB) for _ in range(n)]


def run_cases(workers: Sequence[Engine], c: Sizes, bar: tqdm) -> list[dict[str, Any]]:
    """Every case, round by round; the systems take turns (the first one alternates)."""
    rows: list[dict[str, Any]] = []

    def each(rnd: int, case: str, job: Any) -> None:
        order = list(workers) if rnd % 2 == 0 else list(workers)[::-1]
        for w in order:
            rows.append(dict(case=case, system=w.system, round=rnd, **job(w)))
            bar.update(1)

    for rnd in range(c.rounds):
        r = random.Random(rnd)
        prompts = [ids(r, r.randint(*c.prompt)) for _ in range(c.requests)]
        outs = [r.randint(*c.output) for _ in range(c.requests)]
        each(rnd, "throughput", lambda w: timed(w, prompts, outs))
        system = ids(r, c.system)
        users = [ids(r, r.randint(*c.user)) for _ in range(c.shared)]
        shared = [system + u for u in users]
        souts = [c.shared_output] * len(users)
        each(rnd, "shared_prefix", lambda w: timed(w, shared, souts))
        # the same lengths, each with its own system prompt: no reuse possible
        distinct = [ids(r, c.system) + u for u in users]
        each(rnd, "shared_prefix_no_reuse", lambda w: timed(w, distinct, souts))
        each(rnd, "chat", lambda w: chat(w, c, rnd))
    for run in range(c.decode_runs):
        p = ids(random.Random(1000 + run), c.decode_prompt)
        each(run, "decode", lambda w: decode(w, p, c.decode_output))
    return rows


def timed(w: Engine, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    res = w.generate(prompts, outs)
    assert [len(o) for o in res["outputs"]] == outs, f"{w.system}: wrong output lengths"
    return dict(
        seconds=res["seconds"], output_tokens=sum(outs), tok_per_s=sum(outs) / res["seconds"]
    )


def decode(w: Engine, prompt: list[int], n: int) -> dict[str, Any]:
    res = w.generate([prompt], [n])
    return dict(
        seconds=res["seconds"], output_tokens=n, ms_per_token=res["decode_s"][0] / (n - 1) * 1e3
    )


def chat(w: Engine, c: Sizes, rnd: int) -> dict[str, Any]:
    """Sessions answered together, turn after turn; each turn's prompt is the session's whole
    history (the system's own replies included) plus a new user message."""
    r = random.Random(500 + rnd)
    hist = [ids(r, r.randint(*c.opening)) for _ in range(c.sessions)]
    seconds, tokens = 0.0, 0
    for _ in range(c.turns):
        hist = [h + ids(r, r.randint(*c.chat_user)) for h in hist]
        res = w.generate(hist, [c.reply] * len(hist))
        seconds += res["seconds"]
        tokens += c.reply * len(hist)
        hist = [h + o for h, o in zip(hist, res["outputs"])]
    return dict(
        seconds=seconds,
        output_tokens=tokens,
        tok_per_s=tokens / seconds,
        prompt_tokens_last=max(map(len, hist)),
    )
