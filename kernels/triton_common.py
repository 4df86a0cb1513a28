"""Helpers for our kernels. tl.max / tl.sum / tl.cdiv / tl.zeros are @jit functions of
triton.language.standard, fixed as compiled or interpreted when triton is first imported;
these are decorated with our kernels, so TRITON_INTERPRET=1 set before importing kernels
works even when something (transformers) imported triton earlier. The reductions pass
the standard combine functions, which the interpreter maps to numpy (anything else it
runs element by element) and the compiler treats exactly as tl.max / tl.sum do."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

from tierkv.kernels.dispatch import interpret

_INTERPRETER = threading.Lock()


def launch(kernel: Any, grid: tuple[int, ...]) -> Callable[..., Any]:
    """`kernel[grid]`, serialized process-wide under TRITON_INTERPRET=1.

    Triton's interpreter keeps the launch grid in module-global state, so two threads that
    launch at once (the connector's loop thread scattering loaded KV while the forward runs)
    read each other's grid and fail with 'x >= grid_dim[0]'. Compiled launches are
    thread-safe and take no lock."""
    run = kernel[grid]
    if not interpret():
        return run

    def locked(*args: Any, **kwargs: Any) -> Any:
        with _INTERPRETER:
            return run(*args, **kwargs)

    return locked


@triton.jit
def rmax(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _elementwise_max)


@triton.jit
def rsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _sum_combine)


@triton.jit
def cdiv(a, b):
    return (a + b - 1) // b
