"""The engine against Hugging Face transformers on the same random checkpoint (fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tierkv.engine import LLM, SamplingParams
from tierkv.engine.scheduler import SchedulerOutput
from tierkv.engine.sequence import Sequence

VOCAB = 256
LENS = [5, 17, 33, 48, 70]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def save_checkpoint(path: Path, kind: str = "llama", **over) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    common.update(over)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model.eval().save_pretrained(path, max_shard_size="100KB")  # sharded: exercises the index
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, save_checkpoint(path)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENS]


@pytest.fixture(scope="module")
def hf_tokens(ckpt, prompts):
    _, hf = ckpt
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]


def all_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one prefill step of the engine."""
    seq = Sequence(0, "x", "x", list(prompt), len(prompt), GREEDY)
    llm.blocks.allocate(seq, len(prompt))
    out = SchedulerOutput([seq], [len(prompt)])
    h = llm.runner.forward(out)
    llm.blocks.free_seq(seq)
    return llm.runner.model.logits(h[: len(prompt)])  # rows past the prompt are padding


@pytest.mark.parametrize(
    "kind,over",
    [
        ("llama", {}),
        (
            "llama",
            dict(
                tie_word_embeddings=True,
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=500000.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=64,
                ),
            ),
        ),
        ("qwen2", dict(tie_word_embeddings=True)),
    ],
)
def test_prefill_logits_match(tmp_path, kind, over, prompts):
    hf = save_checkpoint(tmp_path, kind, **over)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1, "checkpoint should be sharded"
    llm = LLM(tmp_path, dtype="fp32", kv_cache_bytes=1 << 22)
    for p in prompts[2:]:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        torch.testing.assert_close(all_logits(llm, p), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.triton_path
def test_greedy_alone_and_batched(ckpt, prompts, hf_tokens):
    llm = LLM(ckpt[0], dtype="fp32", kv_cache_bytes=1 << 22, enable_prefix_caching=False)
    for i in (0, 2, 4):  # alone: shortest, middle, longest
        assert llm.generate([prompts[i]], GREEDY, use_tqdm=False)[0].token_ids == hf_tokens[i]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_tokens
    assert all(
        o.metrics.prompt_tokens == len(p) and o.metrics.cached_tokens == 0
        for o, p in zip(outs, prompts)
    )
    llm.check_integrity()


@pytest.mark.triton_path
def test_prefix_cache_hits_same_tokens(ckpt, prompts):
    _, hf = ckpt
    shared = prompts[4][:40]
    batch = [shared + p[:9] for p in prompts]
    with torch.no_grad():
        refs = [
            hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p) :].tolist()
            for p in batch
        ]
    llm = LLM(ckpt[0], dtype="fp32", kv_cache_bytes=1 << 22)
    first = llm.generate(batch[:1], GREEDY, use_tqdm=False)[0]
    assert first.token_ids == refs[0] and first.metrics.cached_tokens == 0
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert all(o.metrics.cached_tokens >= 32 for o in outs)  # two full blocks of the shared prefix
    # 45-token prompt: the last token is recomputed, so 2 of its blocks (32 tokens) hit
    assert outs[0].metrics.cached_tokens == 32 and outs[0].metrics.computed_tokens == 45 - 32 + 31
    tree = llm.blocks.tree
    assert tree.stats.hit_tokens > 0 and 0 < tree.stats.hit_rate < 1
    llm.check_integrity()


def test_chunked_prefill(ckpt, prompts, hf_tokens):
    llm = LLM(ckpt[0], dtype="fp32", kv_cache_bytes=1 << 22, max_num_batched_tokens=7)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_tokens
    llm.check_integrity()


def test_preemption_by_recompute(ckpt, prompts, hf_tokens):
    # 2 layers * 2 (K, V) * 16 tokens * 2 heads * 16 dims * 4 bytes = 8 KiB per block; 9 blocks.
    llm = LLM(ckpt[0], dtype="fp32", kv_cache_bytes=9 * 8192, enable_prefix_caching=True)
    assert llm.runner.num_blocks == 9
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_tokens
    assert sum(o.metrics.preemptions for o in outs) > 0
    assert sum(o.metrics.computed_tokens for o in outs) > sum(
        len(p) + 31 for p in prompts
    )  # recomputed
    llm.check_integrity()


def test_parallel_sampling_copy_on_write(ckpt, prompts, hf_tokens):
    llm = LLM(ckpt[0], dtype="fp32", kv_cache_bytes=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, n=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, ref in zip(outs, hf_tokens):
        assert [c.token_ids for c in o.outputs] == [ref] * 3
    llm.check_integrity()
    assert sorted(llm.blocks.free) != list(range(llm.runner.num_blocks)) or llm.blocks.tree is None
    # sampled n > 1 with a seed: different samples, reproducible
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=3, seed=7)
    a = llm.generate(prompts[:2], sp, use_tqdm=False)
    b = llm.generate(prompts[:2], sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [
        [c.token_ids for c in o.outputs] for o in b
    ]
    assert len({tuple(c.token_ids) for c in a[1].outputs}) > 1


TRITON_SCRIPT = """
import json, sys
from tierkv.engine import LLM, SamplingParams
prompts = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], dtype="fp32", kv_cache_bytes=1 << 20, max_num_batched_tokens=24)
params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
outs = llm.generate(prompts, params, use_tqdm=False)
print(json.dumps([o.token_ids for o in outs]))
"""


def test_triton_interpreter_matches_torch_path(ckpt, prompts):
    # TRITON_INTERPRET must be set before triton is imported, so the Triton run is a subprocess.
    # fp32 only: under the interpreter a bf16 tl.dot gives garbage.
    small = [p[:n] for p, n in zip(prompts[1:4], (17, 9, 30))]  # chunked (budget 24), decode, mixed
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT, str(ckpt[0]), json.dumps(small)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    triton_tokens = json.loads(res.stdout.strip().splitlines()[-1])
    llm = LLM(ckpt[0], dtype="fp32", kv_cache_bytes=1 << 20, max_num_batched_tokens=24)
    outs = llm.generate(
        small, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert triton_tokens == [o.token_ids for o in outs]
