"""Per-layer codecs of a segment's payload, and the check and decoding of one layer's bytes.

A layer is encoded by the segment's codec: none (its raw bytes), lz4 (an lz4 block), or
shuffle+lz4 (the byte planes of each element, then an lz4 block). Its checksum is of the raw
bytes, so a reader checks a layer alone, whatever the codec.
"""

from __future__ import annotations

import warnings

import lz4.block
import numpy as np
import torch

from tierkv.storage_backends.header import DTYPE_NAMES, SegmentError, SegmentHeader, checksum

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
_NAME_OF: dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str | None:
    """The segment dtype name of a torch dtype (torch's own name), None when no segment holds it."""
    return _NAME_OF.get(dtype)


def frombuffer(buf, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    if not memoryview(buf).readonly:
        return torch.frombuffer(buf, dtype=dtype, offset=offset, count=count)
    with warnings.catch_warnings():  # read-only bytes are fine: tiers never write through views
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=dtype, offset=offset, count=count)


def bytes_of(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def encode_layer(raw: memoryview, codec: str, itemsize: int):
    if codec == "none":
        return raw
    if codec == "shuffle+lz4":
        raw = np.ascontiguousarray(np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T).data
    return lz4.block.compress(raw, store_size=False)


def decode_layer_bytes(h: SegmentHeader, i: int, data) -> memoryview:
    """Layer i's encoded bytes decoded and checked against its checksum (SegmentError if not)."""
    raw_n = h.layer_raw_nbytes
    data = memoryview(data).cast("B")
    if len(data) != h.layers[i][1]:
        raise SegmentError(f"layer {i}: got {len(data)} bytes, header says {h.layers[i][1]}")
    if h.codec != "none":
        try:
            out = lz4.block.decompress(data, uncompressed_size=raw_n)
        except lz4.block.LZ4BlockError as e:
            raise SegmentError(f"layer {i}: lz4 data is corrupt ({e})") from None
        if len(out) != raw_n:
            raise SegmentError(f"layer {i}: decompressed {len(out)} bytes, expected {raw_n}")
        if h.codec == "shuffle+lz4":
            size = DTYPES[h.dtype].itemsize
            out = np.ascontiguousarray(np.frombuffer(out, np.uint8).reshape(size, -1).T).tobytes()
        data = memoryview(out)
    if checksum(data) != h.checksums[i]:
        raise SegmentError(f"layer {i}: checksum mismatch")
    return data


def decode_layer(header: SegmentHeader, i: int, data) -> torch.Tensor:
    """Check and decode one layer's encoded bytes into a [2, T, H, D] tensor (a view for codec
    none)."""
    if not 0 <= i < header.num_layers:
        raise SegmentError(f"layer {i} out of range [0, {header.num_layers})")
    raw = decode_layer_bytes(header, i, data)
    n = header.layer_raw_nbytes // DTYPES[header.dtype].itemsize
    return frombuffer(raw, DTYPES[header.dtype], 0, n).view(header.layer_shape)
