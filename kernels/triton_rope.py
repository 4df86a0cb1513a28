"""Triton rotary kernel: x [N, H, D] rotated by per-token cos/sin [N, D/2] (fp32), with
Hugging Face Llama's rotate_half layout. RoPE and re-rotation of cached K both use it
(re-rotation passes cos/sin of delta * inv_freq)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierkv.kernels.triton_common import launch


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    s_xn,
    s_xh,
    s_on,
    s_oh,
    num_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    H_PAD: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    mask = (h < num_heads)[:, None] & j_ok[None, :]
    c = tl.load(cos_ptr + i * HALF + j, mask=j_ok, other=0.0)[None, :]
    s = tl.load(sin_ptr + i * HALF + j, mask=j_ok, other=0.0)[None, :]
    base = x_ptr + i * s_xn + h[:, None] * s_xh + j[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    o = out_ptr + i * s_on + h[:, None] * s_oh + j[None, :]
    tl.store(o, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o + HALF, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] (head dim contiguous) -> a new rotated tensor in x's dtype."""
    n, h, d = x.shape
    if cos.shape != (n, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be [{n}, {d // 2}], got {tuple(cos.shape)}")
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    launch(_rope_kernel, (n,))(
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        h,
        HALF=d // 2,
        HALF_PAD=triton.next_power_of_2(d // 2),
        H_PAD=triton.next_power_of_2(h),
    )
    return out
