"""Every Triton kernel of kernels/, run by the Triton interpreter on the CPU
(TRITON_INTERPRET=1), against its torch reference on small randomized shapes.

Interpreter caveats, worked around here and nowhere hidden:
- a bf16 tl.dot returns garbage under the interpreter: attention over a bf16 cache runs
  with fp32 queries (the kernel upcasts K/V to the query dtype), so the bf16 loads are
  still exercised; a GPU runs bf16 end to end.
- an in-kernel fp32 -> fp8 cast rounds wrongly (126.7 becomes 64, not 128): under the
  interpreter the KV kernels write their scaled, saturated fp32 values to a staging buffer
  and torch casts them (kernels/triton_fp8.py `fp8_stage`).
- an in-kernel fp32 -> bf16 cast truncates instead of rounding to nearest: bf16
  destinations are compared within one bf16 ulp.
"""

# E402: triton and the kernel modules are imported only after TRITON_INTERPRET is set below, on
# purpose (the variable is read when @triton.jit decorates, i.e. at import).
# ruff: noqa: E402

from __future__ import annotations

import importlib
import os

import pytest
import torch

# `make gpu-check` sets TIERKV_TEST_DEVICE=cuda: the same tests, compiled, on the GPU.
GPU = os.environ.get("TIERKV_TEST_DEVICE") == "cuda"
_prev = os.environ.get("TRITON_INTERPRET")
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates, i.e. at import
import triton  # a hard dependency of this file: no skip
from triton.runtime.interpreter import InterpretedFunction

from tierkv.kernels import triton_attention, triton_fp8, triton_kv, triton_rope, triton_softmax

# The shared device functions first: the kernels' modules import them.
for _m in (triton_softmax, triton_fp8, triton_attention, triton_kv, triton_rope):
    if GPU != (not any(isinstance(v, InterpretedFunction) for v in vars(_m).values())):
        importlib.reload(_m)  # imported earlier in the other mode
if _prev is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _prev

from tests.test_kernels_cases import Batch, dense_attention, make_batch
from tierkv.kernels import (
    FP8,
    LayerCache,
    RotaryEmbedding,
    gather_kv,
    gather_kv_layers,
    paged_attention_ref,
    quantize_fp8,
    rerotate_k,
    scatter_kv,
    scatter_kv_layers,
    write_kv,
)
from tierkv.kernels.attention_launch import choose_splits
from tierkv.kernels.fp8 import quantize_fp8_ref
from tierkv.kernels.ref_kv import gather_kv_ref, scatter_kv_ref, write_kv_ref
from tierkv.kernels.rope import rotate
from tierkv.kernels.triton_attention import paged_attention_triton

assert triton.__version__
MIXED = [(0, 0), (1, 1), (37, 37), (150, 1), (70, 20), (33, 0), (90, "sparse")]
EDGES = [(16, [0, 15]), (33, [16, 31, 32]), (17, [16]), (40, [39, 0, 20])]


@pytest.fixture(autouse=True)
def _mode(monkeypatch):
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        yield
        return
    assert torch.cuda.is_available(), "TIERKV_TEST_DEVICE=cuda needs CUDA"
    torch.set_default_device("cuda")  # every tensor the cases make lands on the GPU
    yield
    torch.set_default_device(None)


def both(b: Batch, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    args = (b.q, b.cache, b.meta, b.scale)
    return paged_attention_triton(*args, **kw), paged_attention_ref(*args)


@pytest.mark.parametrize(
    "hq,hkv,d,seqs", [(4, 4, 64, MIXED), (8, 2, 128, MIXED), (8, 1, 64, MIXED), (6, 2, 64, EDGES)]
)
def test_attention_fp32(hq, hkv, d, seqs):
    b = make_batch(seed=hq + d, hq=hq, hkv=hkv, d=d, dtype=torch.float32, seqs=seqs)
    tri, ref = both(b)
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(tri, dense_attention(b), atol=2e-5, rtol=1e-4)


def test_attention_fp16():
    b = make_batch(seed=11, hq=8, hkv=2, d=64, dtype=torch.float16, seqs=MIXED)
    tri, ref = both(b)
    torch.testing.assert_close(tri, ref, atol=2e-3, rtol=2e-3)


def test_attention_bf16_cache_fp32_queries():
    b = make_batch(
        seed=12, hq=8, hkv=2, d=64, dtype=torch.float32, cache_dtype=torch.bfloat16, seqs=MIXED
    )
    tri, ref = both(b)
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=1e-4)


def test_attention_fp8_kv():
    b = make_batch(seed=13, hq=8, hkv=2, d=64, dtype=torch.float32, fp8=True, seqs=MIXED)
    tri, ref = both(b)
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("splits,fp8", [(2, False), (4, False), (4, True)])
def test_split_k_decode(splits, fp8):
    seqs = [(1, 1), (150, 1), (300, 1), (0, 0), (47, 1)]
    b = make_batch(seed=20 + splits, hq=8, hkv=2, d=64, dtype=torch.float32, fp8=fp8, seqs=seqs)
    tri, ref = both(b, num_splits=splits)
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="decode"):
        b2 = make_batch(seed=1, hq=4, hkv=2, d=64, dtype=torch.float32, seqs=[(20, 3)])
        both(b2, num_splits=2)


def test_split_choice():
    assert choose_splits(1, 2, 1, 32768, 132) == 128  # one long sequence: spread over the device
    assert choose_splits(32, 2, 1, 32768, 132) * 64 >= 4 * 132
    assert choose_splits(128, 8, 1, 32768, 132) == 1  # the grid fills the device already
    assert choose_splits(1, 8, 512, 32768, 132) == 1  # prefill
    assert choose_splits(1, 8, 1, 300, 132) == 1  # too few keys to split
    assert choose_splits(1, 8, 1, 4096, 132) == 16  # every split keeps >= 4 tiles of 64 keys
    assert choose_splits(1, 8, 1, 32768, 1) == 1  # CPU / interpreter


