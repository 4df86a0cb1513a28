"""How reusable parts without a declared prefix are encoded (engine/encoding.py), on
SmolLM2-135M-Instruct in fp32 over pydoc pages: after the chat preamble by default (its KV
dropped), standalone on request; the two never share a key; ratio 1.0 is full prefill token
for token; each stored part is Hugging Face's KV of (preamble + part) less the preamble, and
ratio 0.0 is those parts' KV re-rotated and concatenated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import DynamicCache

from examples.rag_docs import cut, module_doc
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.connector.requests import request_state
from tierkv.engine import LLM, PromptPart, SamplingParams
from tierkv.engine.blend_step import BlendState
from tierkv.engine.models import pull
from tierkv.kernels import RotaryEmbedding, rerotate_k
from tierkv.storage_backends.build import TiersConfig

MODULES = ("colorsys", "textwrap", "secrets")


@pytest.fixture(scope="module")
def gguf() -> Path:
    return pull("smollm2", progress=False)


@pytest.fixture(scope="module")
def cold(gguf: Path) -> LLM:
    return LLM(
        str(gguf),
        dtype="fp32",
        kv_cache_bytes=32 << 20,
        enable_prefix_caching=False,
        blend_encoding="preamble",
    )


@pytest.fixture(scope="module")
def docs(cold: LLM) -> list[list[int]]:
    tok = cold.tokenizer
    assert tok is not None

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False)

    return [enc(cut(module_doc(m), lambda s: len(enc(s)), 100) + "\n\n") for m in MODULES]


@pytest.fixture(scope="module")
def question(cold: LLM) -> list[int]:
    assert cold.tokenizer is not None
    text = "Which module is about colors?<|im_end|>\n<|im_start|>assistant\n"
    return cold.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def conn():
    c = TierKVConnector(
        ConnectorConfig(chunk_size=64, tiers=TiersConfig(cpu_bytes="64MiB"), segment_admit_after=1)
    )
    yield c
    c.close()


def engine(gguf: Path, conn: TierKVConnector, encoding: str = "preamble") -> LLM:
    return LLM(
        str(gguf),
        dtype="fp32",
        kv_cache_bytes=32 << 20,
        enable_prefix_caching=False,
        kv_connector=conn,
        blend_encoding=encoding,
    )


def first(llm: LLM, prompt, params: SamplingParams) -> tuple[torch.Tensor, list[int], object]:
    seen: list[torch.Tensor] = []
    llm.logits_hooks.append(lambda logits: seen.append(logits.clone()))
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.logits_hooks.clear()
    return seen[-len(out.token_ids)][-1], out.token_ids, out.metrics  # after any ingest's


def greedy(n: int, ratio: float | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, blend_ratio=ratio)


def test_preamble_is_the_chat_templates_head(cold: LLM) -> None:
    tok = cold.tokenizer
    assert tok is not None
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    head = text[: text.index("hi")]
    assert head.startswith("<|im_start|>system\n") and head.endswith("<|im_start|>user\n")
    assert list(cold.segment_preamble) == tok.encode(head, add_special_tokens=False)
    assert cold.segment_preamble.count(tok.token_id("<|im_start|>")) == 2  # BOS not doubled


def test_encodings_never_share_a_key(gguf: Path, conn, docs: list[list[int]]) -> None:
    llm = engine(gguf, conn)
    pre = list(llm.segment_preamble)
    assert llm.ingest(docs[:2]) == 2
    assert conn.stats.saved_chunks == 2  # the parts only: the preamble's KV is dropped
    assert conn.lookup_segments(docs[:2], pre) == [True, True]
    assert conn.lookup_segments(docs[:2]) == [False, False]  # nothing under standalone keys
    assert llm.ingest(docs[:2]) == 0
    # The same tokens keyed by the connector: after the preamble, standalone, after a prefix.
    tokens = docs[0] + docs[1]
    spans = [(0, len(docs[0]), True), (len(docs[0]), len(tokens), True)]

    class Req:
        def __init__(self, blend: BlendState, ids: list[int]) -> None:
            self.request_id, self.token_ids, self.num_prompt_tokens = "r", ids, len(ids)
            self.blend, self.cache_salt = blend, None

    def keys(st: BlendState, ids: list[int]) -> list[bytes]:
        return [c.key for c in request_state(Req(st, ids), conn.hasher, True).chunks]  # type: ignore[arg-type]

    with_pre = keys(BlendState(spans, preamble=tuple(pre)), tokens)
    alone = keys(BlendState(spans), tokens)
    assert not set(with_pre) & set(alone)
    after = conn.hasher.prefix_key(np.asarray(pre, dtype=np.int32))
    assert with_pre == [conn.hasher.segment_key(d, after) for d in docs[:2]]
    assert alone == [conn.hasher.segment_key(d) for d in docs[:2]]
    # an ingest request (preamble + part) keys its one part the way a blend request does
    ingest = BlendState(
        [(len(pre), len(pre) + len(docs[0]), True)], ingest=True, preamble=tuple(pre)
    )
    assert keys(ingest, pre + docs[0]) == with_pre[:1]


def test_standalone_encoding_is_kept_apart(gguf: Path, conn, docs: list[list[int]]) -> None:
    llm = engine(gguf, conn, "standalone")
    assert llm.segment_preamble == ()
    assert llm.ingest(docs[:1]) == 1
    assert conn.lookup_segments(docs[:1]) == [True]
    assert conn.lookup_segments(docs[:1], list(engine_preamble(llm))) == [False]
    with pytest.raises(ValueError, match="blend_encoding"):
        LLM(str(gguf), dtype="fp32", kv_cache_bytes=1 << 20, blend_encoding="sink")


def engine_preamble(llm: LLM) -> tuple[int, ...]:
    from tierkv.engine.encoding import preamble

    return preamble(llm.tokenizer)


def test_ratio_one_is_full_prefill_token_for_token(
    gguf: Path, cold: LLM, conn, docs: list[list[int]], question: list[int]
) -> None:
    order = [2, 0, 1]
    ref, ref_tokens, _ = first(cold, sum((docs[i] for i in order), []) + question, greedy(8))
    llm = engine(gguf, conn)
    parts = [PromptPart(docs[i]) for i in order] + [PromptPart(question, reusable=False)]
    got, tokens, m = first(llm, parts, greedy(8, 1.0))
    loaded = sum(map(len, docs))
    assert m.blend["loaded"] == m.blend["recomputed"] == loaded  # type: ignore[attr-defined]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens


def test_ratio_zero_is_the_preamble_encoded_kv(
    gguf: Path, conn, docs: list[list[int]], question: list[int]
) -> None:
    """Each stored part is HF's KV of (preamble + part) at the part's positions; a blend at 0.0
    is the question over those KVs re-rotated to their offsets and concatenated."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    llm = engine(gguf, conn)
    pre = list(llm.segment_preamble)
    llm.ingest(docs)
    after = conn.hasher.prefix_key(np.asarray(pre, dtype=np.int32))
    cfg = llm.model_config
    rope = RotaryEmbedding(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
    )
    order, cache, off = [1, 2, 0], DynamicCache(), 0
    per_layer: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [
        ([], []) for _ in range(cfg.num_hidden_layers)
    ]
    with torch.no_grad():
        for i in order:
            seg = conn.loop.run(conn.store.get(conn.hasher.segment_key(docs[i], after), conn.ns))
            assert seg is not None and seg.header.base_position == len(pre)
            pkv = hf(torch.tensor([pre + docs[i]]), use_cache=True).past_key_values
            for layer in range(cfg.num_hidden_layers):
                k = pkv.layers[layer].keys[0, :, len(pre) :].transpose(0, 1)  # [T, Hkv, D]
                v = pkv.layers[layer].values[0, :, len(pre) :].transpose(0, 1)
                torch.testing.assert_close(seg.payload[layer, 0], k, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(seg.payload[layer, 1], v, rtol=1e-4, atol=1e-4)
                per_layer[layer][0].append(rerotate_k(k, off - len(pre), rope))
                per_layer[layer][1].append(v)
            off += len(docs[i])
        for layer, (ks, vs) in enumerate(per_layer):
            cache.update(
                torch.cat(ks).transpose(0, 1)[None], torch.cat(vs).transpose(0, 1)[None], layer
            )
        pos = torch.arange(off, off + len(question))[None]
        ref = hf(torch.tensor([question]), cache=cache, position_ids=pos).logits[0, -1]
    parts = [PromptPart(docs[i]) for i in order] + [PromptPart(question, reusable=False)]
    got, _, m = first(llm, parts, greedy(1, 0.0))
    assert m.blend == {"loaded": off, "recomputed": 0, "computed": len(question), "full_layers": 0}  # type: ignore[attr-defined]
    torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)
