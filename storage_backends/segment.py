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
    PREFIX_NBYTES,
    VERSION,
    SegmentError,
    SegmentHeader,
    checksum,
)
from tierkv.storage_backends.tensor_header import layout, raw_layout, tensor_header

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
        h = tensor_header(kv, key, parent, tokens, fingerprint, base_position, codec, scales)
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
