"""RoPE against transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb (incl. Llama-3
scaling), re-rotation of cached K, and the fp8 quantization bounds (torch references)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tierkv.kernels import (
    FP8,
    RotaryEmbedding,
    dequantize_fp8,
    fp8_scales,
    quantize_fp8,
    rerotate_k,
)

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# --- RoPE -------------------------------------------------------------------------------


def hf_rope(q, k, pos, theta, scaling, dtype):
    params = (
        {"rope_type": "default", "rope_theta": theta}
        if scaling is None
        else {**scaling, "rope_theta": theta}
    )
    cfg = LlamaConfig(
        hidden_size=q.shape[1] * q.shape[2],
        num_attention_heads=q.shape[1],
        head_dim=q.shape[2],
        max_position_embeddings=8192,
        rope_parameters=params,
    )
    rot = LlamaRotaryEmbedding(cfg)
    qh, kh = q.to(dtype).transpose(0, 1)[None], k.to(dtype).transpose(0, 1)[None]
    cos, sin = rot(qh, pos[None])
    a, b = apply_rotary_pos_emb(qh, kh, cos, sin)
    return a[0].transpose(0, 1), b[0].transpose(0, 1)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, LLAMA3])
@pytest.mark.parametrize("d", [64, 128])
def test_rope_matches_hf_fp32(scaling, d):
    g = torch.Generator().manual_seed(d)
    q, k = torch.randn(40, 8, d, generator=g), torch.randn(40, 2, d, generator=g)
    pos = torch.randint(0, 8000, (40,), generator=g)
    rope = RotaryEmbedding(d, 500000.0, scaling)
    got = rope.apply(q, k, pos)
    want = hf_rope(
        q, k, pos, 500000.0, None if scaling == {"rope_type": "default"} else scaling, torch.float32
    )
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def test_rope_bf16_rounds_fp32_result():
    # We compute in fp32 and round once; HF rotates in bf16. Ours is the fp32 result, rounded.
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(30, 4, 64, generator=g).bfloat16(),
        torch.randn(30, 2, 64, generator=g).bfloat16(),
    )
    pos = torch.randint(0, 4000, (30,), generator=g)
    rope = RotaryEmbedding(64, 10000.0, LLAMA3)
    got = rope.apply(q, k, pos)
    want = hf_rope(q.float(), k.float(), pos, 10000.0, LLAMA3, torch.float32)
    assert got[0].dtype == torch.bfloat16
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y.bfloat16(), atol=0, rtol=0)


def test_rope_positions_beyond_table_and_errors():
    rope = RotaryEmbedding(64, max_position=16)
    q, k = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    far = rope.apply(q, k, torch.tensor([5, 100]))
    want = hf_rope(q, k, torch.tensor([5, 100]), 10000.0, None, torch.float32)
    torch.testing.assert_close(far[0], want[0], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError):
        rope.apply(q, k, torch.tensor([-1, 2]))
    with pytest.raises(ValueError):
        RotaryEmbedding(64, rope_scaling={"rope_type": "yarn"})
    with pytest.raises(ValueError):
        RotaryEmbedding(64, rope_scaling={"rope_type": "llama3", "factor": 8.0})


@pytest.mark.parametrize("delta", [7, -3, 1500, "per_token"])
def test_rerotate_equals_rotation_at_shifted_positions(delta):
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(64, 500000.0, LLAMA3)
    n = 50
    k = torch.randn(n, 2, 64, generator=g)
    base = torch.arange(3, 3 + n)
    d = torch.randint(-3, 2000, (n,), generator=g) if delta == "per_token" else delta
    shifted = base + d
    _, k_at_base = rope.apply(k[:, :1], k, base)
    _, want = rope.apply(k[:, :1], k, shifted)
    torch.testing.assert_close(rerotate_k(k_at_base, d, rope), want, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(
        rerotate_k(rerotate_k(k_at_base, d, rope), -d, rope), k_at_base, atol=2e-4, rtol=1e-4
    )
    with pytest.raises(ValueError):
        rerotate_k(k, torch.zeros(3, dtype=torch.long), rope)


# --- fp8 ----------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.floats(1e-3, 1e4), st.integers(0, 2**16))
def test_fp8_roundtrip_bounds(n, h, mag, seed):
    x = torch.randn(n, h, 16, generator=torch.Generator().manual_seed(seed)) * mag
    s = fp8_scales(x, 1)
    assert s.shape == (h,)
    q = quantize_fp8(x, s)
    assert q.dtype == FP8 and q.float().abs().max() <= 448
    back = dequantize_fp8(q, s, torch.float32)
    # e4m3: 3 mantissa bits (relative error <= 2^-4 for normals); subnormal step 2^-9 * scale.
    assert ((back - x).abs() <= x.abs() * 2**-4 + s.view(-1, 1) * 2**-9).all()


def test_fp8_saturates_and_checks():
    s = torch.tensor([1.0])
    q = quantize_fp8(torch.tensor([[[1e6, -1e6, 3.0]]]), s)
    assert q.float().tolist() == [[[448.0, -448.0, 3.0]]]
    assert fp8_scales(torch.zeros(2, 3, 4), 1).gt(0).all()
    with pytest.raises(ValueError):
        quantize_fp8(torch.ones(2, 3, 4), torch.ones(2))
    with pytest.raises(ValueError):
        dequantize_fp8(torch.ones(2, 3, 4), torch.ones(3))
