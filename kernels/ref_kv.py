"""Torch references for moving KV: slot-mapped writes, and gather/scatter between a
request's blocks and a contiguous segment slice [2, length, Hkv, D]. Arguments as
kernels/__init__.py checks them (kernels/args.py)."""

from __future__ import annotations

import torch

from tierkv.kernels.args import LayerCache
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


def token_slots(block_ids: torch.Tensor, start: int, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of tokens [start, start+length) of a request with these block ids."""
    t = torch.arange(start, start + length, device=block_ids.device)
    return block_ids.long()[t // block_size] * block_size + t % block_size


def write_kv_ref(
    k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for src, (dst, scale) in zip((k, v), cache.sides()):
        put_rows(dst, slots, convert(src[keep], dst.dtype, None, scale))


def gather_kv_ref(
    cache: LayerCache, ids: torch.Tensor, start: int, out: torch.Tensor, sc: torch.Tensor | None
) -> None:
    """gather_kv: ids the request's block ids, sc the scales of an fp8 out."""
    slots = token_slots(ids, start, out.shape[1], cache.k.shape[1])
    for i, (src, scale) in enumerate(cache.sides()):
        x = take_rows(src, slots)
        if is_fp8(out):
            # An fp8 segment from an fp8 cache keeps the cache's bytes and scales; from any
            # other cache it gets fresh per-head scales of this range.
            need_scale(sc)[i] = need_scale(scale).float() if is_fp8(src) else fp8_scales(x, 1)
        out[i] = convert(x, out.dtype, scale, need_scale(sc)[i] if is_fp8(out) else None)


def scatter_kv_ref(
    src: torch.Tensor, cache: LayerCache, ids: torch.Tensor, start: int, sc: torch.Tensor | None
) -> None:
    """scatter_kv: ids the request's block ids, sc the scales of an fp8 src."""
    slots = token_slots(ids, start, src.shape[1], cache.k.shape[1])
    for i, (dst, scale) in enumerate(cache.sides()):
        x = convert(src[i], dst.dtype, need_scale(sc)[i] if is_fp8(src) else None, scale)
        put_rows(dst, slots, x)


__all__ = ["gather_kv_ref", "scatter_kv_ref", "write_kv_ref", "token_slots"]
