"""Any-position reuse with a declared shared prefix (a system prompt), and blend prefills over
the per-step token budget; fp32, real model forwards, a real connector and cpu tier."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.test_blend import DOCS, QUESTION, VOCAB, ckpt, conn, engine, first_logits, flat, toks  # noqa: F401
from tierkv.engine import LLM, PromptPart, SamplingParams
from tierkv.kernels import RotaryEmbedding, rerotate_k

SYS_A, SYS_B = toks(100, 7), toks(100, 8)  # two chunks of 64: one full, one partial


def with_prefix(system: list[int], order: list[int], declared: bool = True) -> list[PromptPart]:
    return (
        [PromptPart(system, prefix=declared)]
        + [PromptPart(DOCS[i]) for i in order]
        + [PromptPart(QUESTION, reusable=False)]
    )


def greedy(n: int, ratio: float | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, blend_ratio=ratio)


def kl(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(
        torch.nn.functional.kl_div(
            got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum"
        )
    )


def run_alone(llm: LLM, prompt, params: SamplingParams):
    """Generate without generate()'s ingest of missing segments: what a lookup finds is all it
    gets."""
    req = llm.add_request(None, prompt, params)
    while llm.has_unfinished():
        llm.step()
    return llm.output(req)


def test_declared_prefix_ratio_one_is_full_prefill(ckpt, conn) -> None:
    ref, ref_tokens, _ = first_logits(engine(ckpt[0]), SYS_A + flat([2, 0, 1]), greedy(8))
    llm = engine(ckpt[0], conn)
    got, tokens, m = first_logits(llm, with_prefix(SYS_A, [2, 0, 1]), greedy(8, 1.0))
    docs = sum(map(len, DOCS))
    assert (
        m.cached_tokens == 0 and m.external_tokens == len(SYS_A) + docs
    )  # the prefix exactly, then the docs
    assert m.blend["loaded"] == m.blend["recomputed"] == docs and m.blend["computed"] == len(
        QUESTION
    )
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens


def test_declared_prefix_from_the_prefix_cache(ckpt, conn) -> None:
    """With prefix caching on, the ingest leaves the prefix's whole blocks in the radix tree: the
    blend takes those and loads the 4 tokens past the last whole block from the connector."""
    ref, _, _ = first_logits(engine(ckpt[0]), SYS_A + flat([1, 2]), greedy(4))
    llm = LLM(
        str(ckpt[0]),
        dtype="float32",
        kv_cache_bytes=16 << 20,
        kv_connector=conn,
        blend_encoding="standalone",
        blend_calibration="off",
    )
    got, _, m = first_logits(llm, with_prefix(SYS_A, [1, 2]), greedy(4, 1.0))
    assert (m.cached_tokens, m.external_tokens) == (96, 4 + len(DOCS[1]) + len(DOCS[2]))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_declared_prefix_ratio_zero_is_documents_computed_after_it(ckpt, conn) -> None:
    """Reference: HF transformers computes each document right after the system prompt, its K is
    re-rotated from there to the document's offset, and the question runs over the system
    prompt's KV and the concatenated documents' KV."""
    path, hf = ckpt
    order, p = [1, 2, 0], len(SYS_A)
    llm = engine(path, conn)
    cfg = llm.model_config
    rope = RotaryEmbedding(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
    )
    cache = DynamicCache()
    with torch.no_grad():
        per_doc = [
            hf(torch.tensor([SYS_A + DOCS[i]]), use_cache=True).past_key_values for i in order
        ]
        for layer in range(hf.config.num_hidden_layers):
            first = per_doc[0].layers[layer]
            ks, vs, off = [first.keys[0][:, :p]], [first.values[0][:, :p]], p
            for i, pkv in zip(order, per_doc):
                k, v = (
                    pkv.layers[layer].keys[0][:, p:],
                    pkv.layers[layer].values[0][:, p:],
                )  # [Hkv, T, D]
                ks.append(rerotate_k(k.transpose(0, 1), off - p, rope).transpose(0, 1))
                vs.append(v)
                off += len(DOCS[i])
            cache.update(torch.cat(ks, 1)[None], torch.cat(vs, 1)[None], layer)
        ref = hf(
            torch.tensor([QUESTION]),
            cache=cache,
            position_ids=torch.arange(off, off + len(QUESTION))[None],
        )
    got, _, m = first_logits(llm, with_prefix(SYS_A, order), greedy(2, 0.0))
    assert m.blend == {
        "loaded": off - p,
        "recomputed": 0,
        "computed": len(QUESTION),
        "full_layers": 0,
    }
    torch.testing.assert_close(got, ref.logits[0, -1].float(), rtol=1e-4, atol=1e-4)


def test_documents_under_one_prefix_never_hit_under_another(ckpt, conn) -> None:
    llm = engine(ckpt[0], conn)
    assert llm.ingest(DOCS, SYS_A) == 3
    assert conn.lookup_segments(DOCS, SYS_A) == [True] * 3
    assert conn.lookup_segments(DOCS, SYS_B) == conn.lookup_segments(DOCS) == [False] * 3
    under_a = conn.hasher.segment_key(DOCS[0], conn.hasher.prefix_key(SYS_A))
    assert (
        len(
            {
                under_a,
                conn.hasher.segment_key(DOCS[0]),
                conn.hasher.segment_key(DOCS[0], conn.hasher.prefix_key(SYS_B)),
            }
        )
        == 3
    )
    for prompt in (
        with_prefix(SYS_B, [0, 1]),
        with_prefix(SYS_A, [0, 1], declared=False),
        [PromptPart(DOCS[0]), PromptPart(DOCS[1]), PromptPart(QUESTION, reusable=False)],
    ):
        out = run_alone(llm, prompt, greedy(2, 0.0))
        assert out.metrics.blend["loaded"] == 0  # computed in full, nothing of prefix A's reused
    assert llm.ingest(DOCS) == 3  # standalone: stored apart, under their own keys
    assert run_alone(llm, with_prefix(SYS_A, [2, 0]), greedy(2, 0.0)).metrics.blend[
        "loaded"
    ] == len(DOCS[2] + DOCS[0])


def test_declared_prefix_lowers_the_deviation_at_ratio_zero(ckpt, conn) -> None:
    """Same prompt, the system prompt's KV exact either way: documents computed after it deviate
    less from full prefill than documents computed standalone (they saw the system prompt)."""
    ref, _, _ = first_logits(engine(ckpt[0]), SYS_A + flat([0, 1, 2]), greedy(1))
    llm = engine(ckpt[0], conn)
    got = {
        d: first_logits(llm, with_prefix(SYS_A, [0, 1, 2], d), greedy(1, 0.0))[0]
        for d in (False, True)
    }
    assert kl(got[True], ref) < 0.5 * kl(got[False], ref), (kl(got[True], ref), kl(got[False], ref))


def test_bad_prefix_declarations(ckpt, conn) -> None:
    with pytest.raises(ValueError, match="reusable=False"):
        PromptPart(SYS_A, reusable=False, prefix=True)
    llm = engine(ckpt[0], conn)
    with pytest.raises(ValueError, match="only the first part"):
        llm.generate(
            [
                [
                    PromptPart(DOCS[0]),
                    PromptPart(SYS_A, prefix=True),
                    PromptPart(QUESTION, reusable=False),
                ]
            ],
            greedy(1),
            use_tqdm=False,
        )
    with pytest.raises(ValueError, match="at least one token"):
        llm.ingest([DOCS[0], []], SYS_A)
    assert conn.stats.saved_chunks == 0 and not llm.scheduler.has_work()


def test_blend_longer_than_the_step_budget(ckpt, conn) -> None:
    """A 262-token blend prompt with a 64-token step budget still blends, in one step."""
    ref, ref_tokens, _ = first_logits(engine(ckpt[0]), SYS_A + flat([0, 2]), greedy(6))
    llm = LLM(
        str(ckpt[0]),
        dtype="float32",
        kv_cache_bytes=16 << 20,
        enable_prefix_caching=False,
        kv_connector=conn,
        blend_encoding="standalone",
        max_num_batched_tokens=64,
    )
    got, tokens, m = first_logits(llm, with_prefix(SYS_A, [0, 2]), greedy(6, 1.0))
    assert m.blend["loaded"] == len(DOCS[0] + DOCS[2]) and m.blend["full_layers"] == 1
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens
    llm.ingest(DOCS)
    steps = llm.stats.steps
    _, _, m = first_logits(
        llm, [PromptPart(d) for d in DOCS] + [PromptPart(QUESTION, reusable=False)], greedy(1, 0.15)
    )
    assert llm.stats.steps == steps + 1 and m.blend["recomputed"] == 32  # ceil(0.15 * 210)
