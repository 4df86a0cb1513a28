"""The KV segment byte format and its header, which a reader can decode from the first bytes alone.

Byte format (version 1, all integers little-endian):

    prefix   20 B   magic b"TKVS" | version u16 | flags u16 (0) | header_nbytes u32
                    | header_checksum u64 (xxh3_64 of bytes [20, header_nbytes))
    fixed    64 B   key 16s | parent 16s | num_layers u32 | num_tokens u32
                    | num_kv_heads u32 | head_dim u32 | base_position i64
                    | dtype u8 | quant u8 | codec u8 | 0 u8 | fingerprint_len u32
    fingerprint     fingerprint_len bytes
    tokens          int32[num_tokens]
    scales          float32[num_layers, 2, num_kv_heads]   (only when quant is fp8_*)
    layer table     num_layers x (offset u64, length u64, checksum u64); offset is from the
                    payload start; checksum is xxh3_64 of the layer's *decoded* bytes
    zero padding    up to header_nbytes, a multiple of 64
    payload         layer-major [num_layers, 2, num_tokens, num_kv_heads, head_dim], each
                    layer encoded by the codec: none (raw), lz4 (lz4 block), shuffle+lz4
                    (byte planes of each element, then lz4 block)

A reader may fetch `PREFIX_NBYTES`, then `header_nbytes`, then one layer's byte range at a
time, and check each layer alone with `decode_layer`. Anything malformed raises SegmentError.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = b"TKVS"
VERSION = 1
PREFIX = struct.Struct("<4sHHIQ")
FIXED = struct.Struct("<16s16sIIIIqBBBBI")
LAYER = struct.Struct("<QQQ")
PREFIX_NBYTES = PREFIX.size
ALIGN = 64
# The one table of kv dtypes a segment can hold: torch's name of each, and its bytes per
# element. A name's position is its code in the header: append only (codes are on disk).
ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
DTYPE_NAMES: tuple[str, ...] = tuple(ITEMSIZE)
QUANTS = ["none", "fp8_e4m3", "fp8_e5m2"]  # append only, as the dtypes
# The quant of each fp8 dtype (its scales are in the header); every other dtype's is none.
QUANT_OF: dict[str, str] = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
CODECS = ["none", "lz4", "shuffle+lz4"]
MAX_DIM = 1 << 24  # bounds each shape field so garbage cannot ask for a huge allocation


class SegmentError(ValueError):
    """The one error for a malformed segment or bad segment input; the message says what."""


def checksum(raw) -> int:
    """xxh3_64 of a bytes-like object: the per-layer and header checksum of the format."""
    return xxhash.xxh3_64_intdigest(raw)


@dataclass(slots=True)
class SegmentHeader:
    """Everything about a segment except its payload; decodable from the first bytes alone."""

    key: bytes
    parent: bytes
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    base_position: int
    dtype: str
    quant: str
    codec: str
    fingerprint: bytes
    tokens: np.ndarray
    scales: np.ndarray | None
    layers: list[tuple[int, int]]  # (absolute offset in the encoded segment, length)
    checksums: list[int]
    header_nbytes: int

    @property
    def nbytes(self) -> int:
        """Length of the whole encoded segment."""
        return self.header_nbytes + sum(n for _, n in self.layers)

    @property
    def layer_raw_nbytes(self) -> int:
        return 2 * self.num_tokens * self.num_kv_heads * self.head_dim * ITEMSIZE[self.dtype]

    @property
    def payload_raw_nbytes(self) -> int:
        return self.num_layers * self.layer_raw_nbytes

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_tokens, self.num_kv_heads, self.head_dim)

    @staticmethod
    def peek_nbytes(prefix) -> int:
        """header_nbytes from the first PREFIX_NBYTES bytes, so a reader knows what to fetch."""
        mv = memoryview(prefix).cast("B")
        if len(mv) < PREFIX_NBYTES:
            raise SegmentError(
                f"truncated segment: {len(mv)} bytes, the prefix needs {PREFIX_NBYTES}"
            )
        magic, version, flags, header_nbytes, _ = PREFIX.unpack_from(mv)
        if magic != MAGIC:
            raise SegmentError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise SegmentError(f"unsupported segment format version {version}, expected {VERSION}")
        if flags != 0 or header_nbytes % ALIGN or header_nbytes < PREFIX_NBYTES + FIXED.size:
            raise SegmentError(f"bad prefix: flags={flags} header_nbytes={header_nbytes}")
        return header_nbytes

    @staticmethod
    def decode(buf) -> SegmentHeader:
        mv = memoryview(buf).cast("B")
        hn = SegmentHeader.peek_nbytes(mv)
        if len(mv) < hn:
            raise SegmentError(f"truncated header: {len(mv)} bytes, the header needs {hn}")
        if checksum(mv[PREFIX_NBYTES:hn]) != PREFIX.unpack_from(mv)[4]:
            raise SegmentError("header checksum mismatch")
        (key, parent, nl, nt, nh, hd, base, dt, qu, co, _, fl) = FIXED.unpack_from(
            mv, PREFIX_NBYTES
        )
        if not (1 <= nl <= 4096 and 1 <= nt <= MAX_DIM and 1 <= nh <= 4096 and 1 <= hd <= 4096):
            raise SegmentError(f"bad shape [{nl}, 2, {nt}, {nh}, {hd}]")
        if dt >= len(DTYPE_NAMES) or qu >= len(QUANTS) or co >= len(CODECS):
            raise SegmentError(f"bad dtype/quant/codec codes {dt}/{qu}/{co}")
        dtype, quant = DTYPE_NAMES[dt], QUANTS[qu]
        if quant != QUANT_OF.get(dtype, "none"):
            raise SegmentError(f"quant {quant} does not match dtype {dtype}")
        nscales = nl * 2 * nh if quant != "none" else 0
        pos = PREFIX_NBYTES + FIXED.size
        need = pos + fl + 4 * nt + 4 * nscales + LAYER.size * nl
        if need > hn:
            raise SegmentError(f"header fields need {need} bytes, header_nbytes is {hn}")
        fingerprint = bytes(mv[pos : pos + fl])
        pos += fl
        tokens = np.frombuffer(mv, dtype="<i4", count=nt, offset=pos).astype(np.int32)
        pos += 4 * nt
        scales = None
        if nscales:
            scales = (
                np.frombuffer(mv, dtype="<f4", count=nscales, offset=pos).reshape(nl, 2, nh).copy()
            )
            pos += 4 * nscales
        h = SegmentHeader(
            bytes(key),
            bytes(parent),
            nl,
            nt,
            nh,
            hd,
            base,
            dtype,
            quant,
            CODECS[co],
            fingerprint,
            tokens,
            scales,
            [],
            [],
            hn,
        )
        at, raw = 0, h.layer_raw_nbytes
        for i in range(nl):
            off, n, ck = LAYER.unpack_from(mv, pos + i * LAYER.size)
            # lz4 expands by at most 1/255 and shrinks by at most 255x: this bounds what a
            # crafted header can make a reader allocate to 255x the bytes it really sent
            if (
                off != at
                or n == 0
                or (h.codec == "none" and n != raw)
                or n > raw + raw // 8 + 1024
                or raw > 255 * n + 64
            ):
                raise SegmentError(
                    f"layer {i}: offset {off} length {n} do not match shape "
                    f"(expected offset {at}, raw length {raw}, codec {h.codec})"
                )
            h.layers.append((hn + off, n))
            h.checksums.append(ck)
            at += n
        return h

    def encode(self) -> bytes:
        fixed = FIXED.pack(
            self.key,
            self.parent,
            self.num_layers,
            self.num_tokens,
            self.num_kv_heads,
            self.head_dim,
            self.base_position,
            DTYPE_NAMES.index(self.dtype),
            QUANTS.index(self.quant),
            CODECS.index(self.codec),
            0,
            len(self.fingerprint),
        )
        parts = [fixed, self.fingerprint, self.tokens.astype("<i4").tobytes()]
        if self.scales is not None:
            parts.append(self.scales.astype("<f4").tobytes())
        parts += [
            LAYER.pack(off - self.header_nbytes, n, ck)
            for (off, n), ck in zip(self.layers, self.checksums)
        ]
        body = b"".join(parts)  # small: the header only, never the payload
        body += bytes(self.header_nbytes - PREFIX_NBYTES - len(body))
        return PREFIX.pack(MAGIC, VERSION, 0, self.header_nbytes, checksum(body)) + body


def header_nbytes_for(
    num_layers: int, num_tokens: int, num_kv_heads: int, fingerprint_len: int, quant: str
) -> int:
    n = PREFIX_NBYTES + FIXED.size + fingerprint_len + 4 * num_tokens + LAYER.size * num_layers
    n += 4 * num_layers * 2 * num_kv_heads if quant != "none" else 0
    return -(-n // ALIGN) * ALIGN
