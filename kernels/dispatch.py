"""Where a kernel runs: Triton on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1),
the torch reference otherwise. Triton is imported only when it will be used."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel should run for tensors on t's device."""
    if t.is_cuda:
        return triton_available()
    return t.device.type == "cpu" and interpret() and triton_available()
