"""The few-row linear layer over bf16 weights (kernels/cpu_gemv.cpp) against torch's fp32 math,
its bad input, and the engine using it for decode steps of a widened bf16 model. A failed
build fails these tests; it never skips them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from tierkv.engine import LLM, SamplingParams
from tierkv.engine.decode_step import fused_layers
from tierkv.engine.model import Linear
from tierkv.kernels import cpu, layer_ops
from tierkv.kernels.layer_ops import GEMV_ROWS, NATIVE_GEMV_ROWS, linear

pytestmark = pytest.mark.cpu_path


@pytest.fixture(autouse=True)
def _cpu_path(monkeypatch):
    monkeypatch.delenv("TIERKV_CPU_KERNEL", raising=False)
    assert cpu.load(), "the C++ CPU kernels did not build: see the log above"


def operands(m: int, n: int, k: int, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(0, GEMV_ROWS),
    n=st.integers(1, 70),
    k16=st.integers(1, 12),
    seed=st.integers(0, 99),
    bias=st.booleans(),
)
def test_fp32_rows_match_torch(m: int, n: int, k16: int, seed: int, bias: bool) -> None:
    """fp32 x: the same sums as torch's fp32 GEMM over the widened weights, in another order."""
    x, w, b = operands(m, n, 16 * k16, seed, bias)
    got = torch.ops.tierkv.gemv_bf16(x, w, b)
    ref = torch.nn.functional.linear(x, w.float(), b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "m,n,k", [(1, 768, 512), (3, 2816, 512), (8, 512, 1408), (5, 37, 64), (16, 963, 576)]
)
def test_bf16_rows_are_one_rounding_of_the_fp32_result(m: int, n: int, k: int) -> None:
    x, w, b = operands(m, n, k, 1, True)
    xb = x.to(torch.bfloat16)
    got = torch.ops.tierkv.gemv_bf16(xb, w, b)
    exact = torch.nn.functional.linear(xb.double(), w.double(), b.double())
    assert got.dtype == torch.bfloat16
    # one bf16 rounding (half a step, 2^-9 relative) plus fp32 summation error
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    ref = torch.nn.functional.linear(xb.float(), w.float(), b).to(torch.bfloat16)
    assert (got == ref).float().mean() > 0.99  # torch's fp32 GEMM, rounded: equal but for ties


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(0, NATIVE_GEMV_ROWS + 5),
    n=st.integers(1, 70),
    k16=st.integers(1, 12),
    seed=st.integers(0, 99),
    bias=st.booleans(),
)
def test_bf16_rows_property(m: int, n: int, k16: int, seed: int, bias: bool) -> None:
    """bf16 x of any row count and shape (K % 32 != 0 too, where the AVX512-BF16 path hands
    over to the widening one): within one rounding of the exact result."""
    x, w, b = operands(m, n, 16 * k16, seed, bias)
    xb = x.to(torch.bfloat16)
    got = torch.ops.tierkv.gemv_bf16(xb, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    exact = torch.nn.functional.linear(xb.double(), w.double(), None if b is None else b.double())
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()


def test_bad_input_is_an_error() -> None:
    x, w, _ = operands(2, 8, 64, 0, False)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.tierkv.gemv_bf16(x, w.float(), None)
    with pytest.raises(RuntimeError, match="K"):
        torch.ops.tierkv.gemv_bf16(x[:, :63], w[:, :63].contiguous(), None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        torch.ops.tierkv.gemv_bf16(x, w[:, :32].contiguous(), None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.tierkv.gemv_bf16(x, w, torch.zeros(7))
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        torch.ops.tierkv.gemv_bf16(x.double(), w, None)


def test_linear_dispatch_by_rows(monkeypatch) -> None:
    """Up to GEMV_ROWS rows read the bf16 weights, more the widened ones; both the same math."""
    calls = []
    inner = torch.ops.tierkv.gemv_bf16

    class Ops:
        @staticmethod
        def gemv_bf16(*a):
            calls.append(a[0].shape[0])
            return inner(*a)

    monkeypatch.setattr(layer_ops.torch.ops, "tierkv", Ops)
    _, w, b = operands(1, 96, 128, 2, True)
    wide = w.float().t().contiguous().t()
    for m in (1, GEMV_ROWS, GEMV_ROWS + 1, 40):
        x = torch.randn(m, 128).to(torch.bfloat16)
        got = linear(x, wide, b, narrow=w)
        ref = torch.nn.functional.linear(x.float(), wide, b).to(torch.bfloat16)
        assert (got == ref).float().mean() > 0.99
    assert calls == [1, GEMV_ROWS]


def test_engine_decodes_through_the_bf16_weights() -> None:
    """A bf16 model widened to fp32 keeps its bf16 weights (the tied lm_head shares the
    embedding's), decodes through them, and gives the greedy tokens of the fp32-only path."""
    cfg = dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(cfg, dtype="bfloat16", matmul_dtype="float32", kv_cache_bytes=8 << 20)
    model = llm.runner.model
    assert model.lm_head.narrow.data_ptr() == model.embed_tokens.weight.data_ptr()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(
        m.narrow is not None
        and m.narrow.dtype == torch.bfloat16
        and m.weight.dtype == torch.float32
        for m in linears
    )
    ops = llm.runner.ops
    assert ops.backend == "cpp" and ops.cpp  # bound once, when the engine was made

    def run() -> tuple[list[int], int]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            tokens = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
        calls = sum(e.count for e in prof.key_averages() if e.key == "tierkv::gemv_bf16")
        return tokens, calls

    with_gemv, calls = run()
    assert calls >= 23 * len(linears)  # every decode step's every linear layer
    model.bind(dataclasses.replace(ops, cpp=False))  # the same kernels but the fp32 GEMMs
    assert model.ops is not None
    llm.runner.fused = fused_layers(model, model.ops, llm.runner.kv_dtype)  # None: no cpp
    without, calls = run()
    assert calls == 0
    assert with_gemv == without
