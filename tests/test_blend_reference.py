"""CacheBlend's selective recompute at intermediate ratios against the independent dense
reference (tests/blend_dense.py, Hugging Face transformers' own modules in fp32): layers before
the check layer in full, the check layer's fresh K ranks the loaded rows, and from there on
only the kept rows run, over cached K/V for the others. The other rules: test_blend_rules.py."""

from __future__ import annotations

import math

import pytest
import torch

from tests.blend_dense import Dense, Variant
from tests.test_blend import DOCS, QUESTION, ckpt, conn, engine, first_logits, prompt  # noqa: F401
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams, blend_rules
from tierkv.storage_backends.build import TiersConfig


@pytest.mark.parametrize(
    "ratio,check,gradual",
    [
        pytest.param(0.3, 1, 0, marks=pytest.mark.triton_path),
        (0.15, 2, 0),
        (0.6, 1, 0),
        (0.2, 1, 2),
    ],
)
def test_blend_matches_dense_reference(ckpt, conn, ratio: float, check: int, gradual: int) -> None:
    path, hf = ckpt
    order = [2, 0, 1]
    with torch.no_grad():
        ref, m = Dense(hf).blend(order, Variant("cacheblend", ratio, check, gradual))
    llm = engine(path, conn)
    llm.config.blend_gradual = gradual
    got, _, metrics = first_logits(
        llm,
        prompt(order),
        SamplingParams(
            max_tokens=1,
            temperature=0.0,
            ignore_eos=True,
            blend_ratio=ratio,
            blend_check_layer=check,
        ),
    )
    assert metrics.blend == {
        "loaded": sum(map(len, DOCS)),
        "recomputed": m,
        "computed": len(QUESTION),
        "full_layers": check,
    }
    torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)


def test_fp8_cache_blend(ckpt, conn, monkeypatch) -> None:
    """With an fp8 KV cache the check layer compares fresh K to the dequantized cached K: it
    picks mostly the rows the fp32 cache picks; ratio 1.0 gives the same engine's full-prefill
    logits, 0.15 recomputes its share and deviates less than 0.0."""
    path, _ = ckpt
    picked: list[set[int]] = []
    inner = blend_rules.select

    def select(fresh, cached, ratio):  # observes the ranking, changes nothing
        idx = inner(fresh, cached, ratio)
        picked.append(set(idx.tolist()))
        return idx

    monkeypatch.setattr(blend_rules, "select", select)
    order, loaded = [1, 0, 2], sum(map(len, DOCS))
    p15 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, blend_ratio=0.15)
    first_logits(engine(path, conn), prompt(order), p15)
    fp8_conn = TierKVConnector(
        ConnectorConfig(chunk_size=64, tiers=TiersConfig(cpu_bytes="32MiB"), segment_admit_after=1)
    )
    try:
        llm = LLM(
            str(path),
            dtype="float32",
            kv_cache_bytes=16 << 20,
            enable_prefix_caching=False,
            kv_cache_dtype="fp8",
            kv_connector=fp8_conn,
            blend_encoding="standalone",
            blend_calibration="off",
        )
        ref, _, _ = first_logits(
            llm,
            sum((DOCS[i] for i in order), []) + QUESTION,
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )
        kl = {}
        for r in (0.15, 1.0, 0.0):
            got, _, m = first_logits(
                llm,
                prompt(order),
                SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, blend_ratio=r),
            )
            assert m.blend["loaded"] == loaded and m.blend["recomputed"] == math.ceil(
                r * loaded - 1e-9
            )
            kl[r] = float(
                torch.nn.functional.kl_div(
                    got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum"
                )
            )
    finally:
        fp8_conn.close()
    assert len(picked[1] & picked[0]) >= 0.8 * len(picked[0]), (
        len(picked[1] & picked[0]),
        len(picked[0]),
    )
    assert kl[1.0] < 1e-6 and kl[0.15] < kl[0.0], kl
