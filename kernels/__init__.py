"""Kernels of tierkv: paged attention, KV write, gather/scatter, RoPE, fp8.

Each public function dispatches: the Triton kernel on CUDA tensors (or CPU tensors under
TRITON_INTERPRET=1), the torch reference otherwise; on a CPU, paged attention's decodes go
through the C++ kernel (kernels/cpu.py). Triton is imported lazily.
"""

from __future__ import annotations

import torch

from tierkv.kernels import cpu
from tierkv.kernels.dispatch import triton_available, use_triton
from tierkv.kernels.fp8 import FP8, FP8_MAX, dequantize_fp8, fp8_scales, quantize_fp8
from tierkv.kernels.ref_attention import paged_attention_ref
from tierkv.kernels.ref_kv import gather_kv_ref, layer_scales, scatter_kv_ref, write_kv_ref
from tierkv.kernels.rope import RotaryEmbedding, rerotate_k


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Attention of q [Nq, Hq, D] over each sequence's paged K/V; causal by q_positions.
    max_seqlen_q/k are optional hints (they save a device sync when choosing split-K)."""
    if use_triton(q):
        from tierkv.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            cu_seqlens_q,
            q_positions,
            scale,
            k_scale,
            v_scale,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
        )
    return paged_attention_ref(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        q_positions,
        scale,
        k_scale,
        v_scale,
        cpu_kernel=True,
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v [N, Hkv, D] into the caches at slot_mapping (negative = skip)."""
    if use_triton(k):
        from tierkv.kernels.triton_kv import write_kv_triton

        return write_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if cpu.write_kv_usable(k, v, k_cache, v_cache) and slot_mapping.dtype in (
        torch.int32,
        torch.int64,
    ):
        try:  # one C++ pass; it checks every slot before writing any
            return torch.ops.tierkv.write_kv(
                k, v, k_cache, v_cache, slot_mapping.long().contiguous()
            )
        except RuntimeError as e:
            raise ValueError(str(e).splitlines()[0]) from None
    return write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    start: int,
    length: int,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
) -> None:
    """Copy tokens [start, start+length) of one request out of one layer's cache into
    out [2, length, Hkv, D]. An fp8 `out` also fills out_scales [2, Hkv]. `out` may live on
    another device (a CPU staging buffer): the copy then goes through the cache's device."""
    block_ids = block_ids.to(k_cache.device)
    if out.device != k_cache.device:
        tmp = torch.empty(out.shape, dtype=out.dtype, device=k_cache.device)
        tmp_sc = (
            None if out_scales is None else torch.empty(out_scales.shape, device=k_cache.device)
        )
        gather_kv(k_cache, v_cache, block_ids, start, length, tmp, k_scale, v_scale, tmp_sc)
        out.copy_(tmp)
        if out_scales is not None and tmp_sc is not None:  # both or neither
            out_scales.copy_(tmp_sc)
        return None
    if use_triton(k_cache):
        from tierkv.kernels.triton_kv import gather_kv_triton

        return gather_kv_triton(
            k_cache, v_cache, block_ids, start, length, out, k_scale, v_scale, out_scales
        )
    return gather_kv_ref(
        k_cache, v_cache, block_ids, start, length, out, k_scale, v_scale, out_scales
    )


def scatter_kv(
    src: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    start: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    src_scales: torch.Tensor | None = None,
) -> None:
    """Copy src [2, length, Hkv, D] (on any device) into tokens [start, start+length) of a
    request's blocks."""
    block_ids = block_ids.to(k_cache.device)
    src = src.to(k_cache.device)
    src_scales = None if src_scales is None else src_scales.to(k_cache.device)
    if use_triton(k_cache):
        from tierkv.kernels.triton_kv import scatter_kv_triton

        return scatter_kv_triton(
            src, k_cache, v_cache, block_ids, start, k_scale, v_scale, src_scales
        )
    return scatter_kv_ref(src, k_cache, v_cache, block_ids, start, k_scale, v_scale, src_scales)


def _check_layers(kv_caches: list[torch.Tensor], seg: torch.Tensor) -> None:
    if seg.dim() != 5 or seg.shape[0] != len(kv_caches) or seg.shape[1] != 2:
        raise ValueError(
            f"segment must be [L={len(kv_caches)}, 2, T, Hkv, D], got {tuple(seg.shape)}"
        )
    for c in kv_caches:
        if c.dim() != 5 or c.shape[0] != 2:
            raise ValueError(
                "each layer cache must be [2, num_blocks, block_size, Hkv, D], "
                f"got {tuple(c.shape)}"
            )


def gather_kv_layers(
    kv_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    start: int,
    length: int,
    out: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
) -> None:
    """gather_kv for every layer: kv_caches[l] [2, nb, bs, Hkv, D] -> out [L, 2, length, Hkv, D].
    kv_scales / out_scales: [L, 2, Hkv] float32 for fp8 caches / an fp8 out."""
    _check_layers(kv_caches, out)
    for layer, cache in enumerate(kv_caches):
        ks, vs = layer_scales(kv_scales, layer)
        gather_kv(
            cache[0],
            cache[1],
            block_ids,
            start,
            length,
            out[layer],
            ks,
            vs,
            None if out_scales is None else out_scales[layer],
        )


def scatter_kv_layers(
    src: torch.Tensor,
    kv_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    start: int,
    kv_scales: torch.Tensor | None = None,
    src_scales: torch.Tensor | None = None,
) -> None:
    """scatter_kv for every layer: src [L, 2, length, Hkv, D] into kv_caches[l]."""
    _check_layers(kv_caches, src)
    for layer, cache in enumerate(kv_caches):
        ks, vs = layer_scales(kv_scales, layer)
        scatter_kv(
            src[layer],
            cache[0],
            cache[1],
            block_ids,
            start,
            ks,
            vs,
            None if src_scales is None else src_scales[layer],
        )


__all__ = [
    "FP8",
    "FP8_MAX",
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
