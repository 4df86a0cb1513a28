"""Where a segment's layers lie in its encoding, and the header of a segment made from a KV
tensor, every field checked."""

from __future__ import annotations

import numpy as np
import torch

from tierkv.storage_backends.codec import dtype_name
from tierkv.storage_backends.header import (
    CODECS,
    DTYPE_NAMES,
    MAX_DIM,
    QUANT_OF,
    SegmentError,
    SegmentHeader,
    header_nbytes_for,
)


def layout(header_nbytes: int, lengths: list[int]) -> list[tuple[int, int]]:
    """(offset in the encoded segment, length) of layers of these lengths, back to back."""
    offsets = np.cumsum([0] + lengths[:-1]) + header_nbytes
    return [(int(o), n) for o, n in zip(offsets, lengths)]


def raw_layout(h: SegmentHeader) -> list[tuple[int, int]]:
    return layout(h.header_nbytes, [h.layer_raw_nbytes] * h.num_layers)


def tensor_header(
    kv: torch.Tensor,
    key: bytes,
    parent: bytes,
    tokens,
    fingerprint: bytes,
    base_position: int,
    codec: str,
    scales,
) -> SegmentHeader:
    """The header of kv [L, 2, T, H, D] as a segment (no checksums yet); SegmentError names the
    first field that is off."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2 or kv.numel() == 0:
        raise SegmentError(
            f"kv must be a non-empty [L, 2, T, H, D] tensor, got "
            f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}"
        )
    dtype = dtype_name(kv.dtype)
    if dtype is None:
        raise SegmentError(f"unsupported kv dtype {kv.dtype}; supported: {list(DTYPE_NAMES)}")
    if not (
        isinstance(key, bytes)
        and len(key) == 16
        and isinstance(parent, bytes)
        and len(parent) == 16
    ):
        raise SegmentError("key and parent must be 16 bytes each")
    if codec not in CODECS:
        raise SegmentError(f"unknown codec {codec!r}; known: {CODECS}")
    L, _, T, H, D = kv.shape
    tok = np.asarray(tokens, dtype=np.int64)
    if tok.shape != (T,) or (tok.size and (tok.min() < -(2**31) or tok.max() >= 2**31)):
        raise SegmentError(f"tokens must be {T} int32 values, got shape {tok.shape}")
    quant = QUANT_OF.get(dtype, "none")
    if quant != "none":
        sc = np.asarray(scales if scales is not None else [], dtype=np.float32)
        if sc.shape != (L, 2, H):
            raise SegmentError(f"fp8 kv needs float32 scales [{L}, 2, {H}], got shape {sc.shape}")
    elif scales is not None:
        raise SegmentError(f"scales are only for fp8 kv ({list(QUANT_OF)}), not {dtype}")
    else:
        sc = None
    if max(L, T, H, D) > MAX_DIM:
        raise SegmentError(f"shape {tuple(kv.shape)} too large")
    fp = bytes(fingerprint)
    h = SegmentHeader(
        key=key,
        parent=parent,
        num_layers=L,
        num_tokens=T,
        num_kv_heads=H,
        head_dim=D,
        base_position=int(base_position),
        dtype=dtype,
        quant=quant,
        codec=codec,
        fingerprint=fp,
        tokens=tok.astype(np.int32),
        scales=sc,
        layers=[],
        checksums=[],
        header_nbytes=header_nbytes_for(L, T, H, len(fp), quant),
    )
    h.layers = raw_layout(h)
    return h
