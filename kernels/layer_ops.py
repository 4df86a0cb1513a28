"""The model's per-layer ops: RMSNorm, SiLU-and-multiply, and the linear layers' dtype choice.

On a CPU RMSNorm and SiLU-and-multiply are one C++ pass each (cpu_layer.cpp) where torch
runs 4-7 ops over the whole batch; elsewhere, or with the library off, the torch references
below run. The references are
Hugging Face's expressions, which the C++ ops follow within fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierkv.kernels import cpu

FLOATS = (torch.float32, torch.bfloat16)  # fp16 runs the torch code


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF order: normalize in fp32, cast back, then scale (bit-identical to HF in fp32)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2H] (gate, up) -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _usable(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and cpu.enabled()
        and x.dim() == 2
        and x.stride(1) == 1
        and x.dtype in FLOATS
        and cpu.load()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [N, D] with weight [D]."""
    if _usable(x) and weight.dtype == x.dtype and weight.dim() == 1 and weight.is_contiguous():
        return torch.ops.tierkv.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2H] (a fused gate/up projection) -> silu(x[:, :H]) * x[:, H:] [N, H]."""
    if _usable(x) and x.shape[1] % 2 == 0:
        return torch.ops.tierkv.silu_mul(x)
    return silu_mul_ref(x)


def native_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's GEMM runs `dtype` at full speed on `device`: fp32 and any GPU always; bf16
    and fp16 on a CPU only with AVX512-BF16 / AVX512-FP16 or AMX, which oneDNN's kernels need.
    Without them torch's bf16 GEMM ran at ~16 GFLOP/s against ~100 for fp32 (AMD EPYC, AVX2)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return True
    want = {
        torch.bfloat16: ("avx512_bf16", "amx_bf16"),
        torch.float16: ("avx512_fp16", "amx_fp16"),
    }[dtype]
    return any(f in cpu.cpu_flags() for f in want)


# Steps of up to this many rows read bf16 weights (cpu_gemv.cpp) instead of the widened fp32
# copy: they are bound by reading the weights, and bf16 is half the bytes. Measured on an AVX2
# CPU, 1-8 rows: 1.0-2x faster per layer shape, 2-5x for the 32000-row lm_head (torch's fp32
# GEMM of 2-8 rows is slow there); from 16 rows on the fp32 GEMM is as fast or faster.
GEMV_ROWS = 8
# With native bf16 GEMMs (AVX512-BF16) the kernel's bf16 products (vdpbf16ps) beat oneDNN's bf16
# GEMM up to 16 rows: SmolLM2's layer shapes on an AMD EPYC, weights in cache, 1 row 2.9x, 8 rows
# 1.6x, 16 rows 1.2x, 32 rows 0.94x; weights streamed from memory (a decode step) more.
NATIVE_GEMV_ROWS = 16


def gemv_usable(x: torch.Tensor, narrow: torch.Tensor, rows: int = GEMV_ROWS) -> bool:
    """True when torch.ops.tierkv.gemv_bf16 serves x [M <= rows, K] @ narrow.T: CPU, bf16
    weights contiguous, K a multiple of 16 (any ISA's vector width)."""
    return (
        x.shape[0] <= rows
        and narrow.dtype == torch.bfloat16
        and narrow.is_contiguous()
        and narrow.dim() == 2
        and narrow.shape[1] % 16 == 0
        and _usable(x)
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    narrow: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias). A weight kept wider than x (ModelRunner widens bf16 weights to fp32
    where native_matmul is False) computes in its dtype and rounds the result to x's dtype: the
    math of a bf16 GEMM with fp32 accumulation, in another summation order. `narrow`, the same
    weight in bf16, serves steps of few rows (see GEMV_ROWS) with that same math, as does a bf16
    weight itself for up to NATIVE_GEMV_ROWS rows."""
    if weight.dtype == x.dtype:
        if gemv_usable(x, weight, NATIVE_GEMV_ROWS):
            return torch.ops.tierkv.gemv_bf16(x, weight, bias)
        return F.linear(x, weight, bias)
    if narrow is not None and gemv_usable(x, narrow):
        return torch.ops.tierkv.gemv_bf16(x, narrow, bias)
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
