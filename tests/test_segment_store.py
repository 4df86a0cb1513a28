"""The bounded segment store against novel RAG traffic (LMCache issue 4663: reuse decays to 1x
when novel documents fill the cache). A random-weight model, the real connector and a real cpu
tier just big enough for a hot set (2 prefixes, 3 documents) and a little more; a stream of
novel documents, each in one prompt, passes between rounds of the hot requests. With the
bounded store (a document stored on its second sighting, segments under their own budget)
every hot request hits from its third round on; storing every document on first sight lets
the novel ones push the hot set out of the tier."""

from __future__ import annotations

import torch

from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, PromptPart, SamplingParams
from tierkv.engine.config import RANDOM_CONFIGS
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig

VOCAB = RANDOM_CONFIGS["tiny"]["vocab_size"]
PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x fp32
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, blend_ratio=0.0)


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


HOT_PREFIXES = [toks(64, s) for s in (1, 2)]
HOT_DOCS = [toks(48, s) for s in (3, 4, 5)]
QUESTION = toks(8, 6)
HOT_BYTES = PER_TOKEN * (sum(map(len, HOT_PREFIXES)) + sum(map(len, HOT_DOCS)))


def parts(doc: list[int]) -> list[PromptPart]:
    return [PromptPart(doc), PromptPart(QUESTION, reusable=False)]


def hot_hit_rate(config: ConnectorConfig, rounds: int = 8, novel_per_round: int = 4) -> float:
    """Share of the hot requests of rounds 3.. that load all they could: a prefix prompt all
    but its last token, a document prompt its document."""
    tier = CpuTier(CpuTierConfig(capacity_bytes=HOT_BYTES * 3 // 2, page_bytes=4096))
    conn = TierKVConnector(config, tiers=[tier])
    llm = LLM(
        dict(RANDOM_CONFIGS["tiny"]),
        dtype="fp32",
        kv_cache_bytes=8 << 20,
        enable_prefix_caching=False,  # every hit comes from the connector's tier
        kv_connector=conn,
    )
    hits = asked = 0
    try:
        for r in range(rounds):
            for p in HOT_PREFIXES:
                out = llm.generate([p], ONE, use_tqdm=False)[0]
                hit = out.metrics.external_tokens == len(p) - 1
                hits, asked = hits + (hit and r >= 2), asked + (r >= 2)
            for d in HOT_DOCS:
                out = llm.generate([parts(d)], ONE, use_tqdm=False)[0]
                hit = out.metrics.blend.get("loaded", 0) == len(d)
                hits, asked = hits + (hit and r >= 2), asked + (r >= 2)
            for i in range(novel_per_round):
                llm.generate([parts(toks(48, 1000 + r * novel_per_round + i))], ONE, use_tqdm=False)
            conn.flush()
            conn.segments.book.check_integrity()
            tier.check_integrity()
        return hits / asked
    finally:
        conn.close()


def test_hot_set_stays_hit_under_novel_documents() -> None:
    doc_bytes = PER_TOKEN * 48
    bounded = ConnectorConfig(chunk_size=16, segment_bytes=4 * doc_bytes, segment_admit_after=2)
    unbounded = ConnectorConfig(chunk_size=16, segment_bytes=0, segment_admit_after=1)
    with_store, without = hot_hit_rate(bounded), hot_hit_rate(unbounded)
    print(f"hot set hit rate: {with_store:.0%} with the bounded store, {without:.0%} without")
    assert with_store == 1.0
    assert without < 0.8, without


def test_budget_evicts_only_segments() -> None:
    """Documents seen twice, more than the segment budget holds: the budget is never passed,
    the oldest documents go, and the hot prefix stays stored."""
    tier = CpuTier(CpuTierConfig(capacity_bytes="4MiB", page_bytes=4096))
    doc_bytes = PER_TOKEN * 48
    conn = TierKVConnector(
        ConnectorConfig(chunk_size=16, segment_bytes=2 * doc_bytes, segment_admit_after=2),
        tiers=[tier],
    )
    llm = tiny_engine(conn)
    try:
        llm.generate([HOT_PREFIXES[0]], ONE, use_tqdm=False)
        docs = [toks(48, 2000 + i) for i in range(4)]
        for d in docs:
            llm.generate([parts(d)], ONE, use_tqdm=False)
            assert conn.lookup_segments([d], list(llm.segment_preamble)) == [False]  # first sight
            llm.generate([parts(d)], ONE, use_tqdm=False)
            conn.flush()
            assert conn.segments.book.used <= 2 * doc_bytes
            conn.segments.book.check_integrity()
        conn.flush()
        pre = list(llm.segment_preamble)
        assert conn.lookup_segments(docs, pre) == [False, False, True, True]
        assert conn.segments.book.evicted == 2
        out = llm.generate([HOT_PREFIXES[0]], ONE, use_tqdm=False)[0]
        assert out.metrics.external_tokens == len(HOT_PREFIXES[0]) - 1
    finally:
        conn.close()


def tiny_engine(conn: TierKVConnector) -> LLM:
    """The tiny random model in fp32 on conn, no prefix cache (every hit is the connector's)."""
    return LLM(
        dict(RANDOM_CONFIGS["tiny"]),
        dtype="fp32",
        kv_cache_bytes=8 << 20,
        enable_prefix_caching=False,
        kv_connector=conn,
    )


def test_a_sighting_is_a_prompt() -> None:
    """A document twice in one prompt is one sighting (not stored); in two prompts of one
    batch, two (stored, and both prompts blend it)."""
    conn = TierKVConnector(ConnectorConfig(chunk_size=16, segment_admit_after=2))
    llm = tiny_engine(conn)
    try:
        pre = list(llm.segment_preamble)
        a, b = toks(48, 3000), toks(48, 3001)
        twice = [PromptPart(a), PromptPart(a), PromptPart(QUESTION, reusable=False)]
        steps = llm.stats.steps
        out = llm.generate([twice], ONE, use_tqdm=False)[0]
        # nothing stored: a plain prefill (no blend report), its KV stored under no key
        assert out.metrics.blend == {} and out.metrics.external_tokens == 0
        assert llm.stats.steps == steps + 1 and conn.stats.saved_chunks == 0
        assert conn.lookup_segments([a], pre) == [False]
        outs = llm.generate([parts(b), parts(b)], ONE, use_tqdm=False)
        assert [o.metrics.blend["loaded"] for o in outs] == [48, 48]  # type: ignore[index]
        assert conn.lookup_segments([b], pre) == [True]
        assert (
            conn.segments.book.sightings[
                conn.hasher.segment_key(a, conn.hasher.prefix_key(pre) if pre else None)
            ]
            == 1
        )
    finally:
        conn.close()


def test_parts_are_stored_under_the_prompts_cache_salt() -> None:
    conn = TierKVConnector(ConnectorConfig(chunk_size=16, segment_admit_after=1))
    llm = tiny_engine(conn)
    try:
        d = toks(48, 4000)
        salted = SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, blend_ratio=0.0, cache_salt="a"
        )
        out = llm.generate([parts(d)], salted, use_tqdm=False)[0]
        assert out.metrics.blend["loaded"] == 48  # stored under salt a, loaded under it
        pre = list(llm.segment_preamble)
        assert conn.lookup_segments([d], pre, "a") == [True]
        assert conn.lookup_segments([d], pre) == [False]  # nothing under the unsalted key
    finally:
        conn.close()
