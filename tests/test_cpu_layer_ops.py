"""The C++ RMSNorm and SiLU-and-mul ops (kernels/cpu_layer.cpp) against their torch
references (kernels/layer_ops.py). A failed build fails these tests; it never skips them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.kernels import cpu

pytestmark = pytest.mark.cpu_path


@pytest.fixture(autouse=True)
def _cpu_path(monkeypatch):
    monkeypatch.delenv("TIERKV_CPU_KERNEL", raising=False)
    assert cpu.load(), "the C++ CPU kernels did not build: see the log above"


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in bf16 steps (bf16 bit patterns of the same sign)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max()) if a.numel() else 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [512, 72, 37])  # vector rows, a tail of 8, a tail of 5
def test_rms_norm_op_matches_reference(dtype, d):
    from tierkv.kernels.layer_ops import rms_norm, rms_norm_ref

    g = torch.Generator().manual_seed(d)
    wide = (torch.randn(33, d + 9, generator=g) * 5).to(dtype)
    x = wide[:, 3 : 3 + d]  # rows apart by more than d: the engine passes views
    w = (torch.randn(d, generator=g) + 1).to(dtype)
    got, ref = rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)
    assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:  # only the sum of squares is added in another order
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)
    else:  # a rounding tie may fall the other way after the cast: at most one bf16 step
        assert bf16_ulps(got, ref) <= 1 and (got == ref).float().mean() > 0.999
    assert torch.equal(rms_norm(x[:0], w, 1e-5), ref[:0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [1408, 37])
def test_silu_mul_op_matches_reference(dtype, h):
    from tierkv.kernels.layer_ops import silu_mul, silu_mul_ref

    g = torch.Generator().manual_seed(h)
    x = (torch.randn(21, 2 * h, generator=g) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])  # exp's clamps
    got, ref = silu_mul(x), silu_mul_ref(x)
    assert got.shape == (21, h) and got.dtype == dtype and torch.isfinite(got).all()
    # exp within about 1 ulp, and 0 below -87: silu(-88.5) is -0 here, -3e-37 in torch.
    torch.testing.assert_close(got, ref, rtol=1e-5 if dtype == torch.float32 else 2**-8, atol=1e-30)
    assert dtype == torch.float32 or (got[1:] == ref[1:]).float().mean() > 0.999


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 40),
    d=st.integers(1, 70),
    scale=st.floats(0.01, 50.0),
    seed=st.integers(0, 2**16),
)
def test_layer_ops_property(n, d, scale, seed):
    from tierkv.kernels.layer_ops import rms_norm, rms_norm_ref, silu_mul, silu_mul_ref

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2 * d, generator=g) * scale
    w = torch.randn(d, generator=g)
    torch.testing.assert_close(
        rms_norm(x[:, :d], w, 1e-6), rms_norm_ref(x[:, :d], w, 1e-6), rtol=2e-6, atol=1e-6
    )
    torch.testing.assert_close(silu_mul(x), silu_mul_ref(x), rtol=1e-5, atol=1e-30)


def test_layer_ops_dispatch_and_reject_bad_arguments(monkeypatch):
    from tierkv.kernels.layer_ops import rms_norm, silu_mul

    x, w = torch.randn(4, 64), torch.randn(64)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.tierkv.rms_norm(x, w.bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.tierkv.rms_norm(x, w[:32], 1e-6)
    with pytest.raises(RuntimeError, match="2H"):
        torch.ops.tierkv.silu_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.tierkv.silu_mul(torch.randn(4, 8).half())
    # fp16 and a mismatched weight take the torch code; so does TIERKV_CPU_KERNEL=0, exactly.
    calls = []
    real = torch.ops.tierkv.rms_norm
    monkeypatch.setattr(
        torch.ops.tierkv, "rms_norm", lambda *a: calls.append(1) or real(*a), raising=False
    )
    rms_norm(x, w, 1e-6)
    rms_norm(x.half(), w.half(), 1e-6)
    rms_norm(x, w.double(), 1e-6)
    assert calls == [1]
    monkeypatch.setenv("TIERKV_CPU_KERNEL", "0")
    gu = torch.randn(4, 16)
    assert torch.equal(silu_mul(gu), torch.nn.functional.silu(gu[:, :8]) * gu[:, 8:])
