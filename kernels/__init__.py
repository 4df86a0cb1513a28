"""Kernels of tierkv: paged attention, KV write, gather/scatter, RoPE, fp8.

Each public function checks its arguments once (kernels/args.py), then dispatches: the Triton
kernel on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), the torch reference
otherwise; on a CPU, paged attention's decodes and the KV write go through the C++ kernels
(kernels/cpu.py). Triton is imported lazily.
"""

from __future__ import annotations

import torch

from tierkv.kernels import cpu
from tierkv.kernels.args import AttentionMeta, LayerCache, check_attention, check_move, check_write
from tierkv.kernels.dispatch import triton_available, use_triton
from tierkv.kernels.fp8 import FP8, FP8_MAX, dequantize_fp8, fp8_scales, quantize_fp8
from tierkv.kernels.ref_attention import paged_attention_ref
from tierkv.kernels.ref_kv import gather_kv_ref, scatter_kv_ref, write_kv_ref
from tierkv.kernels.rope import RotaryEmbedding, rerotate_k


def paged_attention(
    q: torch.Tensor, cache: LayerCache, meta: AttentionMeta, scale: float
) -> torch.Tensor:
    """Attention of q [Nq, Hq, D] over each sequence's paged K/V; causal by meta.q_positions."""
    check_attention(q, cache, meta)
    if use_triton(q):
        from tierkv.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(q, cache, meta, scale)
    kernel = q.device.type == "cpu" and cpu.enabled() and cpu.load()
    return paged_attention_ref(q, cache, meta, scale, cpu_kernel=kernel)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [N, Hkv, D] into the cache at slot_mapping (negative = skip)."""
    if use_triton(k):
        from tierkv.kernels.triton_kv import write_kv_triton

        check_write(k, v, cache, slot_mapping)
        return write_kv_triton(k, v, cache, slot_mapping)
    if cpu.write_kv_usable(k, v, cache) and slot_mapping.dtype in (torch.int32, torch.int64):
        try:  # one C++ pass; it checks every slot before writing any
            return torch.ops.tierkv.write_kv(
                k, v, cache.k, cache.v, slot_mapping.long().contiguous()
            )
        except RuntimeError as e:
            raise ValueError(str(e).splitlines()[0]) from None
    check_write(k, v, cache, slot_mapping)
    return write_kv_ref(k, v, cache, slot_mapping)


def gather_kv(
    cache: LayerCache,
    block_ids: torch.Tensor,
    start: int,
    out: torch.Tensor,
    out_scales: torch.Tensor | None = None,
) -> None:
    """Copy tokens [start, start + length) of one request out of one layer's cache into
    out [2, length, Hkv, D]. An fp8 `out` also fills out_scales [2, Hkv]. `out` may live on
    another device (a CPU staging buffer): the copy then goes through the cache's device."""
    check_move(cache, block_ids, start, out, out_scales)
    dev = cache.k.device
    dst, dst_sc = out, out_scales
    if out.device != dev:
        dst = torch.empty(out.shape, dtype=out.dtype, device=dev)
        dst_sc = None if out_scales is None else torch.empty(out_scales.shape, device=dev)
    block_ids = block_ids.to(dev)
    if use_triton(cache.k):
        from tierkv.kernels.triton_kv import gather_kv_triton

        gather_kv_triton(cache, block_ids, start, dst, dst_sc)
    else:
        gather_kv_ref(cache, block_ids, start, dst, dst_sc)
    if dst is not out:
        out.copy_(dst)
        if out_scales is not None and dst_sc is not None:  # both or neither
            out_scales.copy_(dst_sc)


def scatter_kv(
    src: torch.Tensor,
    cache: LayerCache,
    block_ids: torch.Tensor,
    start: int,
    src_scales: torch.Tensor | None = None,
) -> None:
    """Copy src [2, length, Hkv, D] (on any device) into tokens [start, start + length) of a
    request's blocks."""
    check_move(cache, block_ids, start, src, src_scales)
    dev = cache.k.device
    block_ids, src = block_ids.to(dev), src.to(dev)
    src_scales = None if src_scales is None else src_scales.to(dev)
    if use_triton(cache.k):
        from tierkv.kernels.triton_kv import scatter_kv_triton

        return scatter_kv_triton(src, cache, block_ids, start, src_scales)
    return scatter_kv_ref(src, cache, block_ids, start, src_scales)


def _check_layers(caches: list[LayerCache], seg: torch.Tensor) -> None:
    if seg.dim() != 5 or seg.shape[0] != len(caches) or seg.shape[1] != 2:
        raise ValueError(f"segment must be [L={len(caches)}, 2, T, Hkv, D], got {tuple(seg.shape)}")


def gather_kv_layers(
    caches: list[LayerCache],
    block_ids: torch.Tensor,
    start: int,
    out: torch.Tensor,
    out_scales: torch.Tensor | None = None,
) -> None:
    """gather_kv for every layer into out [L, 2, length, Hkv, D]; out_scales [L, 2, Hkv]
    float32 for an fp8 out."""
    _check_layers(caches, out)
    for layer, cache in enumerate(caches):
        sc = None if out_scales is None else out_scales[layer]
        gather_kv(cache, block_ids, start, out[layer], sc)


def scatter_kv_layers(
    src: torch.Tensor,
    caches: list[LayerCache],
    block_ids: torch.Tensor,
    start: int,
    src_scales: torch.Tensor | None = None,
) -> None:
    """scatter_kv for every layer: src [L, 2, length, Hkv, D] into caches[l]."""
    _check_layers(caches, src)
    for layer, cache in enumerate(caches):
        sc = None if src_scales is None else src_scales[layer]
        scatter_kv(src[layer], cache, block_ids, start, sc)


__all__ = [
    "FP8",
    "FP8_MAX",
    "AttentionMeta",
    "LayerCache",
    "RotaryEmbedding",
    "dequantize_fp8",
    "fp8_scales",
    "gather_kv",
    "gather_kv_layers",
    "paged_attention",
    "paged_attention_ref",
    "quantize_fp8",
    "rerotate_k",
    "scatter_kv",
    "scatter_kv_layers",
    "triton_available",
    "use_triton",
    "write_kv",
]
