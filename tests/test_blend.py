"""Any-position reuse (CacheBlend): re-rotation, the ratio 1.0 and 0.0 identities (0.0 against
Hugging Face transformers on the concatenated re-rotated standalone KV), segment keys, one
store per segment, and misses; all in fp32 with a real connector and cpu tier."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers
from transformers import DynamicCache

from tests.test_connector import FaultTier
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, PromptPart, SamplingParams
from tierkv.kernels import RotaryEmbedding, rerotate_k
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.cpu_tier import CpuTierConfig
from tierkv.storage_backends.keys import ChunkHasher, Salt

VOCAB = 256
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DOCS = [toks(70, 1), toks(90, 2), toks(50, 3)]
QUESTION = toks(12, 4)


def blend_checkpoint(path) -> transformers.LlamaForCausalLM:
    """The 4-layer random Llama of the blend tests, saved at path (fp32, seed 0)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("blend-llama")
    return path, blend_checkpoint(path)


class Logits:
    """Records the logits each step samples from (observes the real engine, changes nothing)."""

    def __init__(self, llm: LLM) -> None:
        self.seen: list[torch.Tensor] = []
        llm.logits_hooks.append(lambda logits: self.seen.append(logits.clone()))


def engine(path, conn=None) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        kv_cache_bytes=16 << 20,
        enable_prefix_caching=False,
        kv_connector=conn,
        blend_encoding="standalone",
        blend_calibration="off",  # a random checkpoint has no calibration: blend by the knobs
    )


def prompt(order: list[int], reusable_question: bool = False) -> list[PromptPart]:
    return [PromptPart(DOCS[i]) for i in order] + [PromptPart(QUESTION, reusable=reusable_question)]


def flat(order: list[int]) -> list[int]:
    return sum((DOCS[i] for i in order), []) + QUESTION


@pytest.fixture
def conn():
    c = TierKVConnector(
        ConnectorConfig(chunk_size=64, tiers=TiersConfig(cpu_bytes="32MiB"), segment_admit_after=1)
    )
    yield c
    c.close()


def first_logits(llm: LLM, p, params: SamplingParams) -> tuple[torch.Tensor, list[int], object]:
    rec = Logits(llm)
    out = llm.generate([p], params, use_tqdm=False)[0]
    return rec.seen[-len(out.token_ids)][-1], out.token_ids, out.metrics


def test_rerotation_equals_rotation_at_the_new_position(ckpt) -> None:
    """K of real tokens through layer 0's projection, rotated at 0.. then moved by d, equals K
    rotated at d.. directly (fp32)."""
    llm = engine(ckpt[0])
    attn = llm.runner.model.layers[0].self_attn
    cfg = llm.model_config
    rope = RotaryEmbedding(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
    )
    h = llm.runner.model.embed_tokens(torch.tensor(DOCS[1]))
    k = attn.qkv_proj(h)[:, attn.q_size : attn.q_size + attn.kv_size].reshape(
        len(DOCS[1]), attn.hkv, attn.d
    )
    q = torch.zeros(len(DOCS[1]), attn.hq, attn.d)
    for d in (0, 1, 137, 900):
        _, at0 = rope.apply(q, k, torch.arange(len(DOCS[1])))
        _, atd = rope.apply(q, k, torch.arange(len(DOCS[1])) + d)
        torch.testing.assert_close(rerotate_k(at0, d, rope), atd, rtol=1e-5, atol=1e-5)


def test_ratio_one_is_full_prefill(ckpt, conn) -> None:
    cold = engine(ckpt[0])
    ref_logits, ref_tokens, _ = first_logits(cold, flat([2, 0, 1]), GREEDY)
    llm = engine(ckpt[0], conn)
    got, tokens, m = first_logits(
        llm,
        prompt([2, 0, 1]),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, blend_ratio=1.0),
    )
    assert m.external_tokens == sum(map(len, DOCS))
    assert m.blend["recomputed"] == m.blend["loaded"] == sum(map(len, DOCS))
    torch.testing.assert_close(got, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens


def test_ratio_zero_is_concatenated_cached_kv(ckpt, conn) -> None:
    """Reference: HF transformers computes each document alone, its K is re-rotated to the
    document's offset, and the question runs over the concatenated cache."""
    path, hf = ckpt
    order = [1, 2, 0]
    llm = engine(path, conn)
    cfg = llm.model_config
    rope = RotaryEmbedding(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
    )
    cache, offset = DynamicCache(), 0
    with torch.no_grad():
        per_doc = [hf(torch.tensor([DOCS[i]]), use_cache=True).past_key_values for i in order]
        for layer in range(hf.config.num_hidden_layers):
            ks, vs, off = [], [], 0
            for i, pkv in zip(order, per_doc):
                k, v = pkv.layers[layer].keys[0], pkv.layers[layer].values[0]  # [Hkv, T, D]
                ks.append(rerotate_k(k.transpose(0, 1), off, rope).transpose(0, 1))
                vs.append(v)
                off += len(DOCS[i])
            cache.update(torch.cat(ks, 1)[None], torch.cat(vs, 1)[None], layer)
            offset = off
        pos = torch.arange(offset, offset + len(QUESTION))[None]
        ref = hf(torch.tensor([QUESTION]), cache=cache, position_ids=pos).logits[0, -1]
    got, _, m = first_logits(
        llm,
        prompt(order),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, blend_ratio=0.0),
    )
    assert m.blend == {
        "loaded": offset,
        "recomputed": 0,
        "computed": len(QUESTION),
        "full_layers": 0,
    }
    torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)


