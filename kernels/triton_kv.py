"""Triton kernels that move KV: slot-mapped writes into the paged cache, and gather /
scatter of one request's token range between the paged cache and a segment slice.

Each token row is its Hkv*D elements, contiguous in the cache and in the segment. A
conversion goes through fp32: dequantize with the source scale, quantize with the
destination scale (e4m3 saturates at +-448). Arguments as kernels/__init__.py checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierkv.kernels.args import LayerCache
from tierkv.kernels.fp8 import FP8, FP8_MAX, is_fp8, need_scale
from tierkv.kernels.ref_kv import put_rows, token_slots
from tierkv.kernels.triton_common import launch, rmax
from tierkv.kernels.triton_fp8 import convert, fp8_stage


@triton.jit
def _write_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    stage_ptr,
    s_k,
    s_v,
    s_kc,
    s_vc,
    HD: tl.constexpr,
    HD_PAD: tl.constexpr,
    HEAD_D: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    STAGE: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot < 0:
        return
    col = tl.arange(0, HD_PAD)
    ok = col < HD
    head = col // HEAD_D
    k = tl.load(k_ptr + i * s_k + col, mask=ok)
    v = tl.load(v_ptr + i * s_v + col, mask=ok)
    if STAGE:
        k = convert(k, ks_ptr, ks_ptr, head, ok, False, FP8_CACHE, tl.float32)
        v = convert(v, vs_ptr, vs_ptr, head, ok, False, FP8_CACHE, tl.float32)
        tl.store(stage_ptr + i * 2 * HD + col, k, mask=ok)
        tl.store(stage_ptr + i * 2 * HD + HD + col, v, mask=ok)
    else:
        k = convert(k, ks_ptr, ks_ptr, head, ok, False, FP8_CACHE, kc_ptr.dtype.element_ty)
        v = convert(v, vs_ptr, vs_ptr, head, ok, False, FP8_CACHE, vc_ptr.dtype.element_ty)
        tl.store(kc_ptr + slot * s_kc + col, k, mask=ok)
        tl.store(vc_ptr + slot * s_vc + col, v, mask=ok)


@triton.jit
def _move_kernel(
    cache_ptr,
    seg_ptr,
    bids_ptr,
    src_sc,
    dst_sc,
    amax_ptr,
    stage_ptr,
    start,
    length,
    s_slot,
    s_tok,
    HD: tl.constexpr,
    HD_PAD: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TO_SEG: tl.constexpr,
    SRC_FP8: tl.constexpr,
    DST_FP8: tl.constexpr,
    RAW: tl.constexpr,
    AMAX_ONLY: tl.constexpr,
    STAGE: tl.constexpr,
):
    # TO_SEG: cache -> segment (gather); else segment -> cache (scatter).
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < length
    pos = start + t
    blk = tl.load(bids_ptr + pos // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
    slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
    col = tl.arange(0, HD_PAD)
    col_ok = col < HD
    mask = t_ok[:, None] & col_ok[None, :]
    c_off = slot[:, None] * s_slot + col[None, :]
    s_off = t.to(tl.int64)[:, None] * s_tok + col[None, :]
    if TO_SEG:
        x = tl.load(cache_ptr + c_off, mask=mask, other=0.0)
    else:
        x = tl.load(seg_ptr + s_off, mask=mask, other=0.0)
    head = col // HEAD_D
    if AMAX_ONLY:
        # First pass of a gather into a fresh fp8 segment: per-column amax, reduced to heads on
        # the host.
        tl.atomic_max(amax_ptr + col, rmax(tl.abs(x.to(tl.float32)), 0), mask=col_ok)
    else:
        dst = seg_ptr if TO_SEG else cache_ptr
        if RAW:
            y = x
        elif STAGE:
            y = convert(x, src_sc, dst_sc, head, col_ok[None, :], SRC_FP8, DST_FP8, tl.float32)
        else:
            y = convert(
                x, src_sc, dst_sc, head, col_ok[None, :], SRC_FP8, DST_FP8, dst.dtype.element_ty
            )
        if STAGE:
            tl.store(stage_ptr + t.to(tl.int64)[:, None] * HD + col[None, :], y, mask=mask)
        elif TO_SEG:
            tl.store(seg_ptr + s_off, y, mask=mask)
        else:
            tl.store(cache_ptr + c_off, y, mask=mask)


def _hd_pad(k_cache: torch.Tensor) -> tuple[int, int, int]:
    h, d = k_cache.shape[2], k_cache.shape[3]
    if k_cache.stride(2) != d or k_cache.stride(3) != 1:
        raise ValueError("each cache slot must hold its Hkv*D elements contiguously")
    return h * d, triton.next_power_of_2(h * d), d


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor
) -> None:
    if k.shape[0] == 0:
        return
    hd, hd_pad, d = _hd_pad(cache.k)
    k, v = k.contiguous(), v.contiguous()
    fp8 = cache.fp8
    ks = need_scale(cache.k_scale).float().contiguous() if fp8 else k
    vs = need_scale(cache.v_scale).float().contiguous() if fp8 else v
    stage = fp8_stage(fp8, 2 * k.shape[0] * hd, k.device)
    launch(_write_kernel, (k.shape[0],))(
        k,
        v,
        cache.k,
        cache.v,
        slot_mapping,
        ks,
        vs,
        k if stage is None else stage,
        k.stride(0),
        v.stride(0),
        cache.k.stride(1),
        cache.v.stride(1),
        HD=hd,
        HD_PAD=hd_pad,
        HEAD_D=d,
        FP8_CACHE=fp8,
        STAGE=stage is not None,
    )
    if stage is not None:
        keep = slot_mapping >= 0
        rows = stage.view(-1, 2, *k.shape[1:])[keep].to(FP8)
        put_rows(cache.k, slot_mapping[keep].long(), rows[:, 0])
        put_rows(cache.v, slot_mapping[keep].long(), rows[:, 1])


def _move(
    cache: torch.Tensor,
    seg: torch.Tensor,
    block_ids: torch.Tensor,
    start: int,
    length: int,
    src_sc: torch.Tensor | None,
    dst_sc: torch.Tensor | None,
    to_seg: bool,
    amax: torch.Tensor | None = None,
) -> None:
    hd, hd_pad, d = _hd_pad(cache)
    block_t = max(1, min(64, 4096 // hd_pad))
    src, dst = (cache, seg) if to_seg else (seg, cache)
    src_fp8, dst_fp8 = is_fp8(src), is_fp8(dst)
    if src_fp8 and dst_fp8 and torch.equal(need_scale(src_sc), need_scale(dst_sc)):
        src_fp8 = dst_fp8 = False  # same scales: the bytes move as they are
    dummy = amax if amax is not None else seg
    stage = fp8_stage(dst_fp8 and amax is None, length * hd, cache.device)
    launch(_move_kernel, (triton.cdiv(length, block_t),))(
        cache,
        seg,
        block_ids,
        src_sc if src_fp8 else dummy,
        dst_sc if dst_fp8 else dummy,
        dummy,
        dummy if stage is None else stage,
        start,
        length,
        cache.stride(1),
        seg.stride(0),
        HD=hd,
        HD_PAD=hd_pad,
        HEAD_D=d,
        BLOCK_SIZE=cache.shape[1],
        BLOCK_T=block_t,
        TO_SEG=to_seg,
        SRC_FP8=src_fp8,
        DST_FP8=dst_fp8,
        RAW=src.dtype == dst.dtype and not (src_fp8 or dst_fp8),
        AMAX_ONLY=amax is not None,
        STAGE=stage is not None,
    )
    if stage is None:
        return
    rows = stage.view(length, *cache.shape[2:]).to(FP8)
    if to_seg:
        seg.copy_(rows)
    else:
        put_rows(cache, token_slots(block_ids, start, length, cache.shape[1]), rows)


def _rows_contiguous(seg: torch.Tensor) -> None:
    if seg.stride(1) != seg.shape[2] * seg.shape[3] or seg.stride(3) != 1:
        raise ValueError("segment rows must be contiguous")


def gather_kv_triton(
    cache: LayerCache, ids: torch.Tensor, start: int, out: torch.Tensor, sc: torch.Tensor | None
) -> None:
    """gather_kv: ids the request's block ids, sc the scales of an fp8 out."""
    length = out.shape[1]
    if length == 0:
        return
    _rows_contiguous(out)
    h, d = cache.k.shape[2:]
    for i, (src, scale) in enumerate(cache.sides()):
        if is_fp8(out):
            if is_fp8(src):
                need_scale(sc)[i] = need_scale(scale).float()
            else:
                amax = torch.zeros(h * d, dtype=torch.float32, device=src.device)
                _move(src, out[i], ids, start, length, None, None, True, amax)
                need_scale(sc)[i] = amax.view(h, d).amax(1).clamp(min=1e-12) / FP8_MAX
        dst_sc = need_scale(sc)[i].float().contiguous() if is_fp8(out) else None
        src_sc = need_scale(scale).float().contiguous() if is_fp8(src) else None
        _move(src, out[i], ids, start, length, src_sc, dst_sc, True)


def scatter_kv_triton(
    src: torch.Tensor, cache: LayerCache, ids: torch.Tensor, start: int, sc: torch.Tensor | None
) -> None:
    """scatter_kv: ids the request's block ids, sc the scales of an fp8 src."""
    length = src.shape[1]
    if length == 0:
        return
    _rows_contiguous(src)
    for i, (dst, scale) in enumerate(cache.sides()):
        src_sc = need_scale(sc)[i].float().contiguous() if is_fp8(src) else None
        dst_sc = need_scale(scale).float().contiguous() if is_fp8(dst) else None
        _move(dst, src[i], ids, start, length, src_sc, dst_sc, False)


__all__ = ["gather_kv_triton", "scatter_kv_triton", "write_kv_triton"]
