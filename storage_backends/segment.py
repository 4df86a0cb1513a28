"""KV segments: the one encoding of a chunk's KV, in memory, in files, in Redis, on the wire.

The byte format is in storage_backends/header.py. A segment is its header plus a layer-major
payload [num_layers, 2, num_tokens, num_kv_heads, head_dim]; codecs none (default), lz4, and
shuffle+lz4 (byte planes of each element, then lz4) apply per layer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import lz4.block
import numpy as np
import torch

from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.header import (
    ALIGN,
    CODECS,
    DTYPE_NAMES,
    FIXED,
    ITEMSIZE,
    LAYER,
    MAGIC,
    MAX_DIM,
    PREFIX,
    PREFIX_NBYTES,
    QUANTS,
    VERSION,
    SegmentError,
    SegmentHeader,
    checksum,
    header_nbytes_for,
)

__all__ = [
    "ALIGN",
    "CODECS",
    "DTYPES",
    "DTYPE_NAMES",
    "FIXED",
    "ITEMSIZE",
    "LAYER",
    "MAGIC",
    "MAX_DIM",
    "PREFIX",
    "PREFIX_NBYTES",
    "QUANTS",
    "VERSION",
    "KVSegment",
    "SegmentError",
    "SegmentHeader",
    "checksum",
    "decode_layer",
    "dtype_name",
    "header_nbytes_for",
]

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
_NAME_OF: dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str | None:
    """The segment dtype name of a torch dtype (torch's own name), None when no segment holds it."""
    return _NAME_OF.get(dtype)


def _frombuffer(buf, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    if not memoryview(buf).readonly:
        return torch.frombuffer(buf, dtype=dtype, offset=offset, count=count)
    with warnings.catch_warnings():  # read-only bytes are fine: tiers never write through views
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=dtype, offset=offset, count=count)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def _encode_layer(raw: memoryview, codec: str, itemsize: int):
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
    return _frombuffer(raw, DTYPES[header.dtype], 0, n).view(header.layer_shape)


@dataclass(slots=True)
class KVSegment:
    """A chunk's KV plus what a reader must check before using it. payload is [L, 2, T, H, D]."""

    key: bytes
    parent: bytes
    tokens: np.ndarray
    fingerprint: bytes
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    quant: str
    scales: np.ndarray | None
    base_position: int
    codec: str
    payload: torch.Tensor
    checksums: list[int] | None = None  # of each layer's raw bytes; None until computed
    # True when this payload's bytes were checked against `checksums` as they entered this
    # process (a tier reading from disk, Redis or a server): a reader need not check again.
    verified: bool = False
    # True when the caller hands the payload over: nothing writes it after a put, so a store
    # may keep this segment for its background writes instead of a copy (the connector's
    # staging tensors and the server's receive buffers are handed over this way).
    owned: bool = False
    # The whole encoded segment when this one was decoded from it (the payload of codec none
    # views it): a writer sends these bytes instead of encoding again. Valid as the payload is.
    encoded: memoryview | None = None

    @staticmethod
    def from_tensor(
        kv: torch.Tensor,
        *,
        key: bytes,
        parent: bytes = bytes(16),
        tokens,
        fingerprint: bytes,
        base_position: int = 0,
        codec: str = "none",
        scales=None,
    ) -> KVSegment:
        """Wrap kv [L, 2, T, H, D] (shared, not copied, when contiguous); checks every field."""
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
        quant = "fp8_e4m3" if dtype == "float8_e4m3fn" else "none"
        if quant == "fp8_e4m3":
            sc = np.asarray(scales if scales is not None else [], dtype=np.float32)
            if sc.shape != (L, 2, H):
                raise SegmentError(
                    f"fp8 kv needs float32 scales [{L}, 2, {H}], got shape {sc.shape}"
                )
        elif scales is not None:
            raise SegmentError(f"scales are only for float8_e4m3fn kv, not {dtype}")
        else:
            sc = None
        if max(L, T, H, D) > MAX_DIM:
            raise SegmentError(f"shape {tuple(kv.shape)} too large")
        return KVSegment(
            key,
            parent,
            tok.astype(np.int32),
            bytes(fingerprint),
            L,
            T,
            H,
            D,
            dtype,
            quant,
            sc,
            int(base_position),
            codec,
            kv.contiguous(),
        )

    def header(self, lengths: list[int] | None = None) -> SegmentHeader:
        hn = header_nbytes_for(
            self.num_layers, self.num_tokens, self.num_kv_heads, len(self.fingerprint), self.quant
        )
        raw = 2 * self.num_tokens * self.num_kv_heads * self.head_dim * DTYPES[self.dtype].itemsize
        lengths = lengths or [raw] * self.num_layers
        offs = np.cumsum([0] + lengths[:-1]) + hn
        return SegmentHeader(
            self.key,
            self.parent,
            self.num_layers,
            self.num_tokens,
            self.num_kv_heads,
            self.head_dim,
            self.base_position,
            self.dtype,
            self.quant,
            self.codec,
            self.fingerprint,
            self.tokens,
            self.scales,
            [(int(o), n) for o, n in zip(offs, lengths)],
            self.compute_checksums(),
            hn,
        )

    def compute_checksums(self) -> list[int]:
        if self.checksums is None:
            self.checksums = [checksum(self._raw_layer(i)) for i in range(self.num_layers)]
        return self.checksums

    def _raw_layer(self, i: int) -> memoryview:
        return _bytes_of(self.payload[i].cpu())

    def encode_parts(self) -> tuple[SegmentHeader, bytes, list]:
        """(header, header bytes, each layer's encoded bytes): lets a writer stream without a
        join."""
        size = DTYPES[self.dtype].itemsize
        blobs = [
            _encode_layer(self._raw_layer(i), self.codec, size) for i in range(self.num_layers)
        ]
        h = self.header([len(memoryview(b).cast("B")) for b in blobs])
        return h, h.encode(), blobs

    def encode(self) -> bytearray | memoryview:
        """The whole encoded segment, bytes-like: the bytes it was decoded from when it has them,
        else one new allocation."""
        if self.encoded is not None:
            return self.encoded
        h, head, blobs = self.encode_parts()
        out = bytearray(h.nbytes)
        mv = memoryview(out)
        mv[: len(head)] = head
        for (off, n), b in zip(h.layers, blobs):
            mv[off : off + n] = memoryview(b).cast("B")
        copied("segment.encode", len(out))
        return out

    @property
    def nbytes(self) -> int:
        """Header plus raw payload: the exact length of encode() for codec none."""
        return (
            header_nbytes_for(
                self.num_layers,
                self.num_tokens,
                self.num_kv_heads,
                len(self.fingerprint),
                self.quant,
            )
            + self.payload.numel() * self.payload.element_size()
        )

    @staticmethod
    def decode(buf, verify: bool = True) -> KVSegment:
        """Decode; for codec none the payload is a view of buf, valid while buf is unchanged."""
        mv = memoryview(buf).cast("B")
        h = SegmentHeader.decode(mv)
        if len(mv) != h.nbytes:
            raise SegmentError(f"segment is {len(mv)} bytes, header says {h.nbytes}")
        return KVSegment.from_parts(h, mv, verify)

    @staticmethod
    def from_parts(h: SegmentHeader, mv: memoryview, verify: bool = True) -> KVSegment:
        """Build from a decoded header and the whole encoded buffer mv (its payload at h.layers)."""
        if h.codec == "none":
            seg = KVSegment.from_raw(h, mv[h.header_nbytes : h.nbytes], verify)
        else:
            raw = bytearray(h.payload_raw_nbytes)
            n = h.layer_raw_nbytes
            for i, (off, ln) in enumerate(h.layers):
                raw[i * n : (i + 1) * n] = decode_layer_bytes(h, i, mv[off : off + ln])
            seg = KVSegment.from_raw(h, memoryview(raw), verify=False)
        seg.encoded = mv[: h.nbytes]
        return seg

    @staticmethod
    def from_raw(h: SegmentHeader, raw: memoryview, verify: bool = True) -> KVSegment:
        """Build over raw, the decoded payload bytes (kept as a view, not copied)."""
        dt, n = DTYPES[h.dtype], h.layer_raw_nbytes
        if len(raw) < h.payload_raw_nbytes:
            raise SegmentError(
                f"payload is {len(raw)} bytes, the shape needs {h.payload_raw_nbytes}"
            )
        if verify:
            for i in range(h.num_layers):
                if checksum(raw[i * n : (i + 1) * n]) != h.checksums[i]:
                    raise SegmentError(f"layer {i}: checksum mismatch")
        payload = _frombuffer(raw, dt, 0, h.payload_raw_nbytes // dt.itemsize)
        seg = KVSegment.of_header(h, payload)
        seg.verified = verify
        return seg

    @staticmethod
    def of_header(h: SegmentHeader, payload: torch.Tensor) -> KVSegment:
        """The segment a checked header describes, over its decoded payload (not copied)."""
        return KVSegment(
            h.key,
            h.parent,
            h.tokens,
            h.fingerprint,
            h.num_layers,
            h.num_tokens,
            h.num_kv_heads,
            h.head_dim,
            h.dtype,
            h.quant,
            h.scales,
            h.base_position,
            h.codec,
            payload.view(h.num_layers, *h.layer_shape),
            list(h.checksums),
        )

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's K and V, [2, T, H, D]: a view of the payload."""
        return self.payload[i]

    def tensor(self) -> torch.Tensor:
        return self.payload

    def verify(self) -> None:
        """Recompute each layer's checksum against the recorded one; SegmentError on mismatch."""
        if self.checksums is None:
            self.compute_checksums()
            return
        for i in range(self.num_layers):
            if checksum(self._raw_layer(i)) != self.checksums[i]:
                raise SegmentError(f"layer {i}: checksum mismatch")
