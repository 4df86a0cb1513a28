"""KV segments: the one encoding of a chunk's KV, in memory, in files, in Redis, on the wire.

The byte format and its header are in header.py, the per-layer codecs in codec.py. A segment
is one SegmentHeader plus a layer-major payload [num_layers, 2, num_tokens, num_kv_heads,
head_dim].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from tierkv.storage_backends.codec import (
    DTYPES,
    bytes_of,
    decode_layer,
    decode_layer_bytes,
    dtype_name,
    encode_layer,
    frombuffer,
)
from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.header import (
    CODECS,
    DTYPE_NAMES,
    MAX_DIM,
    PREFIX_NBYTES,
    QUANT_OF,
    VERSION,
    SegmentError,
    SegmentHeader,
    checksum,
    header_nbytes_for,
)

__all__ = [
    "CODECS",
    "DTYPES",
    "PREFIX_NBYTES",
    "VERSION",
    "KVSegment",
    "SegmentError",
    "SegmentHeader",
    "checksum",
    "decode_layer",
    "decode_layer_bytes",
    "dtype_name",
]


def layout(header_nbytes: int, lengths: list[int]) -> list[tuple[int, int]]:
    """(offset in the encoded segment, length) of layers of these lengths, back to back."""
    offsets = np.cumsum([0] + lengths[:-1]) + header_nbytes
    return [(int(o), n) for o, n in zip(offsets, lengths)]


def raw_layout(h: SegmentHeader) -> list[tuple[int, int]]:
    return layout(h.header_nbytes, [h.layer_raw_nbytes] * h.num_layers)


@dataclass(slots=True)
class KVSegment:
    """A chunk's KV, payload [L, 2, T, H, D], and its header: what a reader must check before
    using it.

    The header describes the payload encoded raw (layers back to back at their raw length);
    its codec is what a writer applies to each layer. Its checksums are of each layer's raw
    bytes; empty until computed (compute_checksums) for a segment made from a tensor.
    """

    header: SegmentHeader
    payload: torch.Tensor
    # True when this payload's bytes were checked against the checksums as they entered this
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
        quant = QUANT_OF.get(dtype, "none")
        if quant != "none":
            sc = np.asarray(scales if scales is not None else [], dtype=np.float32)
            if sc.shape != (L, 2, H):
                raise SegmentError(
                    f"fp8 kv needs float32 scales [{L}, 2, {H}], got shape {sc.shape}"
                )
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
        return KVSegment(h, kv.contiguous())

    @property
    def key(self) -> bytes:
        return self.header.key

    @property
    def tokens(self) -> np.ndarray:
        return self.header.tokens

    @property
    def num_layers(self) -> int:
        return self.header.num_layers

    def compute_checksums(self) -> list[int]:
        """Each layer's checksum, computed on first use (into a header of this segment's own:
        a header may be shared)."""
        if not self.header.checksums:
            sums = [checksum(self._raw_layer(i)) for i in range(self.num_layers)]
            self.header = dataclasses.replace(self.header, checksums=sums)
        return self.header.checksums

    def full_header(self) -> SegmentHeader:
        """The header with every layer's checksum: what a writer sends."""
        self.compute_checksums()
        return self.header

    def _raw_layer(self, i: int) -> memoryview:
        return bytes_of(self.payload[i].cpu())

    def encode_parts(self) -> tuple[SegmentHeader, bytes, list]:
        """(header, header bytes, each layer's encoded bytes): lets a writer stream without a
        join."""
        h = self.full_header()
        size = DTYPES[h.dtype].itemsize
        blobs = [encode_layer(self._raw_layer(i), h.codec, size) for i in range(h.num_layers)]
        if h.codec != "none":
            lengths = [len(memoryview(b).cast("B")) for b in blobs]
            h = dataclasses.replace(h, layers=layout(h.header_nbytes, lengths))
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
        return self.header.header_nbytes + self.payload.numel() * self.payload.element_size()

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
        payload = frombuffer(raw, dt, 0, h.payload_raw_nbytes // dt.itemsize)
        seg = KVSegment.of_header(h, payload)
        seg.verified = verify
        return seg

    @staticmethod
    def of_header(h: SegmentHeader, payload: torch.Tensor) -> KVSegment:
        """The segment a checked header describes, over its decoded payload (not copied)."""
        if h.codec != "none":  # a segment's header describes its payload encoded raw
            h = dataclasses.replace(h, layers=raw_layout(h))
        return KVSegment(h, payload.view(h.num_layers, *h.layer_shape))

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's K and V, [2, T, H, D]: a view of the payload."""
        return self.payload[i]

    def tensor(self) -> torch.Tensor:
        return self.payload

    def verify(self) -> None:
        """Recompute each layer's checksum against the recorded one; SegmentError on mismatch."""
        if not self.header.checksums:
            self.compute_checksums()
            return
        for i in range(self.num_layers):
            if checksum(self._raw_layer(i)) != self.header.checksums[i]:
                raise SegmentError(f"layer {i}: checksum mismatch")
