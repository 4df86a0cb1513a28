"""FP8 (e4m3) quantization with per-head scales: value = stored.float() * scale."""

from __future__ import annotations

import torch

from tierkv.kernels.dispatch import use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
_MIN_AMAX = 1e-12  # an all-zero head still gets a finite, positive scale


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


def need_scale(scale: torch.Tensor | None) -> torch.Tensor:
    """The scale of an fp8 tensor, which must be given (the argument checks of the KV and
    attention ops have already required it): `Tensor | None` narrowed to `Tensor`."""
    if scale is None:
        raise ValueError("an fp8 tensor needs its scale")
    return scale


def fp8_scales(x: torch.Tensor, *dims: int) -> torch.Tensor:
    """Scales amax/448 with one entry per index of the kept `dims` (default: -2, the head dim
    of [..., H, D]); amax is taken over every other dim. Result: float32, shape x.shape[dims]."""
    keep = sorted(d % x.dim() for d in (dims or (-2,)))
    reduce = [d for d in range(x.dim()) if d not in keep]
    amax = x.detach().abs().float().amax(dim=reduce) if reduce else x.detach().abs().float()
    return amax.clamp(min=_MIN_AMAX) / FP8_MAX


def _bcast(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # A 1-D scale is per head of [..., H, D]; anything else must already broadcast to x.
    scale = scale.to(device=x.device, dtype=torch.float32)
    if scale.dim() == 1 and x.dim() >= 2:
        if scale.numel() != x.shape[-2]:
            raise ValueError(
                f"per-head scale has {scale.numel()} entries, tensor has {x.shape[-2]} heads"
            )
        return scale.view(-1, 1)
    return scale


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to +-448, as float8_e4m3fn."""
    if scale.dim() == 1 and x.dim() >= 2 and use_triton(x):
        from tierkv.kernels.triton_fp8 import quantize_fp8_triton

        return quantize_fp8_triton(x, scale)
    return quantize_fp8_ref(x, scale)


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch reference of quantize_fp8."""
    return (x.float() / _bcast(scale, x)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x.float() * scale in `dtype`."""
    if not is_fp8(x):
        raise ValueError(f"dequantize_fp8 expects float8_e4m3fn, got {x.dtype}")
    return (x.float() * _bcast(scale, x)).to(dtype)


def convert(
    x: torch.Tensor,
    dtype: torch.dtype,
    src_scale: torch.Tensor | None,
    dst_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Convert between any two KV dtypes; fp8 sides use their scale. Equal fp8 scales copy bytes."""
    if (
        is_fp8(x)
        and dtype == FP8
        and src_scale is not None
        and dst_scale is not None
        and torch.equal(src_scale.float().cpu(), dst_scale.float().cpu())
    ):
        return x
    v = dequantize_fp8(x, need_scale(src_scale)) if is_fp8(x) else x
    return quantize_fp8_ref(v, need_scale(dst_scale)) if dtype == FP8 else v.to(dtype)
