"""The torch references of kernels/, proven against independent dense implementations:
paged attention vs per-sequence gathered KV + scaled_dot_product_attention, gather /
scatter vs per-token copies. RoPE and fp8: test_kernels_rope_fp8.py."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_kernels_cases import Batch, dense_attention, make_batch
from tierkv.kernels import (
    FP8,
    LayerCache,
    dequantize_fp8,
    fp8_scales,
    gather_kv,
    gather_kv_layers,
    paged_attention,
    paged_attention_ref,
    quantize_fp8,
    scatter_kv,
    scatter_kv_layers,
    use_triton,
    write_kv,
)


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def run_ref(b: Batch) -> torch.Tensor:
    return paged_attention_ref(b.q, b.cache, b.meta, b.scale)


def tol(dtype: torch.dtype) -> dict:
    return {
        torch.float32: dict(atol=2e-5, rtol=1e-4),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
        torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    }[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 64), (8, 1, 128), (6, 2, 64)])
def test_reference_matches_dense(dtype, hq, hkv, d):
    b = make_batch(
        seed=hq * 7 + d,
        hq=hq,
        hkv=hkv,
        d=d,
        dtype=dtype,
        seqs=[(0, 0), (1, 1), (37, 37), (150, 1), (70, 20), (33, 0), (90, "sparse")],
    )
    torch.testing.assert_close(run_ref(b), dense_attention(b), **tol(dtype))


def test_reference_fp8_kv_matches_dense():
    b = make_batch(
        seed=3,
        hq=8,
        hkv=2,
        d=64,
        dtype=torch.bfloat16,
        fp8=True,
        seqs=[(40, 40), (17, 1), (100, "sparse"), (0, 0)],
    )
    torch.testing.assert_close(run_ref(b), dense_attention(b), **tol(torch.bfloat16))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 80), st.sampled_from([0, 1, 3, "all", "sparse"])),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([(2, 2), (4, 1), (8, 1)]),
    st.integers(0, 2**16),
)
def test_reference_property(seqs, heads, seed):
    b = make_batch(seed=seed, hq=heads[0], hkv=heads[1], d=64, dtype=torch.float32, seqs=seqs)
    torch.testing.assert_close(run_ref(b), dense_attention(b), **tol(torch.float32))


@pytest.mark.parametrize("chunk", [7, 64])
def test_reference_query_chunks(monkeypatch, chunk):
    # Masked prefills run in row chunks, each over keys up to its highest position: shuffled
    # sparse rows, a chunked prefill over a cached prefix, chunks that end mid-block or hold one
    # row.
    import tierkv.kernels.ref_attention as ref

    monkeypatch.setattr(ref, "CHUNK", chunk)
    ref._WS.plans.clear()
    b = make_batch(
        seed=11,
        hq=8,
        hkv=2,
        d=64,
        dtype=torch.float32,
        seqs=[(400, "sparse"), (300, 130), (65, 65), (29, [28, 0, 3]), (5, 1)],
    )
    torch.testing.assert_close(run_ref(b), dense_attention(b), **tol(torch.float32))


def test_causal_by_position():
    # A query sees exactly the keys at positions <= its own: changing a later key must not
    # move it, changing an earlier one must.
    b = make_batch(seed=5, hq=4, hkv=2, d=64, dtype=torch.float32, seqs=[(48, "sparse")])
    base = run_ref(b)
    p = int(b.meta.q_positions[0])
    slots = b.slots_of(0)
    b.cache.k.view(-1, 2, 64)[slots[p + 1 :]] += 5.0
    torch.testing.assert_close(run_ref(b)[0], base[0])
    b.cache.k.view(-1, 2, 64)[slots[p]] += 5.0
    assert not torch.allclose(run_ref(b)[0], base[0])


def test_bad_attention_input_is_an_error():
    # Shapes and dtypes are checked at dispatch, block ids by the reference's plan.
    b = make_batch(seed=1, hq=4, hkv=2, d=64, dtype=torch.float32, seqs=[(20, 2)])
    bt = b.meta.block_tables.clone()
    bt[0, 0] = b.cache.k.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        paged_attention_ref(b.q, b.cache, replace(b.meta, block_tables=bt), b.scale)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(b.q[:, :3], b.cache, b.meta, b.scale)
    with pytest.raises(ValueError, match="fp8"):
        paged_attention(b.q, LayerCache(b.cache.k.to(FP8), b.cache.v.to(FP8)), b.meta, b.scale)


def test_reference_is_thread_safe():
    # The gather workspace is per thread: concurrent decodes must not see each other's KV.
    batches = [
        make_batch(
            seed=s, hq=8, hkv=2, d=64, dtype=torch.float32, seqs=[(60 + s, 1), (30, 1), (90, 1)]
        )
        for s in range(4)
    ]
    want = [run_ref(b) for b in batches]
    got: dict[int, list[torch.Tensor]] = {}

    def work(i: int) -> None:
        got[i] = [run_ref(batches[i]) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        for out in got[i]:
            torch.testing.assert_close(out, want[i], atol=0, rtol=0)


def test_dispatch(monkeypatch):
    x = torch.zeros(1)
    assert not use_triton(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(x)
    b = make_batch(seed=2, hq=4, hkv=2, d=64, dtype=torch.float32, seqs=[(5, 5)])
    monkeypatch.delenv("TRITON_INTERPRET")
    torch.testing.assert_close(paged_attention(b.q, b.cache, b.meta, b.scale), run_ref(b))


# --- KV write, gather, scatter ------------------------------------------------------------


def cache_pair(nb, bs, h, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(nb, bs, h, d, generator=g), torch.randn(nb, bs, h, d, generator=g)
    if dtype == FP8:
        sc = torch.rand(2, h, generator=g) * 0.01 + 0.003
        return quantize_fp8(k, sc[0]), quantize_fp8(v, sc[1]), sc
    return k.to(dtype), v.to(dtype), None


def test_write_kv_slots_and_skips():
    kc, vc, _ = cache_pair(8, 4, 2, 16, torch.float32, 0)
    before_k, before_v = kc.clone(), vc.clone()
    k, v = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    write_kv(k, v, LayerCache(kc, vc), torch.tensor([5, -1, 31, 0]))
    flat, was = kc.view(-1, 2, 16), before_k.view(-1, 2, 16)
    for slot, row in ((5, 0), (31, 2), (0, 3)):
        assert torch.equal(flat[slot], k[row]) and torch.equal(vc.view(-1, 2, 16)[slot], v[row])
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[[5, 31, 0]] = False
    assert torch.equal(flat[untouched], was[untouched])
    with pytest.raises(ValueError, match="past the end"):
        write_kv(k, v, LayerCache(kc, vc), torch.tensor([1, 2, 3, 32]))
    assert torch.equal(kc.view(-1, 2, 16)[1], before_k.view(-1, 2, 16)[1])  # nothing written
    del before_v


def test_write_kv_fp8_quantizes():
    kc = torch.zeros(4, 4, 2, 16, dtype=FP8)
    vc = torch.zeros_like(kc)
    sc = torch.tensor([0.01, 0.02])
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    write_kv(k, v, LayerCache(kc, vc, sc, sc * 2), torch.tensor([0, 7, 9]))
    assert torch.equal(
        kc.view(-1, 2, 16)[7].view(torch.uint8), quantize_fp8(k[1], sc).view(torch.uint8)
    )
    assert torch.equal(
        vc.view(-1, 2, 16)[9].view(torch.uint8), quantize_fp8(v[2], sc * 2).view(torch.uint8)
    )
    with pytest.raises(ValueError, match="scale"):
        write_kv(k, v, LayerCache(kc, vc), torch.tensor([0, 1, 2]))


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 40),
    st.integers(0, 60),
    st.sampled_from([torch.float32, torch.bfloat16, FP8]),
    st.integers(0, 2**16),
)
def test_gather_scatter_property(start, length, dtype, seed):
    nb, bs, h, d = 12, 8, 2, 16
    kc, vc, sc = cache_pair(nb, bs, h, d, dtype, seed)
    nblk = -(-(start + length) // bs)
    if nblk > nb:
        return
    bids = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))[: max(nblk, 1)].int()
    ks, vs = (sc[0], sc[1]) if sc is not None else (None, None)
    out = torch.empty(2, length, h, d, dtype=dtype)
    out_sc = torch.zeros(2, h) if dtype == FP8 else None
    gather_kv(LayerCache(kc, vc, ks, vs), bids, start, out, out_sc)
    for t in range(length):
        slot = int(bids[(start + t) // bs]) * bs + (start + t) % bs
        assert torch.equal(out[0, t].view(torch.uint8), kc.view(-1, h, d)[slot].view(torch.uint8))
        assert torch.equal(out[1, t].view(torch.uint8), vc.view(-1, h, d)[slot].view(torch.uint8))
    # Scatter into a fresh cache at other blocks, then gather back: the same bytes.
    kc2, vc2, _ = cache_pair(nb, bs, h, d, dtype, seed + 1)
    bids2 = bids.flip(0).contiguous()
    cache2 = LayerCache(kc2, vc2, ks, vs)
    scatter_kv(out, cache2, bids2, start, out_sc)
    back = torch.empty_like(out)
    gather_kv(cache2, bids2, start, back, torch.zeros(2, h) if dtype == FP8 else None)
    assert torch.equal(back.view(torch.uint8), out.view(torch.uint8))


def test_bf16_cache_to_fp8_segment_and_back():
    kc, vc, _ = cache_pair(6, 16, 2, 64, torch.bfloat16, 4)
    bids = torch.tensor([4, 1, 3], dtype=torch.int32)
    seg = torch.empty(2, 40, 2, 64, dtype=FP8)
    seg_sc = torch.zeros(2, 2)
    gather_kv(LayerCache(kc, vc), bids, 3, seg, out_scales=seg_sc)
    exact = torch.empty(2, 40, 2, 64, dtype=torch.bfloat16)
    gather_kv(LayerCache(kc, vc), bids, 3, exact)
    torch.testing.assert_close(seg_sc, fp8_scales(exact.float(), 0, 2))
    torch.testing.assert_close(
        dequantize_fp8(seg[0], seg_sc[0]), exact[0].float(), atol=0.02, rtol=2**-4
    )
    cache2 = LayerCache(torch.zeros_like(kc), torch.zeros_like(vc))
    scatter_kv(seg, cache2, bids, 3, src_scales=seg_sc)
    back = torch.empty_like(exact)
    gather_kv(cache2, bids, 3, back)
    torch.testing.assert_close(back.float(), exact.float(), atol=0.02, rtol=2**-4)


def test_gather_scatter_layers_and_errors():
    layers = [torch.randn(2, 6, 4, 2, 8) for _ in range(3)]
    caches = [LayerCache.of(c) for c in layers]
    bids = torch.tensor([5, 0, 2], dtype=torch.int32)
    out = torch.empty(3, 2, 9, 2, 8)
    gather_kv_layers(caches, bids, 2, out)
    for i, c in enumerate(caches):
        one = torch.empty(2, 9, 2, 8)
        gather_kv(c, bids, 2, one)
        assert torch.equal(out[i], one)
    fresh = [torch.zeros_like(c) for c in layers]
    fresh_caches = [LayerCache.of(c) for c in fresh]
    scatter_kv_layers(out, fresh_caches, bids, 2)
    again = torch.empty_like(out)
    gather_kv_layers(fresh_caches, bids, 2, again)
    assert torch.equal(again, out)
    snapshot = [c.clone() for c in fresh]
    with pytest.raises(ValueError, match="exceed"):
        scatter_kv_layers(torch.ones(3, 2, 20, 2, 8), fresh_caches, bids, 2)
    with pytest.raises(ValueError, match="outside"):
        scatter_kv(torch.ones(2, 4, 2, 8), fresh_caches[0], torch.tensor([9], dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="segment"):
        gather_kv_layers(caches, bids, 0, torch.empty(2, 2, 4, 2, 8))
    assert all(torch.equal(a, b) for a, b in zip(fresh, snapshot))
