"""Helpers for our kernels. tl.max / tl.sum / tl.cdiv / tl.zeros are @jit functions of
triton.language.standard, fixed as compiled or interpreted when triton is first imported;
these are decorated with our kernels, so TRITON_INTERPRET=1 set before importing kernels
works even when something (transformers) imported triton earlier. The reductions pass
the standard combine functions, which the interpreter maps to numpy (anything else it
runs element by element) and the compiler treats exactly as tl.max / tl.sum do."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine


@triton.jit
def rmax(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _elementwise_max)


@triton.jit
def rsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _sum_combine)


@triton.jit
def cdiv(a, b):
    return (a + b - 1) // b
