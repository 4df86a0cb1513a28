"""The model's per-layer elementwise ops: RMSNorm and SiLU-and-multiply.

On a CPU each is one C++ pass (cpu_ops.cpp) where torch runs 4-7 ops over the whole batch;
elsewhere, or with the library off, the torch references below run. The references are
Hugging Face's expressions, which the C++ ops follow within fp32 rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu

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
    return (x.device.type == "cpu" and cpu.enabled() and x.dim() == 2 and x.stride(1) == 1
            and x.dtype in FLOATS and cpu.load())


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
