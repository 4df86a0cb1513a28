"""Engine API, sampler, stop conditions, bad input, fp8 KV and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.test_hf_match import save_checkpoint
from tierkv.engine import LLM, SamplingParams
from tierkv.engine.config import EngineConfig, ModelConfig
from tierkv.engine.sampler import filter_logits

pytestmark = pytest.mark.triton_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tok")
    save_checkpoint(path, eos_token_id=3)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="fp32", kv_cache_bytes=1 << 22)


def test_text_prompt_and_tokenizer(llm):
    out = llm.generate("w5 w6 w7 w8", GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == [5, 6, 7, 8] and len(out.token_ids) == 8
    assert out.text == llm.tokenizer.decode(out.token_ids) and out.text
    assert out.metrics.ttft > 0 and out.metrics.decode_time > 0 and out.metrics.prompt_tokens == 4


def test_stop_tokens_eos_and_max_tokens(llm):
    free = llm.generate(
        [[9, 10, 11]],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0].token_ids
    stop = free[4]
    cut = llm.generate(
        [[9, 10, 11]],
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert cut.token_ids == free[: free.index(stop) + 1] and cut.outputs[0].finish_reason == "stop"
    assert (
        llm.generate(
            [[9, 10, 11]],
            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .finish_reason
        == "length"
    )
    # eos (3 in this checkpoint) stops unless ignore_eos
    llm.scheduler.eos = {stop}
    try:
        eos = llm.generate(
            [[9, 10, 11]], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
        )[0]
        assert eos.token_ids == free[: free.index(stop) + 1]
    finally:
        llm.scheduler.eos = {3}


def test_seeded_sampling_reproducible_and_filters(llm):
    sp = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, max_tokens=10, seed=11, ignore_eos=True
    )
    a = llm.generate([[1, 2, 3], [4, 5]], sp, use_tqdm=False)
    b = llm.generate([[4, 5], [1, 2, 3]], sp, use_tqdm=False)  # batch order does not matter
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [True, True, False, False]
    # softmax of [0,1,2,3] = .03 .09 .24 .64: top_p 0.7 keeps 3 and 2, 0.5 keeps 3 alone
    assert torch.isinf(filter_logits(logits, 0, 0.7)).tolist() == [True, True, False, False]
    assert torch.isinf(filter_logits(logits, 0, 0.5)).tolist() == [True, True, True, False]
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        draws = {
            int(torch.multinomial(filter_logits(logits, 1, 1.0).softmax(-1), 1, generator=g))
            for _ in range(20)
        }
    assert draws == {3}


def test_bad_input_is_refused_and_changes_nothing(llm, ckpt):
    before = (list(llm.blocks.ref), len(llm.scheduler.waiting))
    for bad in ([[]], [[1, 999]], [[-1]], [[1.5]]):
        with pytest.raises(ValueError):
            llm.generate(bad, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate([[1] * 600], GREEDY, use_tqdm=False)  # past max_position_embeddings (512)
    with pytest.raises(ValueError):
        llm.generate([[1], [2]], [GREEDY], use_tqdm=False)
    assert (list(llm.blocks.ref), len(llm.scheduler.waiting)) == before
    llm.check_integrity()
    for kw in (dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(n=0), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
    for kw in (
        dict(block_size=12),
        dict(kv_cache_dtype="int4"),
        dict(dtype="fp64"),
        dict(kv_cache_bytes=0),
    ):
        with pytest.raises(ValueError):
            EngineConfig(**kw)
    with pytest.raises(ValueError, match="less than one block"):
        LLM(ckpt, dtype="fp32", kv_cache_bytes=100)
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_dict(
            dict(
                model_type="gpt2",
                hidden_size=8,
                num_hidden_layers=1,
                num_attention_heads=1,
                intermediate_size=8,
                vocab_size=8,
            )
        )


def test_a_sequence_larger_than_the_cache_fails_clearly(ckpt):
    small = LLM(ckpt, dtype="fp32", kv_cache_bytes=2 * 8192)  # 2 blocks of 16 tokens
    with pytest.raises(RuntimeError, match="more KV blocks"):
        small.generate([[1] * 40], GREEDY, use_tqdm=False)


def test_random_config_dtypes():
    cfg = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=64,
    )
    for dtype in ("fp16", "bf16"):
        e = LLM(cfg, dtype=dtype, kv_cache_bytes=1 << 20)
        assert e.runner.kv_caches[0].dtype == e.dtype
        out = e.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
        assert len(out.token_ids) == 8 and all(0 <= t < 64 for t in out.token_ids)


def test_fp8_kv_agrees_with_bf16_kv(ckpt):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (12, 30, 47, 64)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    bf16 = LLM(ckpt, dtype="bf16", kv_cache_bytes=1 << 22).generate(prompts, sp, use_tqdm=False)
    e8 = LLM(ckpt, dtype="bf16", kv_cache_dtype="fp8", kv_cache_bytes=1 << 22)
    assert e8.runner.kv_caches[0].dtype == torch.float8_e4m3fn and e8.runner.kv_scales.shape == (
        2,
        2,
        2,
    )
    fp8 = e8.generate(prompts, sp, use_tqdm=False)
    same = sum(a == b for x, y in zip(bf16, fp8) for a, b in zip(x.token_ids, y.token_ids))
    agreement = same / (32 * len(prompts))
    print(f"fp8 vs bf16 KV greedy token agreement: {agreement:.3f}")
    assert agreement >= 0.75


def test_cli(ckpt):
    cmd = [
        sys.executable,
        "-m",
        "tierkv.engine.cli",
        "generate",
        "--model",
        str(ckpt),
        "--prompt",
        "w1 w2 w3",
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--dtype",
        "fp32",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    metrics = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(metrics["token_ids"]) == 4 and metrics["prompt_tokens"] == 3 and "ttft" in metrics
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierkv.engine.cli",
            "generate",
            "--random-config",
            "tiny",
            "--prompt",
            "hello",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "tokenizer" in bad.stderr
