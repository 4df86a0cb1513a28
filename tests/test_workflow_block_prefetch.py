"""Block prefetch on the real SmolLM2-135M-Instruct (fp32, greedy) over a real TierKVConnector
with a local cpu tier: with one step of warning the next agent's prompt is in the engine's
blocks (a prefix-cache hit) when its step starts, the answers are those of a cold run, a
request racing the prefetch loads normally, no block leaks, and under a tight block budget the
prefetch never takes a block that a running sequence needs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.models import safetensors_copy
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams
from tierkv.engine.block_prefetch import ID
from tierkv.engine.models import pull
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.hints import KVHint, parse_hint

BS = 16
KV_BLOCK_BYTES = 30 * 2 * 3 * 64 * 4 * BS  # SmolLM2 fp32: layers * (K, V) * kv heads * head_dim
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
AGENTS = ("planner", "coder", "reviewer")
GRAPH = {"steps": [["planner"], ["coder"], ["reviewer"]], "loop": True}


def system(agent: str) -> str:
    """A distinct, deterministic system prompt of ~150 tokens."""
    words = [f"{agent}{i % 7}" if i % 5 else f"rule {i} of the {agent}" for i in range(24)]
    return f"You are the {agent} of a software team. Follow these rules: " + ", ".join(words)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """From the GGUF checkpoint: it carries the tokenizer and chat template."""
    llm = LLM(str(pull("smollm2", progress=False)), dtype="fp32", kv_cache_bytes=KV_BLOCK_BYTES)
    return [
        llm.chat_prompt(  # type: ignore[arg-type]
            [{"role": "system", "content": system(a)}, {"role": "user", "content": "Go on."}]
        )
        for a in AGENTS
    ]


@pytest.fixture
def conns() -> Iterator[list[TierKVConnector]]:
    made: list[TierKVConnector] = []
    try:
        yield made
    finally:
        for c in made:
            c.close()


def engine(
    conns: list[TierKVConnector], blocks: int, block_prefetch: int
) -> tuple[LLM, TierKVConnector]:
    """An engine over a connector of its own with a roomy local cpu tier (hinted eviction)."""
    conn = TierKVConnector(ConnectorConfig(chunk_size=64, tiers=TiersConfig(cpu_bytes="96MiB")))
    conns.append(conn)
    return LLM(
        str(safetensors_copy()),
        dtype="fp32",
        kv_cache_bytes=blocks * KV_BLOCK_BYTES,
        kv_connector=conn,
        eviction="hinted",
        block_prefetch=block_prefetch,
    ), conn


def hint(agent: str, at: int) -> dict[str, Any]:
    return {"workflow": "w", "agent": agent, "graph": dict(GRAPH, at=at)}


def kv_hint(agent: str, at: int) -> KVHint:
    return parse_hint(hint(agent, at), "kv_hint")


def run_loop(
    llm: LLM, conn: TierKVConnector, ps: list[list[int]], order: list[int]
) -> list[tuple[list[int], int, int]]:
    """One hinted request per step; (answer, prefix-cache hit, prompt blocks) of each."""
    out = []
    for at, a in enumerate(order):
        (r,) = llm.generate([ps[a]], GREEDY, use_tqdm=False, kv_hints=hint(AGENTS[a], at % 3))
        conn.flush()  # the step's saves are in the cpu tier
        conn.workflows.flush()  # and the prefetches it asked for
        out.append((r.token_ids, r.metrics.cached_tokens, (len(ps[a]) - 1) // BS * BS))
        llm.check_integrity()
    assert not llm.scheduler.held and not llm.connector.states  # type: ignore[attr-defined]
    return out


def test_next_agent_is_in_the_blocks_when_its_step_starts(
    prompts: list[list[int]], conns: list[TierKVConnector]
) -> None:
    p_blocks = max(len(p) for p in prompts) // BS + 1
    # Two prompts and a running answer: the loop of three agents evicts at every step.
    llm, conn = engine(conns, 2 * p_blocks + 2, block_prefetch=64)
    order = [0, 1, 2, 0, 1, 2, 0]
    got = run_loop(llm, conn, prompts, order)
    stats = llm.block_prefetch.stats
    assert stats.issued > 0 and stats.landed_blocks > 0 and stats.failed_blocks == 0
    assert stats.loaded_tokens.get("cpu", 0) == stats.landed_blocks * BS
    # From step 4 on, each step's agent was prefetched during the step before (one step of
    # warning): its whole prompt is a prefix-cache hit.
    for i in range(4, len(order)):
        assert got[i][1] == got[i][2], (i, [g[1:] for g in got])
    # Cold: no connector, no prefetch; fp32 greedy answers are the same.
    cold = LLM(str(safetensors_copy()), dtype="fp32", kv_cache_bytes=64 * KV_BLOCK_BYTES)
    for (tokens, _, _), a in zip(got, order):
        (r,) = cold.generate([prompts[a]], GREEDY, use_tqdm=False)
        assert tokens == r.token_ids


def test_without_block_prefetch_the_prompt_waits_in_the_local_tier(
    prompts: list[list[int]], conns: list[TierKVConnector]
) -> None:
    p_blocks = max(len(p) for p in prompts) // BS + 1
    llm, conn = engine(conns, 2 * p_blocks + 2, block_prefetch=0)
    order = [0, 1, 2, 0, 1, 2, 0]
    got = run_loop(llm, conn, prompts, order)
    assert llm.block_prefetch.stats.issued == 0
    assert any(got[i][1] < got[i][2] for i in range(4, len(order)))  # loaded, not cached


def test_a_request_racing_the_prefetch_loads_normally(
    prompts: list[list[int]], conns: list[TierKVConnector]
) -> None:
    llm, conn = engine(conns, 64, block_prefetch=64)
    run_loop(llm, conn, prompts, [0, 1, 2])  # every prompt in the cpu tier
    tree = llm.blocks.tree
    assert tree is not None
    for b in tree.evict(10**6):  # the engine forgets them: only the cpu tier holds them now
        llm.blocks.release_blocks([b])
    llm.check_integrity()
    stats = llm.block_prefetch.stats
    assert stats.issued == 0 and not llm.block_prefetch.queue  # everything was cached
    # The planner's step prefetches the coder; the coder's request arrives before any step ran.
    planner = llm.add_request("p", prompts[0], GREEDY, kv_hint("planner", 0))
    coder = llm.add_request("c", prompts[1], GREEDY)
    while llm.has_unfinished():
        llm.step()
        llm.check_integrity()
    assert stats.issued == 0 and stats.dropped == 1  # the coder's request loads it itself
    assert coder.seqs[0].metrics.num_external_tokens == len(prompts[1]) - 1  # all but the last
    assert planner.finished and coder.finished
    cold = LLM(str(safetensors_copy()), dtype="fp32", kv_cache_bytes=64 * KV_BLOCK_BYTES)
    for req, p in ((planner, prompts[0]), (coder, prompts[1])):
        (r,) = cold.generate([p], GREEDY, use_tqdm=False)
        assert llm.output(req).token_ids == r.token_ids
    # The reviewer's prompt arrives 2 blocks a step; its request comes after the first step:
    # it hits those 2 blocks and loads the rest itself (the prefetch stops there).
    llm.block_prefetch.max_blocks = 2
    llm.add_request("r", prompts[1], GREEDY, kv_hint("coder", 1))  # prefetches the reviewer
    llm.step()
    llm.check_integrity()
    assert stats.issued == 1 and stats.landed_blocks == 2
    late = llm.add_request("r2", prompts[2], GREEDY)
    while llm.has_unfinished():
        llm.step()
        llm.check_integrity()
    assert stats.issued == 1 and stats.failed_blocks == 0 and not llm.block_prefetch.queue
    m = late.seqs[0].metrics
    assert (m.num_cached_tokens, m.num_external_tokens) == (2 * BS, len(prompts[2]) - 1 - 2 * BS)
    (r,) = cold.generate([prompts[2]], GREEDY, use_tqdm=False)
    assert llm.output(late).token_ids == r.token_ids
    assert not [s for s in llm.scheduler.held if s.startswith(ID)]


def test_block_prefetch_never_takes_blocks_a_running_sequence_needs(
    prompts: list[list[int]], conns: list[TierKVConnector]
) -> None:
    p_blocks = max(len(p) for p in prompts) // BS + 1
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    runs = []
    for bp in (0, 64):
        llm, conn = engine(conns, 2 * p_blocks + 6, block_prefetch=bp)
        run_loop(llm, conn, prompts, [0, 1, 2])
        # Two agents at once growing their answers in a budget that barely holds them, while
        # the third agent's prompt waits in the cpu tier to be prefetched.
        reqs = [llm.add_request(f"x{i}", prompts[i], long, kv_hint(AGENTS[i], 1)) for i in (0, 1)]
        while llm.has_unfinished():
            llm.step()
            llm.check_integrity()
        runs.append(
            (
                [llm.output(r).token_ids for r in reqs],
                [r.seqs[0].metrics.num_preemptions for r in reqs],
                llm.block_prefetch.stats.issued,
            )
        )
    (off_tokens, off_pre, _), (on_tokens, on_pre, _) = runs
    assert on_tokens == off_tokens and on_pre == off_pre
