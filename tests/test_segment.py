"""KV segment format: round-trips of every dtype and codec, layer streaming, malformed input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.storage_backends.segment import (
    CODECS,
    PREFIX_NBYTES,
    KVSegment,
    SegmentError,
    SegmentHeader,
    decode_layer,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def make(L=2, T=5, H=2, D=8, dtype=torch.float16, codec="none", seed=0, base=0) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(L, 2, T, H, D, generator=g).to(dtype)
    scales = (
        np.random.default_rng(seed).random((L, 2, H), dtype=np.float32) if dtype in FP8 else None
    )
    return KVSegment.from_tensor(
        kv,
        key=bytes([seed % 256]) * 16,
        parent=b"\x07" * 16,
        tokens=np.arange(T) * 3 + seed,
        fingerprint=b"fp-" + bytes([seed % 256]),
        base_position=base,
        codec=codec,
        scales=scales,
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # compare bytes: fp8/bf16 NaN patterns and -0.0 must survive exactly
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(
    L=st.integers(1, 64),
    T=st.integers(1, 37),
    H=st.integers(1, 4),
    D=st.sampled_from([1, 3, 8, 16]),
    dtype=st.sampled_from(DTYPES),
    codec=st.sampled_from(CODECS),
    seed=st.integers(0, 2**16),
    base=st.integers(-5, 2**40),
    as_bytes=st.booleans(),
)
def test_roundtrip(L, T, H, D, dtype, codec, seed, base, as_bytes):
    seg = make(L, T, H, D, dtype, codec, seed, base)
    buf = seg.encode()
    if codec == "none":
        assert len(buf) == seg.nbytes
    got = KVSegment.decode(bytes(buf) if as_bytes else buf)
    assert same_bits(got.tensor(), seg.tensor())
    g, s = got.header, seg.header
    assert (g.key, g.parent, g.fingerprint, g.base_position) == (
        s.key,
        s.parent,
        s.fingerprint,
        base,
    )
    assert (g.dtype, g.codec, g.quant) == (s.dtype, codec, s.quant)
    assert np.array_equal(g.tokens, s.tokens)
    if dtype in FP8:
        assert np.array_equal(g.scales, s.scales)
        assert g.quant == {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}[g.dtype]
    got.verify()
    # a reader can fetch the prefix, then the header, then each layer's byte range
    h = SegmentHeader.decode(buf[: SegmentHeader.peek_nbytes(buf[:PREFIX_NBYTES])])
    assert h.nbytes == len(buf)
    for i, (off, n) in enumerate(h.layers):
        assert same_bits(decode_layer(h, i, buf[off : off + n]), seg.layer(i))


def test_codec_none_is_zero_copy():
    buf = make().encode()
    seg = KVSegment.decode(buf)
    h = SegmentHeader.decode(buf)
    off, _ = h.layers[1]
    buf[off] ^= 0xFF  # writing the buffer shows through the decoded view
    assert seg.layer(1).reshape(-1).view(torch.uint8)[0] == buf[off]
    with pytest.raises(SegmentError, match="checksum"):
        seg.verify()


def test_shuffle_shrinks_low_entropy_bf16():
    kv = torch.zeros(2, 2, 64, 2, 64, dtype=torch.bfloat16) + torch.arange(64, dtype=torch.bfloat16)
    seg = KVSegment.from_tensor(
        kv, key=b"k" * 16, tokens=range(64), fingerprint=b"f", codec="shuffle+lz4"
    )
    assert len(seg.encode()) < seg.nbytes // 4


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b[:10], "truncated"),
        (lambda b: b[: PREFIX_NBYTES + 30], "truncated header"),
        (lambda b: b[:-1], "bytes, header says"),
        (lambda b: b + b"\0", "bytes, header says"),
        (lambda b: b"XXXX" + b[4:], "bad magic"),
        (lambda b: b[:4] + b"\x02\x00" + b[6:], "version 2"),
        (
            lambda b: (
                b[: PREFIX_NBYTES + 40]
                + bytes([b[PREFIX_NBYTES + 40] ^ 1])
                + b[PREFIX_NBYTES + 41 :]
            ),
            "header checksum",
        ),
        (lambda b: bytes(len(b)), "bad magic"),
        (lambda b: np.random.default_rng(0).bytes(len(b)), "bad magic"),
    ],
)
def test_malformed(mutate, match):
    buf = bytes(make().encode())
    with pytest.raises(SegmentError, match=match):
        KVSegment.decode(mutate(buf))


def test_payload_corruption_and_layer_errors():
    for codec in CODECS:
        buf = make(codec=codec, L=3).encode()
        h = SegmentHeader.decode(buf)
        off, n = h.layers[2]
        buf[off + n // 2] ^= 0x10
        with pytest.raises(SegmentError, match="layer 2"):
            KVSegment.decode(buf)
        KVSegment.decode(
            buf, verify=False
        ) if codec == "none" else None  # unverified decode is allowed
        with pytest.raises(SegmentError, match="layer 2"):
            decode_layer(h, 2, buf[off : off + n])
        with pytest.raises(SegmentError, match="got"):
            decode_layer(h, 0, buf[h.layers[0][0] : h.layers[0][0] + 3])
        with pytest.raises(SegmentError, match="out of range"):
            decode_layer(h, 3, b"")


def test_shape_mismatch_in_header_table():
    # a header whose layer table disagrees with the shape is refused (rebuilt with a valid checksum)
    seg = make()
    h = seg.full_header()
    h.layers = [(off, n - 2) for off, n in h.layers]
    with pytest.raises(SegmentError, match="do not match shape"):
        SegmentHeader.decode(h.encode())


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_quant_must_match_its_dtype(dtype):
    # e4m3 bytes read as e5m2 (or back) would be other numbers: the header must name its pair
    h = make(dtype=dtype).full_header()
    h.quant = "fp8_e5m2" if dtype == torch.float8_e4m3fn else "fp8_e4m3"
    with pytest.raises(SegmentError, match="does not match dtype"):
        SegmentHeader.decode(h.encode())


def test_crafted_header_cannot_ask_for_a_huge_allocation():
    # a valid-checksum header claiming 64 layers of 16M tokens, each "compressed" to 16 bytes
    seg = make(codec="lz4")
    h = seg.full_header()
    h.num_tokens = 1 << 24
    h.tokens = np.zeros(1 << 24, np.int32)
    h.header_nbytes = -(-(h.header_nbytes + 4 * (1 << 24)) // 64) * 64
    h.layers = [(h.header_nbytes, 16), (h.header_nbytes + 16, 16)]
    with pytest.raises(SegmentError, match="do not match shape"):
        SegmentHeader.decode(h.encode())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kv=torch.zeros(2, 3, 4, 1, 1)), r"\[L, 2, T, H, D\]"),
        (dict(kv=torch.zeros(2, 2, 4, 1, 1, dtype=torch.int32)), "unsupported kv dtype"),
        (dict(key=b"short"), "16 bytes"),
        (dict(tokens=[1, 2]), "tokens must be 4"),
        (dict(codec="zstd"), "unknown codec"),
        (dict(scales=np.ones((2, 2, 1), np.float32)), "only for fp8"),
        (dict(kv=torch.zeros(2, 2, 4, 1, 1).to(torch.float8_e4m3fn)), "needs float32 scales"),
        (dict(kv=torch.zeros(2, 2, 4, 1, 1).to(torch.float8_e5m2)), "needs float32 scales"),
    ],
)
def test_from_tensor_refuses_bad_input(kwargs, match):
    args = dict(kv=torch.zeros(2, 2, 4, 1, 1), key=b"k" * 16, tokens=[1, 2, 3, 4], fingerprint=b"f")
    args.update(kwargs)
    kv = args.pop("kv")
    with pytest.raises(SegmentError, match=match):
        KVSegment.from_tensor(kv, **args)
