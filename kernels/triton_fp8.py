"""Triton fp8 (e4m3) conversion: quantization of [..., H, D] with per-head scales, the
conversion through fp32 that the KV kernels (kernels/triton_kv.py) apply to every element,
and the staging buffer that stands in for the interpreter's in-kernel fp8 cast."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierkv.kernels.dispatch import interpret
from tierkv.kernels.fp8 import FP8
from tierkv.kernels.triton_common import launch


@triton.jit
def convert(
    x,
    src_sc_ptr,
    dst_sc_ptr,
    head,
    col_ok,
    SRC_FP8: tl.constexpr,
    DST_FP8: tl.constexpr,
    dst_ty: tl.constexpr,
):
    """x through fp32: times the source's per-head scale (SRC_FP8), over the destination's
    and saturated to e4m3's +-448 (DST_FP8), as dst_ty. head: each element's head; col_ok:
    where a scale is read."""
    x = x.to(tl.float32)
    if SRC_FP8:
        x = x * tl.load(src_sc_ptr + head, mask=col_ok, other=1.0)
    if DST_FP8:
        x = x / tl.load(dst_sc_ptr + head, mask=col_ok, other=1.0)
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    return x.to(dst_ty)


def fp8_stage(fp8_dst: bool, numel: int, device: torch.device) -> torch.Tensor | None:
    """Under TRITON_INTERPRET=1 an in-kernel fp32 -> fp8 cast rounds wrongly (126.7 becomes 64,
    not 128): there the kernel writes its scaled, saturated fp32 values to a staging buffer and
    torch casts them to fp8. Compiled kernels cast in the kernel."""
    if not (fp8_dst and interpret()):
        return None
    return torch.empty(numel, dtype=torch.float32, device=device)


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
    x = tl.load(x_ptr + off, mask=mask, other=0.0)
    y = convert(x, sc_ptr, sc_ptr, col // HEAD_D, col < HD, False, True, out_ptr.dtype.element_ty)
    tl.store(out_ptr + off, y, mask=mask)


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
