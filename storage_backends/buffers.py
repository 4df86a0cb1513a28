"""Caller-provided destinations (`out=`): writable byte views of buffers and tensors."""

from __future__ import annotations

import torch

from tierkv.storage_backends.segment import KVSegment, SegmentHeader


def out_view(out, nbytes: int) -> memoryview | None:
    """A writable byte view of the first nbytes of out, or None when out lives off the CPU
    (the caller then copies with torch). ValueError when out is read-only or too small."""
    if isinstance(out, torch.Tensor):
        if not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor")
        if out.numel() * out.element_size() < nbytes:
            raise ValueError(
                f"out has {out.numel() * out.element_size()} bytes, the segment needs {nbytes}"
            )
        if out.device.type != "cpu":
            return None
        return memoryview(out.reshape(-1).view(torch.uint8).numpy())[:nbytes]
    mv = memoryview(out).cast("B")
    if mv.readonly:
        raise ValueError("out must be writable")
    if len(mv) < nbytes:
        raise ValueError(f"out has {len(mv)} bytes, the segment needs {nbytes}")
    return mv[:nbytes]


def copy_into(seg: KVSegment, h: SegmentHeader, out) -> KVSegment:
    """Copy seg's payload into out (any device) and return a segment whose payload views out."""
    n = h.payload_raw_nbytes
    mv = out_view(out, n)
    if mv is None:
        dst = out.reshape(-1).view(torch.uint8)[:n]
        dst.copy_(seg.payload.reshape(-1).view(torch.uint8), non_blocking=True)
        shape = (h.num_layers, *h.layer_shape)
        return with_payload(seg, dst.view(seg.payload.dtype).view(shape))
    src = seg.payload.reshape(-1).view(torch.uint8)
    mv[:] = memoryview((src.cpu() if src.device.type != "cpu" else src).numpy())
    return KVSegment.from_raw(h, mv, verify=False)


def clone_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous copy of t on device. Host to host it is a plain memcpy: torch's threaded
    copy kernel is many times slower than one memcpy on a busy machine."""
    if t.device.type != "cpu" or device.type != "cpu":
        return t.to(device, copy=True).contiguous()
    out = torch.empty(t.shape, dtype=t.dtype)
    src = t.contiguous().reshape(-1).view(torch.uint8)
    memoryview(out.reshape(-1).view(torch.uint8).numpy())[:] = memoryview(src.numpy())
    return out


def with_payload(seg: KVSegment, payload: torch.Tensor) -> KVSegment:
    return KVSegment(
        seg.key,
        seg.parent,
        seg.tokens,
        seg.fingerprint,
        seg.num_layers,
        seg.num_tokens,
        seg.num_kv_heads,
        seg.head_dim,
        seg.dtype,
        seg.quant,
        seg.scales,
        seg.base_position,
        seg.codec,
        payload,
        seg.checksums,
    )
