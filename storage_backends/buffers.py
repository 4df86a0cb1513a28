"""Caller-provided destinations (`out=`): writable byte views of buffers and tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.segment import KVSegment


def check_out(out: Any) -> None:
    """ValueError unless out can receive a payload: a contiguous tensor (any device) or a
    writable, contiguous buffer. Its size is checked once the payload's is known (out_view)."""
    if isinstance(out, torch.Tensor):
        if not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor")
        return
    try:
        mv = memoryview(out).cast("B")
    except TypeError:
        raise ValueError(
            f"out must be a tensor or a writable contiguous buffer, got {type(out).__name__}"
        ) from None
    if mv.readonly:
        raise ValueError("out must be writable")


def out_view(out: Any, nbytes: int) -> memoryview | None:
    """A writable byte view of the first nbytes of out, or None when out lives off the CPU
    (the caller then copies with torch). ValueError when out is read-only or too small."""
    check_out(out)
    if isinstance(out, torch.Tensor):
        if out.numel() * out.element_size() < nbytes:
            raise ValueError(
                f"out has {out.numel() * out.element_size()} bytes, the segment needs {nbytes}"
            )
        if out.device.type != "cpu":
            return None
        return out.reshape(-1).view(torch.uint8).numpy().data[:nbytes]
    mv = memoryview(out).cast("B")
    if len(mv) < nbytes:
        raise ValueError(f"out has {len(mv)} bytes, the segment needs {nbytes}")
    return mv[:nbytes]


def views(t: torch.Tensor, out: Any) -> bool:
    """Whether tensor t already lies at the start of out, so nothing needs copying."""
    if isinstance(out, torch.Tensor):
        return t.device == out.device and t.data_ptr() == out.data_ptr()
    mv = memoryview(out).cast("B")
    if t.device.type != "cpu" or not len(mv):
        return False
    return bool(t.data_ptr() == np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def copy_into(seg: KVSegment, out: Any) -> KVSegment:
    """Copy seg's payload into out (any device) and return a segment whose payload views out."""
    src = seg.payload.contiguous().reshape(-1).view(torch.uint8)
    copied("buffers.copy", src.numel())
    mv = out_view(out, src.numel())
    if mv is None:
        dst = out.reshape(-1).view(torch.uint8)[: src.numel()]
        dst.copy_(src, non_blocking=True)
    else:
        mv[:] = (src.cpu() if src.device.type != "cpu" else src).numpy().data
        dst = torch.frombuffer(mv, dtype=torch.uint8)
    return KVSegment(seg.header, dst.view(seg.payload.dtype).view(seg.payload.shape))


def clone_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous copy of t on device. Host to host it is a plain memcpy: torch's threaded
    copy kernel is many times slower than one memcpy on a busy machine."""
    if t.device.type != "cpu" or device.type != "cpu":
        return t.to(device, copy=True).contiguous()
    out = torch.empty(t.shape, dtype=t.dtype)
    src = t.contiguous().reshape(-1).view(torch.uint8)
    copied("buffers.copy", src.numel())
    out.reshape(-1).view(torch.uint8).numpy().data[:] = src.numpy().data
    return out
