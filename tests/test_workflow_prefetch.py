"""The engine prefetches the next step's agents through a real TierKVConnector (a small local
cpu tier over a disk tier, hinted eviction): each step asks for the prompts of the agents that
run next, and with one step of warning every step of the second round loads its whole prompt
from the cpu tier, where LRU without hints finds it on disk."""

from __future__ import annotations

from pathlib import Path

import torch

from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams
from tierkv.storage_backends.build import TiersConfig

CFG = dict(  # a 64-token chunk is two of the cpu tier's 256 KiB pages
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=512,
    vocab_size=512,
    max_position_embeddings=4096,
)
N = 320  # tokens of an agent's prompt: 5 chunks of 64
AGENTS = ("planner", "coder", "reviewer")
STEPS = [["planner"], ["coder"], ["reviewer"]]
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (N,), generator=g).tolist() for _ in AGENTS]


def run(tmp: Path, eviction: str, hinted: bool) -> tuple[list[dict], TierKVConnector]:
    """Two rounds of the 3-step loop; each step's loaded tokens per tier."""
    conn = TierKVConnector(
        ConnectorConfig(
            chunk_size=64,
            tiers=TiersConfig(
                cpu_bytes="10MiB",  # 13 chunks (3 pages each): 2.6 prompts of 5 chunks
                disk_dir=str(tmp),
                disk_bytes="64MiB",
                eviction=eviction,
            ),
        )
    )
    llm = LLM(
        CFG,
        dtype="float32",
        kv_cache_bytes=8 << 20,
        enable_prefix_caching=False,  # every reuse goes through the connector's tiers
        kv_connector=conn,
        eviction=eviction,
    )
    ps, out = prompts(), []
    for at in range(6):
        a = at % 3
        h = {"workflow": "w", "agent": AGENTS[a], "graph": {"steps": STEPS, "at": a, "loop": True}}
        (r,) = llm.generate([ps[a]], ONE, use_tqdm=False, kv_hints=h if hinted else None)
        conn.flush()  # the step's saves are in (a step takes longer than this in a workflow)
        conn.workflows.flush()  # and the prefetches it asked for
        out.append(dict(r.metrics.connector.get("loaded_tokens", {})))
        llm.check_integrity()
    return out, conn


def test_next_step_agents_are_prefetched_into_the_cpu_tier(tmp_path: Path) -> None:
    loaded, conn = run(tmp_path / "h", "hinted", hinted=True)
    try:
        # Steps 0 and 1 know no prompt of the agent after them; from step 2 on, each step
        # prefetches the agent of the step after it (the loop starts over).
        assert conn.workflows.stats.prefetches == 4
        assert loaded[:3] == [{}, {}, {}]
        for got in loaded[3:]:
            assert got == {"cpu": N - 1}, loaded  # warm: all of it from the cpu tier
    finally:
        conn.close()
    lru, conn = run(tmp_path / "l", "lru", hinted=False)
    try:
        assert conn.workflows.stats.prefetches == 0
        assert all(got.get("disk", 0) > 0 for got in lru[3:]), lru  # cold: partly from disk
    finally:
        conn.close()
