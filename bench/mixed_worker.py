"""The mixed-load run inside a bench.engine_worker process: requests arrive at set times while
the engine steps, and the time each request's every token came out is kept. Standard library
only at import: the two venvs share nothing else.

An arrival is {"at": seconds from the start, "prompt": [ids], "max_tokens": n, "kind":
"stream" | "long" | "blend"}; a blend arrival also has "parts": its documents' token ids, and
its prompt is the documents in that order then the question (what an engine without
any-position reuse sees). A token's time is when the step that produced it returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Step = Callable[[], list[tuple[str, int]]]  # one engine step: (request id, tokens so far)


def run_arrivals(
    arrivals: list[dict[str, Any]], add: Callable[[str, dict[str, Any]], None], step: Step
) -> dict[str, Any]:
    """Add each arrival at its time (or at the first step boundary after it) and step until
    every request finished; per arrival, when it was added and each of its tokens' times,
    in seconds from the start."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i]["at"])
    added: dict[str, float] = {}
    times: dict[str, list[float]] = {str(i): [] for i in range(len(arrivals))}
    t0, nxt = time.perf_counter(), 0
    while nxt < len(order) or any(len(times[r]) < arrivals[int(r)]["max_tokens"] for r in added):
        now = time.perf_counter() - t0
        while nxt < len(order) and arrivals[order[nxt]]["at"] <= now:
            rid = str(order[nxt])
            add(rid, arrivals[order[nxt]])
            added[rid] = time.perf_counter() - t0
            nxt += 1
        if len(added) == sum(len(times[r]) >= arrivals[int(r)]["max_tokens"] for r in added):
            if nxt < len(order):  # idle until the next arrival
                time.sleep(max(0.0, arrivals[order[nxt]]["at"] - now))
            continue
        done = step()
        now = time.perf_counter() - t0
        for rid, n in done:
            got = times[rid]
            got.extend([now] * (n - len(got)))
    n = len(arrivals)
    return {"added": [added[str(i)] for i in range(n)], "times": [times[str(i)] for i in range(n)]}


def tierkv_mixed(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The mixed run on tierkv's engine (an LLM with a connector that stores segments): blend
    arrivals come as parts (their documents stored ahead, as a RAG service would have them)."""
    from dataclasses import replace

    from tierkv.engine import PromptPart, SamplingParams

    docs = [d for a in job["arrivals"] if a["kind"] == "blend" for d in a["parts"]]
    if docs:
        llm.ingest(docs)
    reqs: dict[str, Any] = {}

    def add(rid: str, a: dict[str, Any]) -> None:
        p = SamplingParams(temperature=0.0, max_tokens=a["max_tokens"], ignore_eos=True)
        if a["kind"] == "blend":  # a blend whatever the model's calibration says
            p = replace(p, blend_ratio=0.15)
            q = a["prompt"][sum(len(d) for d in a["parts"]) :]
            parts = [PromptPart(d) for d in a["parts"]] + [PromptPart(q, reusable=False)]
            reqs[rid] = llm.add_request(rid, parts, p)
        else:
            reqs[rid] = llm.add_request(rid, a["prompt"], p)

    def step() -> list[tuple[str, int]]:
        return [(r.request_id, r.seqs[0].num_output_tokens) for r in llm.step()]

    out = run_arrivals(job["arrivals"], add, step)
    llm.drain_saves()
    return out


def vllm_mixed(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The mixed run on vLLM's LLMEngine: every arrival as its flat prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine

    def add(rid: str, a: dict[str, Any]) -> None:
        p = SamplingParams(
            temperature=0.0, max_tokens=a["max_tokens"], ignore_eos=True, detokenize=False
        )
        engine.add_request(rid, TokensPrompt(prompt_token_ids=a["prompt"]), p)

    def step() -> list[tuple[str, int]]:
        return [(o.request_id, len(o.outputs[0].token_ids)) for o in engine.step()]

    return run_arrivals(job["arrivals"], add, step)