def test_attention_checks_block_ids():
    b = make_batch(seed=2, hq=4, hkv=2, d=64, dtype=torch.float32, seqs=[(40, 2)])
    b.meta.block_tables[0, 1] = -1
    with pytest.raises(ValueError, match="outside the cache"):
        both(b)


# --- KV movement --------------------------------------------------------------------------


def caches(
    dtype: torch.dtype, seed: int, nb: int = 10, bs: int = 16, h: int = 2, d: int = 64
) -> tuple[LayerCache, LayerCache]:
    """A random cache and a copy of it."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(nb, bs, h, d, generator=g), torch.randn(nb, bs, h, d, generator=g)
    if dtype == FP8:
        sc = torch.tensor([[0.004, 0.007], [0.006, 0.003]])[:, :h]
        c = LayerCache(quantize_fp8_ref(k, sc[0]), quantize_fp8_ref(v, sc[1]), sc[0], sc[1])
    else:
        c = LayerCache(k.to(dtype), v.to(dtype))
    return c, LayerCache(c.k.clone(), c.v.clone(), c.k_scale, c.v_scale)


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.bfloat16:  # interpreter fp32 -> bf16 truncation: one ulp
        torch.testing.assert_close(a.float(), b.float(), atol=1e-30, rtol=2**-7)
    else:
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8])
def test_write_kv(cache_dtype):
    c, c2 = caches(cache_dtype, 1)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(9, 2, 64, generator=g) * 2, torch.randn(9, 2, 64, generator=g)
    slots = torch.tensor([3, -1, 17, 40, 159, 5, 16, -7, 100])
    write_kv(k, v, c, slots)
    write_kv_ref(k, v, c2, slots)
    same(c.k, c2.k)
    same(c.v, c2.v)


PAIRS = [
    (c, s)
    for c in (torch.float32, torch.bfloat16, FP8)
    for s in (torch.float32, torch.bfloat16, FP8)
]


@pytest.mark.parametrize("cache_dtype,seg_dtype", PAIRS)
def test_gather_scatter(cache_dtype, seg_dtype):
    c, c2 = caches(cache_dtype, 3)
    bids = torch.tensor([7, 2, 9, 0, 4], dtype=torch.int32)
    out, want = (
        torch.empty(2, 45, 2, 64, dtype=seg_dtype),
        torch.empty(2, 45, 2, 64, dtype=seg_dtype),
    )
    sc, want_sc = torch.zeros(2, 2), torch.zeros(2, 2)
    gather_kv(c, bids, 13, out, sc)
    gather_kv_ref(c, bids, 13, want, want_sc)
    torch.testing.assert_close(sc, want_sc, atol=0, rtol=0)
    same(out, want)
    scatter_kv(want, c, bids.flip(0).contiguous(), 20, want_sc)
    scatter_kv_ref(want, c2, bids.flip(0).contiguous(), 20, want_sc)
    same(c.k, c2.k)
    same(c.v, c2.v)


def test_layers_roundtrip():
    layers = [torch.randn(2, 8, 16, 2, 64) for _ in range(2)]
    bids = torch.tensor([6, 1, 3], dtype=torch.int32)
    seg = torch.empty(2, 2, 40, 2, 64, dtype=FP8)
    seg_sc = torch.zeros(2, 2, 2)
    gather_kv_layers([LayerCache.of(c) for c in layers], bids, 5, seg, out_scales=seg_sc)
    fresh = [torch.zeros_like(c) for c in layers]
    scatter_kv_layers(seg, [LayerCache.of(c) for c in fresh], bids, 5, src_scales=seg_sc)
    for a, b in zip(layers, fresh):
        slots = bids.long()[torch.arange(5, 45) // 16] * 16 + torch.arange(5, 45) % 16
        torch.testing.assert_close(
            b.view(2, -1, 2, 64)[:, slots], a.view(2, -1, 2, 64)[:, slots], atol=0.03, rtol=2**-4
        )


# --- RoPE and fp8 -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,d", [(torch.float32, 64), (torch.float32, 128), (torch.bfloat16, 64)]
)
def test_rope(dtype, d):
    rope = RotaryEmbedding(
        d,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    )
    g = torch.Generator().manual_seed(d)
    q, k = (
        torch.randn(12, 8, d, generator=g).to(dtype),
        torch.randn(12, 2, d, generator=g).to(dtype),
    )
    pos = torch.randint(0, 5000, (12,), generator=g)
    cos, sin = rope.cos_sin(pos)
    got = rope.apply(q, k, pos)
    for x, want in zip(got, (rotate(q, cos, sin), rotate(k, cos, sin))):
        same(x, want) if dtype == torch.bfloat16 else torch.testing.assert_close(
            x, want, atol=1e-6, rtol=1e-6
        )
    delta = torch.randint(-50, 3000, (12,), generator=g)
    angle = delta.float()[:, None] * rope.inv_freq
    rr = rerotate_k(k, delta, rope)
    want = rotate(k, angle.cos(), angle.sin())
    same(rr, want) if dtype == torch.bfloat16 else torch.testing.assert_close(
        rr, want, atol=1e-6, rtol=1e-6
    )


def test_quantize_fp8():
    x = torch.randn(7, 3, 64) * 30
    sc = torch.tensor([0.05, 0.1, 0.2])
    assert torch.equal(
        quantize_fp8(x, sc).view(torch.uint8), quantize_fp8_ref(x, sc).view(torch.uint8)
    )
