"""The C++ prefill attention (kernels/cpu_prefill.cpp) against a masked-softmax reference, in
the engine against Hugging Face transformers, and the linear layers widened to fp32 for a bf16
model (kernels/layer_ops.native_matmul). A failed build fails these tests; it never skips them."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.engine import LLM, SamplingParams
from tierkv.kernels import AttentionMeta, LayerCache, cpu, paged_attention, paged_attention_ref
from tierkv.kernels.layer_ops import linear, native_matmul

pytestmark = pytest.mark.cpu_path


@pytest.fixture(autouse=True)
def _cpu_path(monkeypatch):
    monkeypatch.delenv("TIERKV_CPU_KERNEL", raising=False)
    assert cpu.load(), "the C++ CPU kernels did not build: see the log above"


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """fp32 attention of q [Nq, Hq, D] over k, v [T, Hkv, D]; query i sees keys j <= pos[i]."""
    g = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    seen = torch.arange(k.shape[0])[None, :] <= pos[:, None]
    p = s.masked_fill(~seen[None], float("-inf")).softmax(-1).nan_to_num(0.0)  # no key: zeros
    return torch.einsum("hqk,khd->qhd", p, vf)


def assert_within(got, ref, q, k, v, pos, scale) -> None:
    if got.dtype == torch.float32:  # the same math in another order
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
        return
    # bf16: products exact in fp32 (or bf16 pairs summed in fp32: AVX512-BF16), the softmax
    # weights rounded to bf16 for the products with V on that path (each within 2^-9 of
    # itself: the output within 2^-9 of sum_j p_j |v_j|), the output rounded (2^-9)
    spread = reference(q, k, v.abs(), pos, scale)
    err = (got.float() - ref).abs()
    bound = spread * 2**-8 + ref.abs() * 2**-8 + 1e-6
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"


def inputs(nq: int, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(nq, hq + 2, d, generator=g).to(dtype)  # rows of q apart by more than Hq * D
    q = wide[:, 1 : 1 + hq]
    k, v = (torch.randn(t, hkv, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "nq,t,hq,hkv,d",
    [
        (37, 37, 8, 2, 64),
        (100, 300, 8, 2, 64),
        (5, 70, 4, 4, 128),
        (64, 64, 8, 1, 64),
        (3, 1000, 6, 2, 64),
    ],
)
def test_prefill_kernel_matches_reference(dtype, nq, t, hq, hkv, d):
    q, k, v = inputs(nq, t, hq, hkv, d, dtype)
    pos = (
        torch.arange(nq)
        if nq == t
        else torch.randint(0, t + 5, (nq,), generator=torch.Generator().manual_seed(1))
    )
    assert cpu.prefill_usable(q, k, v)
    got, ref = cpu.prefill_attention(q, k, v, pos, d**-0.5), reference(q, k, v, pos, d**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    assert_within(got, ref, q, k, v, pos, d**-0.5)
    assert torch.equal(
        cpu.prefill_attention(q, k, v, pos, d**-0.5), got
    )  # deterministic across threads


@settings(max_examples=40, deadline=None)
@given(
    nq=st.integers(1, 40),
    t=st.integers(1, 140),
    hkv=st.sampled_from([1, 2, 4]),
    g=st.sampled_from([1, 2, 3, 4]),
    d=st.sampled_from([64, 128]),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_prefill_kernel_property(nq, t, hkv, g, d, seed, dtype):
    q, k, v = inputs(nq, t, hkv * g, hkv, d, dtype, seed)
    pos = torch.randint(0, t + 3, (nq,), generator=torch.Generator().manual_seed(seed))
    got = cpu.prefill_attention(q, k, v, pos, 0.1)
    assert_within(got, reference(q, k, v, pos, 0.1), q, k, v, pos, 0.1)


def test_prefill_kernel_edges_and_bad_input():
    q, k, v = inputs(4, 9, 4, 2, 64, torch.float32)
    assert torch.equal(
        cpu.prefill_attention(q, k[:0], v[:0], torch.arange(4), 0.1), torch.zeros(4, 4, 64)
    )
    assert cpu.prefill_attention(q[:0], k, v, torch.arange(0), 0.1).shape == (0, 4, 64)
    with pytest.raises(RuntimeError, match="negative position"):
        cpu.prefill_attention(q, k, v, torch.tensor([0, 1, -1, 2]), 0.1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu.prefill_attention(q, k.bfloat16(), v.bfloat16(), torch.arange(4), 0.1)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu.prefill_attention(q[:, :3], k, v, torch.arange(4), 0.1)
    with pytest.raises(RuntimeError, match="pos must be"):
        cpu.prefill_attention(q, k, v, torch.arange(3), 0.1)
    odd = torch.randn(4, 4, 80)
    assert not cpu.prefill_usable(
        odd, torch.randn(9, 2, 80), torch.randn(9, 2, 80)
    )  # SDPA serves D=80
    assert not cpu.prefill_usable(q.half(), k.half(), v.half())


def test_paged_prefill_through_kernel_matches_torch_path():
    """Chunks over a cached prefix and sparse rows (CacheBlend's) through the paged entry point."""
    g = torch.Generator().manual_seed(3)
    bs, nb, hkv, d = 16, 40, 2, 64
    kc, vc = (torch.randn(nb, bs, hkv, d, generator=g) for _ in range(2))
    tables = torch.randperm(nb, generator=g)[:24].view(2, 12).int()
    lens = torch.tensor([150, 190], dtype=torch.int32)
    pos = torch.cat(
        [torch.arange(100, 150), torch.sort(torch.randperm(190, generator=g)[:30]).values]
    ).int()
    cu = torch.tensor([0, 50, 80], dtype=torch.int32)
    q = torch.randn(80, 8, d, generator=g)
    cache, meta = LayerCache(kc, vc), AttentionMeta(tables, lens, cu, pos)
    got = paged_attention(q, cache, meta, 0.125)
    ref = paged_attention_ref(q, cache, meta, 0.125)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


def hf_checkpoint(path, **over):
    torch.manual_seed(0)
    cfg = dict(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=300,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    cfg.update(over)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    model.save_pretrained(path)
    return model


def test_engine_with_prefill_kernel_matches_hf(tmp_path, monkeypatch):
    """head_dim 64: whole prompts and chunks over a cached prefix go through the kernel (fp32)."""
    hf = hf_checkpoint(tmp_path)
    calls = []
    real = cpu.prefill_attention
    monkeypatch.setattr(
        cpu, "prefill_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (70, 130)]
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    llm = LLM(tmp_path, dtype="fp32", kv_cache_bytes=1 << 24, max_num_batched_tokens=64)  # chunked
    got = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    assert [o.token_ids for o in got] == want
    assert calls and max(calls) > 1


def test_native_matmul_follows_cpu_flags():
    assert native_matmul(torch.float32, torch.device("cpu"))
    assert native_matmul(torch.bfloat16, torch.device("cpu")) == bool(
        {"avx512_bf16", "amx_bf16"} & cpu.cpu_flags()
    )
    assert native_matmul(torch.bfloat16, torch.device("cuda"))


def test_linear_widened_rounds_like_a_bf16_gemm():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(33, 64, generator=g).bfloat16(), torch.randn(48, 64, generator=g).bfloat16()
    got = linear(x, w.float())
    assert got.dtype == torch.bfloat16
    exact = x.double() @ w.double().T  # bf16 products are exact; only the sum order differs
    torch.testing.assert_close(got.double(), exact.bfloat16().double(), atol=1e-9, rtol=2**-7)


def test_engine_widened_matmuls_agree_with_bf16(tmp_path):
    """A bf16 model with its linear layers widened to fp32 against the same model in bf16 GEMMs:
    the embedding stays bf16, a tied lm_head gets its own fp32 copy, logits agree to bf16
    precision and greedy tokens mostly agree (32 of 32 here; a bf16 near-tie may flip one)."""
    hf_checkpoint(tmp_path, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    wide = LLM(tmp_path, dtype="bf16", matmul_dtype="float32", kv_cache_bytes=1 << 24)
    model = wide.runner.model
    assert (
        model.lm_head.weight.dtype == torch.float32
        and model.embed_tokens.weight.dtype == torch.bfloat16
    )
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert model.lm_head.weight.t().is_contiguous()  # stored column-major
    narrow = LLM(tmp_path, dtype="bf16", matmul_dtype="model", kv_cache_bytes=1 << 24)
    assert narrow.runner.model.lm_head.weight.dtype == torch.bfloat16
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (wide, narrow))
    same = sum(x == y for o, p in zip(a, b) for x, y in zip(o.token_ids, p.token_ids))
    assert same >= 0.9 * 32, (same, [o.token_ids for o in a], [o.token_ids for o in b])
    with pytest.raises(ValueError, match="matmul_dtype"):
        LLM(tmp_path, dtype="bf16", matmul_dtype="fp64")