def test_deviation_falls_as_the_ratio_grows(ckpt, conn) -> None:
    cold = engine(ckpt[0])
    ref, _, _ = first_logits(cold, flat([2, 1, 0]), GREEDY)
    llm = engine(ckpt[0], conn)
    kl = {}
    for r in (0.0, 0.15, 0.5, 1.0):
        got, _, _ = first_logits(
            llm,
            prompt([2, 1, 0]),
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, blend_ratio=r),
        )
        kl[r] = float(
            torch.nn.functional.kl_div(
                got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum"
            )
        )
    assert kl[1.0] < 1e-6
    assert kl[0.5] < kl[0.0] and kl[0.15] < kl[0.0], kl


def test_segment_stored_once_reused_in_three_prompts(ckpt, conn) -> None:
    llm = engine(ckpt[0], conn)
    cold = engine(ckpt[0])
    for order in ([0, 1, 2], [2, 0, 1], [1, 2]):
        out = llm.generate(
            [prompt(order)],
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, blend_ratio=1.0),
            use_tqdm=False,
        )[0]
        assert out.metrics.external_tokens == sum(len(DOCS[i]) for i in order)
        assert (
            out.token_ids
            == cold.generate(
                [flat(order)],
                SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                use_tqdm=False,
            )[0].token_ids
        )
    assert conn.stats.saved_chunks == 3  # one standalone KV per document, whatever the prompts
    changed = list(DOCS[0])
    changed[10] = (changed[10] + 1) % VOCAB
    assert conn.lookup_segments([DOCS[0], changed]) == [True, False]  # one token differs: a miss
    llm.generate(
        [[PromptPart(changed), PromptPart(QUESTION, reusable=False)]], GREEDY, use_tqdm=False
    )
    assert conn.stats.saved_chunks == 4


def test_segment_keys_position_free_and_same_in_another_process() -> None:
    salt = Salt("llama:test", "tkvs1/layer-major/float32/none", chunk_size=64)
    here = ChunkHasher(salt).segment_key(DOCS[0]).hex()
    code = (
        "from tierkv.storage_backends.keys import ChunkHasher, Salt; "
        "from tests.test_blend import DOCS; "
        "print(ChunkHasher(Salt('llama:test', 'tkvs1/layer-major/float32/none', chunk_size=64))"
        ".segment_key(DOCS[0]).hex())"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert here == there
    assert ChunkHasher(salt).segment_key(DOCS[1]) != here


def test_corrupt_segment_is_computed_not_blended(ckpt) -> None:
    tier = FaultTier(CpuTierConfig(capacity_bytes="32MiB"))
    conn = TierKVConnector(ConnectorConfig(chunk_size=64, segment_admit_after=1), tiers=[tier])
    try:
        llm = engine(ckpt[0], conn)
        llm.ingest(DOCS)
        tier.mode = "flip"
        out = llm.generate(
            [prompt([0, 1, 2])],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, blend_ratio=0.0),
            use_tqdm=False,
        )[0]
        cold = engine(ckpt[0]).generate(
            [flat([0, 1, 2])],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert out.token_ids == cold.token_ids  # nothing loaded: an ordinary prefill
        assert (
            conn.stats.load_misses == 3 and out.metrics.blend["loaded"] == 0
        )  # the tier found them corrupt
    finally:
        conn.close()


def test_random_rule_picks_a_seeded_share_of_the_rows() -> None:
    from tierkv.engine.blend import BlendParams
    from tierkv.engine.blend_rules import random_rows

    rows = torch.arange(10, 110)
    a, b = random_rows(rows, 0.15), random_rows(rows, 0.15)
    assert torch.equal(a, b) and a.numel() == 15 and bool((a[1:] > a[:-1]).all())
    assert set(a.tolist()) <= set(rows.tolist()) and random_rows(rows, 0.0).numel() == 0
    BlendParams(0.15, 1, "random")
    with pytest.raises(ValueError, match="blend_metric"):
        BlendParams(0.15, 1, "q")
