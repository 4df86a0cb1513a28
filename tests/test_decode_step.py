"""A decode step in one op call, or one per layer where the connector has per-layer work
(engine/decode_step.py, kernels/cpu_step.cpp): the same bits as the Python loop, in every dtype
and linear-layer path; it runs where it should and only there; a connector with per-layer work
sees every layer's load wait and save in order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tierkv.engine import LLM, SamplingParams
from tierkv.engine.models import pull
from tierkv.engine.noop_connector import NoOpConnector

CFG = dict(
    hidden_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=512,
)


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TIERKV_CPU_KERNEL", raising=False)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (5 + 7 * i,), generator=g).tolist() for i in range(n)]


def both_ways(model: str | dict, batch: list[list[int]], **kw: Any) -> list[list[torch.Tensor]]:
    """Every step's logits for the same requests, with the fused step and then, on the same
    engine, with the Python loop (no prefix cache: the second run computes what the first did)."""
    llm = LLM(model, enable_prefix_caching=False, **kw)
    run, seen = llm.runner.run, []

    def record(out):
        x = run(out)
        seen[-1].append(x.clone())
        return x

    llm.runner.run = record
    sp = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    assert llm.runner.fused is not None
    for fused in (llm.runner.fused, None):
        llm.runner.fused = fused
        seen.append([])
        llm.generate(batch, sp, use_tqdm=False)
    return seen


def fused_ran(llm: LLM, batch: list[list[int]]) -> int:
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(batch, sp, use_tqdm=False)
    layers = len(llm.runner.layer_caches)
    calls = {e.key: e.count for e in prof.key_averages()}
    return calls.get("tierkv::decode_layer", 0) + layers * calls.get("tierkv::decode_layers", 0)


@pytest.mark.parametrize(
    "dtype,matmul,bias,rows",
    [
        ("fp32", "auto", False, 3),
        ("bf16", "model", True, 3),  # the few-row kernel over the bf16 weight itself
        ("bf16", "float32", False, 5),  # widened weights, the few-row kernel over the narrow copy
        ("bf16", "float32", True, 12),  # past GEMV_ROWS: the widened GEMM inside the op
        ("bf16", "model", False, 20),  # past NATIVE_GEMV_ROWS: the bf16 GEMM inside the op
    ],
)
def test_fused_decode_equals_the_python_loop(
    dtype: str, matmul: str, bias: bool, rows: int
) -> None:
    batch = prompts(rows, CFG["vocab_size"])
    kw = dict(dtype=dtype, matmul_dtype=matmul, kv_cache_bytes=8 << 20, block_size=4)
    cfg = dict(CFG, attention_bias=bias)
    a, b = both_ways(cfg, batch, **kw)
    assert len(a) == len(b) > 6
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_fused_decode_equals_the_python_loop_on_smollm2() -> None:
    path = str(pull("smollm2", progress=False))
    batch = prompts(3, 40000, seed=1)
    kw = dict(dtype="bf16", kv_cache_bytes=32 << 20)
    a, b = both_ways(path, batch, **kw)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_fused_decode_runs_on_decode_steps_only() -> None:
    llm = LLM(dict(CFG), dtype="bf16", kv_cache_bytes=8 << 20)
    assert fused_ran(llm, prompts(2, CFG["vocab_size"])) == 3 * CFG["num_hidden_layers"]
    off = LLM(dict(CFG), dtype="bf16", kv_cache_bytes=8 << 20, fused_decode=False)
    assert off.runner.fused is None and fused_ran(off, prompts(2, CFG["vocab_size"])) == 0


@pytest.mark.parametrize(
    "kw,env",
    [
        (dict(kv_cache_dtype="fp8"), {}),  # an fp8 cache: the Python loop's write and decode
        (dict(cascade_attention=True), {}),  # cascade groups: the cascade kernel's steps
        ({}, {"TIERKV_CPU_KERNEL": "0"}),  # the torch reference
    ],
)
def test_fused_decode_stays_out_where_it_does_not_serve(monkeypatch, kw: dict, env: dict) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    llm = LLM(dict(CFG), dtype="bf16", kv_cache_bytes=8 << 20, block_size=4, **kw)
    shared = prompts(1, CFG["vocab_size"])[0] * 3  # a prefix that cascade groups share
    batch = [shared + [1, 2], shared + [3]]
    llm.generate([shared + [9]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert fused_ran(llm, batch) == 0


class Hooks(NoOpConnector):
    """A connector that records the per-layer hooks of each step (the contract's order)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def layer_work(self) -> bool:
        return True

    def wait_for_layer_load(self, layer: int) -> None:
        self.calls.append(("wait", layer))

    def save_kv_layer(self, layer: int, kv: torch.Tensor, ctx) -> None:  # type: ignore[override]
        self.calls.append(("save", layer))


def test_fused_decode_calls_the_connector_hooks_per_layer() -> None:
    hooks = Hooks()
    llm = LLM(dict(CFG), dtype="bf16", kv_cache_bytes=8 << 20, kv_connector=hooks)
    assert llm.runner.fused is not None
    llm.generate(prompts(2, CFG["vocab_size"]), SamplingParams(max_tokens=3), use_tqdm=False)
    layers = range(CFG["num_hidden_layers"])
    step = [c for i in layers for c in (("wait", i), ("save", i))]
    assert hooks.calls == step * 3  # the prefill and two decode steps
    calls = {e.key: e.count for e in profiled(llm, prompts(2, CFG["vocab_size"], seed=3))}
    assert calls.get("tierkv::decode_layers", 0) == 0 and calls["tierkv::decode_layer"] > 0


def test_one_call_and_one_call_per_layer_give_the_same_bits() -> None:
    batch = prompts(4, CFG["vocab_size"])
    kw: dict[str, Any] = dict(dtype="bf16", kv_cache_bytes=8 << 20, block_size=4)
    whole, loop = both_ways(dict(CFG), batch, **kw)
    per_layer, _ = both_ways(dict(CFG), batch, kv_connector=Hooks(), **kw)
    assert all(torch.equal(x, y) for x, y in zip(whole, per_layer)) and len(whole) > 6


def test_the_tierkv_connector_lets_decode_steps_run_in_one_call() -> None:
    """Its decode steps load and save nothing: one op call each. A second engine loads the
    prompts from the same tier: its first step computes each prompt's last token over the
    loaded KV, a step of decode rows with loads, so one call per layer with the hooks; the
    tokens are the first engine's."""
    from tierkv.connector import ConnectorConfig, TierKVConnector
    from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig

    tier = CpuTier(CpuTierConfig(capacity_bytes="64MiB"))
    batch = [p * 4 for p in prompts(2, CFG["vocab_size"])]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    texts, ops = [], []
    for _ in range(2):
        conn = TierKVConnector(ConnectorConfig(chunk_size=8), tiers=[tier])
        llm = LLM(dict(CFG), dtype="fp32", kv_cache_bytes=8 << 20, block_size=8, kv_connector=conn)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            texts.append([o.token_ids for o in llm.generate(batch, sp, use_tqdm=False)])
        calls = {e.key: e.count for e in prof.key_averages()}
        ops.append((calls.get("tierkv::decode_layers", 0), calls.get("tierkv::decode_layer", 0)))
    layers = CFG["num_hidden_layers"]
    assert ops == [(5, 0), (5, layers)] and conn.stats.loaded_tokens > 0
    assert texts[0] == texts[1]


def profiled(llm: LLM, batch: list[list[int]]) -> list[Any]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(batch, SamplingParams(max_tokens=3), use_tqdm=False)
    return list(prof.key_averages())
