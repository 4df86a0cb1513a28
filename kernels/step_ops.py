"""The kernels of a loaded model's step, chosen once.

The kernel-level functions (kernels.paged_attention, write_kv, layer_ops.rms_norm, ...) decide
at each call where they run: they read TRITON_INTERPRET and TIERKV_CPU_KERNEL and check the
tensors. A decode step of a 30-layer model calls them hundreds of times, so an engine decides
once instead: select() reads the environment and builds the C++ library when its ModelRunner
is made, and the step calls the functions bound here with no check of its own. Changing
TRITON_INTERPRET or TIERKV_CPU_KERNEL after that has no effect on a loaded engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierkv.kernels import cpu
from tierkv.kernels.args import AttentionMeta, LayerCache, check_attention, check_write
from tierkv.kernels.dispatch import interpret, triton_available
from tierkv.kernels.layer_ops import (
    FLOATS,
    GEMV_ROWS,
    NATIVE_GEMV_ROWS,
    rms_norm_ref,
    silu_mul_ref,
)
from tierkv.kernels.ref_attention import paged_attention_ref
from tierkv.kernels.ref_kv import write_kv_ref
from tierkv.kernels.rope import rotate_ref

Linear = Callable[[torch.Tensor], torch.Tensor]
Attention = Callable[[torch.Tensor, LayerCache, AttentionMeta, float], torch.Tensor]
WriteKV = Callable[[torch.Tensor, torch.Tensor, LayerCache, torch.Tensor], None]
BACKENDS = ("triton", "cpp", "torch")


@dataclass(frozen=True, slots=True)
class StepOps:
    """Each op of a model's step bound to one kernel. backend: where attention, RoPE and the
    KV write run ("triton", "cpp": the C++ CPU kernels, "torch": the reference). cpp: the C++
    library is on and built for this CPU model, so RMSNorm, SiLU-and-mul and linear layers of
    few rows run it whatever the backend (as the kernel-level functions do)."""

    backend: str
    cpp: bool
    dtype: torch.dtype  # the model's activations
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    write_kv: WriteKV
    attention: Attention  # kernels.paged_attention's contract (arguments checked)

    def linear_spec(
        self, weight: torch.Tensor, bias: torch.Tensor | None, narrow: torch.Tensor | None
    ) -> LinearSpec:
        """How linear() computes x @ weight.T (+ bias): which bf16 weight the few-row kernel
        reads (None: never) and up to how many rows."""
        if weight.dtype == self.dtype:
            few = weight if self.cpp and _gemv_fits(weight) else None
            return LinearSpec(weight, few, bias, NATIVE_GEMV_ROWS)
        few = narrow if self.cpp and narrow is not None and _gemv_fits(narrow) else None
        return LinearSpec(weight, few, bias, GEMV_ROWS)

    def linear(
        self, weight: torch.Tensor, bias: torch.Tensor | None, narrow: torch.Tensor | None
    ) -> Linear:
        """x @ weight.T (+ bias) for x [M, K] in the model's dtype, as layer_ops.linear computes
        it, with its choice among the kernels made here: only the row count is left to the
        call. Holds the tensors given (Parameters follow in-place changes of their data)."""
        spec, wide = self.linear_spec(weight, bias, narrow), weight.dtype

        def many(x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, weight, bias)

        def widened(x: torch.Tensor) -> torch.Tensor:
            return F.linear(x.to(wide), weight, bias).to(x.dtype)

        rest = many if wide == self.dtype else widened
        return rest if spec.few is None else _rows(spec.limit, spec.few, bias, rest)


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """A bound linear layer: the few-row kernel over `few` (bf16) up to `limit` rows, else
    F.linear over `weight` (in weight's dtype, rounded back where it is wider than the input)."""

    weight: torch.Tensor
    few: torch.Tensor | None
    bias: torch.Tensor | None
    limit: int


def _gemv_fits(w: torch.Tensor) -> bool:
    return w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous() and w.shape[1] % 16 == 0


def _rows(limit: int, w: torch.Tensor, bias: torch.Tensor | None, many: Linear) -> Linear:
    gemv = torch.ops.tierkv.gemv_bf16

    def run(x: torch.Tensor) -> torch.Tensor:
        return gemv(x, w, bias) if x.shape[0] <= limit else many(x)

    return run


def select_backend(device: torch.device, dtype: torch.dtype) -> tuple[str, bool]:
    """(backend, cpp) for a model in dtype on device: Triton on CUDA (or on a CPU under
    TRITON_INTERPRET=1) where it is installed; else on a CPU the C++ kernels unless
    TIERKV_CPU_KERNEL=0 or the build fails; else torch. cpp: the library serves the layer ops
    too (an fp32 or bf16 model on a CPU, whatever the backend)."""
    cpu_dev = device.type == "cpu"
    triton = (device.type == "cuda" or (cpu_dev and interpret())) and triton_available()
    lib = cpu_dev and cpu.enabled() and cpu.load()
    return ("triton" if triton else "cpp" if lib else "torch"), lib and dtype in FLOATS


def select(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> StepOps:
    """The step's kernels for a model in dtype on device with a KV cache in kv_dtype (reads the
    environment and builds the C++ library once, here)."""
    backend, cpp = select_backend(device, dtype)
    norm, silu = (
        (torch.ops.tierkv.rms_norm, torch.ops.tierkv.silu_mul)
        if cpp
        else (rms_norm_ref, silu_mul_ref)
    )
    rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = rotate_ref
    write: WriteKV = _write_ref
    attention: Attention = _attention_ref
    if backend == "triton":
        from tierkv.kernels.triton_attention import paged_attention_triton
        from tierkv.kernels.triton_kv import write_kv_triton
        from tierkv.kernels.triton_rope import rope_triton

        rotate = rope_triton

        def write(k: torch.Tensor, v: torch.Tensor, c: LayerCache, slots: torch.Tensor) -> None:
            check_write(k, v, c, slots)
            write_kv_triton(k, v, c, slots)

        def attention(q: torch.Tensor, c: LayerCache, m: AttentionMeta, s: float) -> torch.Tensor:
            check_attention(q, c, m)
            return paged_attention_triton(q, c, m, s)

    elif backend == "cpp":
        rotate = torch.ops.tierkv.rope
        if kv_dtype == dtype:
            write = _write_cpp
        attention = _attention_cpp
    return StepOps(backend, cpp, dtype, norm, silu, rotate, write, attention)


def _write_cpp(k: torch.Tensor, v: torch.Tensor, c: LayerCache, slots: torch.Tensor) -> None:
    """The C++ KV write (it checks every slot before writing any). Contract: k and v [N, Hkv,
    D] in the cache's dtype with contiguous rows, slots int64 contiguous (the engine's)."""
    try:
        torch.ops.tierkv.write_kv(k, v, c.k, c.v, slots)
    except RuntimeError as e:
        raise ValueError(str(e).splitlines()[0]) from None


def _write_ref(k: torch.Tensor, v: torch.Tensor, c: LayerCache, slots: torch.Tensor) -> None:
    check_write(k, v, c, slots)
    write_kv_ref(k, v, c, slots)


def _attention_cpp(q: torch.Tensor, c: LayerCache, m: AttentionMeta, s: float) -> torch.Tensor:
    check_attention(q, c, m)
    return paged_attention_ref(q, c, m, s, cpu_kernel=True)


def _attention_ref(q: torch.Tensor, c: LayerCache, m: AttentionMeta, s: float) -> torch.Tensor:
    check_attention(q, c, m)
    return paged_attention_ref(q, c, m, s, cpu_kernel=False)
