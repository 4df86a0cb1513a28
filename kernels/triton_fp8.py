"""Triton fp8 (e4m3) quantization of [..., H, D] with per-head scales."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierkv.kernels.dispatch import interpret
from tierkv.kernels.fp8 import FP8
from tierkv.kernels.triton_common import launch


@triton.jit
def _quant_kernel(
    x_ptr,
    sc_ptr,
    out_ptr,
    rows,
    HD: tl.constexpr,
    HEAD_D: tl.constexpr,
    HD_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.arange(0, HD_PAD)
    mask = (r < rows)[:, None] & (col < HD)[None, :]
    off = r.to(tl.int64)[:, None] * HD + col[None, :]
    sc = tl.load(sc_ptr + col // HEAD_D, mask=col < HD, other=1.0)
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32) / sc[None, :]
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    tl.store(out_ptr + off, x.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_triton(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] / per-head scale [H], saturated, as float8_e4m3fn. Under TRITON_INTERPRET=1
    the kernel writes fp32 and torch casts: the interpreter's fp32 -> fp8 cast rounds wrongly."""
    h, d = x.shape[-2], x.shape[-1]
    if scale.shape != (h,):
        raise ValueError(f"scale must be [{h}], got {tuple(scale.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32 if interpret() else FP8, device=x.device)
    rows = x.numel() // (h * d)
    if rows == 0:
        return out.to(FP8)
    hd_pad = triton.next_power_of_2(h * d)
    block_r = max(1, min(64, 4096 // hd_pad))
    launch(_quant_kernel, (triton.cdiv(rows, block_r),))(
        x, scale.float().contiguous(), out, rows, HD=h * d, HEAD_D=d, HD_PAD=hd_pad, BLOCK_R=block_r
    )
    return out.to(FP8)
