"""Torch references for moving KV: slot-mapped writes, and gather/scatter between a
request's blocks and a contiguous segment slice [2, length, Hkv, D]."""

from __future__ import annotations

import torch

from tierkv.kernels.fp8 import convert, fp8_scales, is_fp8, need_scale


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # CPU index kernels lack fp8: move fp8 as its bytes.
    return t.view(torch.uint8) if is_fp8(t) else t


def take_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [len(slots), Hkv, D] of a [num_blocks, block_size, Hkv, D] cache."""
    flat = _bytes(cache).view(-1, *cache.shape[2:])
    return flat.index_select(0, slots).view(cache.dtype)


def put_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    _bytes(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, _bytes(rows.to(cache.dtype)))


def check_cache_pair(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"caches must be two equal [num_blocks, block_size, Hkv, D] tensors, got "
            f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if is_fp8(k_cache):
        for s in (k_scale, v_scale):
            if s is None or s.shape != (k_cache.shape[2],):
                raise ValueError(
                    f"an fp8 cache needs k_scale and v_scale of shape [{k_cache.shape[2]}]"
                )


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    check_write_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for src, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        put_rows(cache, slots, convert(src[keep], cache.dtype, None, scale))


def check_write_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    check_cache_pair(k_cache, v_cache, k_scale, v_scale)
    n = k.shape[0]
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k, v must be [N, Hkv, D] matching the cache, got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if slot_mapping.shape != (n,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int [{n}]")
    if n and int(slot_mapping.max()) >= k_cache.shape[0] * k_cache.shape[1]:
        raise ValueError("slot_mapping points past the end of the cache")
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("caches must be contiguous")


def token_slots(
    block_ids: torch.Tensor, start: int, length: int, block_size: int, num_blocks: int
) -> torch.Tensor:
    """Cache slots of tokens [start, start+length) of a request with these block ids."""
    if start < 0 or length < 0 or block_ids.dim() != 1:
        raise ValueError(f"bad token range start={start} length={length} or block_ids shape")
    if -(-(start + length) // block_size) > block_ids.numel():
        raise ValueError(f"tokens [{start}, {start + length}) exceed {block_ids.numel()} blocks")
    t = torch.arange(start, start + length, device=block_ids.device)
    blk = block_ids.long()[t // block_size]
    if length and ((blk < 0) | (blk >= num_blocks)).any():
        raise ValueError("block id outside the cache")
    return blk * block_size + t % block_size


def check_segment(
    seg: torch.Tensor, cache: torch.Tensor, length: int, seg_scales: torch.Tensor | None
) -> None:
    if seg.shape != (2, length, *cache.shape[2:]):
        raise ValueError(
            f"segment slice must be [2, {length}, {cache.shape[2]}, {cache.shape[3]}], "
            f"got {tuple(seg.shape)}"
        )
    if is_fp8(seg) and (seg_scales is None or seg_scales.shape != (2, cache.shape[2])):
        raise ValueError(f"an fp8 segment needs scales of shape [2, {cache.shape[2]}]")


def gather_kv_ref(
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
    check_cache_pair(k_cache, v_cache, k_scale, v_scale)
    check_segment(out, k_cache, length, out_scales)
    slots = token_slots(block_ids, start, length, k_cache.shape[1], k_cache.shape[0])
    for i, (cache, scale) in enumerate(((k_cache, k_scale), (v_cache, v_scale))):
        x = take_rows(cache, slots)
        if is_fp8(out):
            # An fp8 segment from an fp8 cache keeps the cache's bytes and scales; from any
            # other cache it gets fresh per-head scales of this range.
            new = need_scale(scale).float() if is_fp8(cache) else fp8_scales(x, 1)
            need_scale(out_scales)[i] = new
        out[i] = convert(x, out.dtype, scale, need_scale(out_scales)[i] if is_fp8(out) else None)


def scatter_kv_ref(
    src: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    start: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    src_scales: torch.Tensor | None = None,
) -> None:
    check_cache_pair(k_cache, v_cache, k_scale, v_scale)
    length = src.shape[1] if src.dim() == 4 else -1
    check_segment(src, k_cache, length, src_scales)
    slots = token_slots(block_ids, start, length, k_cache.shape[1], k_cache.shape[0])
    for i, (cache, scale) in enumerate(((k_cache, k_scale), (v_cache, v_scale))):
        x = convert(src[i], cache.dtype, need_scale(src_scales)[i] if is_fp8(src) else None, scale)
        put_rows(cache, slots, x)


def layer_scales(
    scales: torch.Tensor | None, layer: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-layer cache scales [L, 2, Hkv] -> (k_scale, v_scale) of one layer."""
    if scales is None:
        return None, None
    return scales[layer, 0], scales[layer, 1]


__all__ = ["gather_kv_ref", "scatter_kv_ref", "write_kv_ref", "token_slots", "layer_scales"]
