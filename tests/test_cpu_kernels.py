"""The C++ CPU decode kernel (kernels/cpu_attention.cpp) against the torch reference and an
independent dense attention. The kernel is built here (g++ from the machine, ninja from the
test dependencies); a failed build fails these tests, it never skips them."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_kernels import tol
from tests.test_kernels_cases import Batch, dense_attention, make_batch
from tierkv.kernels import AttentionMeta, LayerCache, cpu, paged_attention, paged_attention_ref

pytestmark = pytest.mark.cpu_path


@pytest.fixture(autouse=True)
def _cpu_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TIERKV_CPU_KERNEL", raising=False)
    assert cpu.load(), "the C++ decode kernel did not build: see the log above"


def both(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(dispatch = the C++ kernel for decodes, the pure torch reference)."""
    args = (b.q, b.cache, b.meta, b.scale)
    return paged_attention(*args), paged_attention_ref(*args, cpu_kernel=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 64), (8, 1, 128), (6, 2, 64), (4, 2, 80)])
def test_decode_matches_reference_and_dense(dtype, hq, hkv, d):
    # One query at the last position, keys not a multiple of the block size, a single key,
    # a sequence with no keys, and one query at an earlier position than its last key.
    b = make_batch(
        seed=hq * 3 + d,
        hq=hq,
        hkv=hkv,
        d=d,
        dtype=dtype,
        seqs=[(1, 1), (37, 1), (150, 1), (0, 0), (64, 1), (90, [40])],
    )
    assert cpu.decode_usable(b.q, b.cache)
    got, ref = both(b)
    torch.testing.assert_close(got, ref, **tol(dtype))
    torch.testing.assert_close(got, dense_attention(b), **tol(dtype))


def test_fp8_kv_matches_reference():
    b = make_batch(
        seed=5,
        hq=8,
        hkv=2,
        d=64,
        dtype=torch.bfloat16,
        fp8=True,
        seqs=[(40, 1), (17, 1), (300, 1), (0, 0)],
    )
    got, ref = both(b)
    torch.testing.assert_close(got, ref, **tol(torch.bfloat16))
    torch.testing.assert_close(got, dense_attention(b), **tol(torch.bfloat16))


def test_mixed_batch_decodes_beside_prefills():
    # Decodes go to the kernel, the prefill and sparse rows of the same call to SDPA.
    b = make_batch(
        seed=9,
        hq=8,
        hkv=2,
        d=64,
        dtype=torch.float32,
        seqs=[(70, 20), (33, 1), (90, "sparse"), (5, 1), (16, 16)],
    )
    got, ref = both(b)
    torch.testing.assert_close(got, ref, **tol(torch.float32))


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(0, 200), min_size=1, max_size=6),
    st.sampled_from([(2, 2), (4, 1), (8, 1), (16, 2)]),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 2**16),
)
def test_decode_property(lens, heads, dtype, seed):
    b = make_batch(
        seed=seed,
        hq=heads[0],
        hkv=heads[1],
        d=64,
        dtype=dtype,
        seqs=[(n, 1 if n else 0) for n in lens],
    )
    got, ref = both(b)
    torch.testing.assert_close(got, ref, **tol(dtype))


def paged(nb: int, bs: int, lens: list[int], hq: int, hkv: int, d: int, seed: int):
    """A cache of block size bs with shuffled blocks and one decode query per sequence."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    ids = torch.randperm(nb, generator=g)[: sum(need)].split(need)
    bt = torch.zeros(len(lens), max(need), dtype=torch.int64)
    for i, x in enumerate(ids):
        bt[i, : len(x)] = x
    k, v = (torch.randn(nb, bs, hkv, d, generator=g) for _ in range(2))
    q = torch.randn(len(lens), hq, d, generator=g)
    return q, k, v, bt, torch.tensor(lens)


def decodes(
    k: torch.Tensor, v: torch.Tensor, bt: torch.Tensor, lens: torch.Tensor
) -> tuple[LayerCache, AttentionMeta]:
    """paged()'s cache and the metadata of its decodes (one query each, at the last key)."""
    return LayerCache(k, v), AttentionMeta(bt, lens, torch.arange(len(lens) + 1), lens - 1)


@pytest.mark.parametrize("bs", [8, 16, 32, 48])
@pytest.mark.parametrize("chunk", [7, 16, 50, 4096])
def test_block_sizes_and_key_runs(bs, chunk):
    # Tiles of 16 tokens inside larger blocks, part-tiles in smaller ones; runs of keys (one
    # task each, merged by log-sum-exp) that start mid-block or mid-tile, or cover everything.
    q, k, v, bt, lens = paged(64, bs, [1, 5, 100, 333], 8, 2, 64, seed=bs + chunk)
    want = paged_attention_ref(q, *decodes(k, v, bt, lens), 0.125, cpu_kernel=False)
    got = torch.ops.tierkv.paged_decode(q, k, v, bt, lens, 0.125, None, None, None, chunk)
    torch.testing.assert_close(got, want, **tol(torch.float32))


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(1, 150), min_size=1, max_size=5),
    st.sampled_from([(3, 1, 64), (9, 3, 64), (8, 1, 128), (16, 2, 64), (10, 2, 80)]),
    st.sampled_from([8, 16, 32]),
    st.integers(0, 2**16),
)
def test_bf16_decode_within_its_rounding(lens, heads, bs, seed):
    """A bf16 cache (bf16 products summed in fp32 on AVX512-BF16, the softmax weights rounded to
    bf16 for V) against fp32 math over the same values: within 2^-8 of sum_j p_j |v_j| (the
    weights' rounding) plus the output's rounding."""
    hq, hkv, d = heads
    q, k, v, bt, n = paged(128, bs, lens, hq, hkv, d, seed)
    q, k, v = (x.bfloat16().float() for x in (q, k, v))
    op = torch.ops.tierkv.paged_decode
    got = op(q.bfloat16(), k.bfloat16(), v.bfloat16(), bt, n, 0.125, None, None, None, 64).float()
    ref = op(q, k, v, bt, n, 0.125, None, None, None, 64)
    spread = op(q, k, v.abs(), bt, n, 0.125, None, None, None, 64)
    bound = spread * 2**-8 + ref.abs() * 2**-8 + 1e-6
    assert ((got - ref).abs() <= bound).all(), f"worst excess {((got - ref).abs() - bound).max()}"


def test_threads_and_concurrent_callers():
    # The engine calls from one thread with torch's pool; several callers must not share state.
    q, k, v, bt, lens = paged(256, 16, [700, 1, 250, 1000], 8, 2, 64, seed=1)
    cache, meta = decodes(k, v, bt, lens)
    want = paged_attention_ref(q, cache, meta, 0.125, cpu_kernel=False)
    got: list[torch.Tensor] = []

    def call() -> None:
        for _ in range(5):
            got.append(paged_attention(q, cache, meta, 0.125))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 20
    for out in got:
        torch.testing.assert_close(out, want, **tol(torch.float32))


def test_reference_where_the_kernel_does_not_apply(monkeypatch):
    b = make_batch(seed=2, hq=4, hkv=2, d=64, dtype=torch.float32, seqs=[(40, 1), (9, 1)])
    monkeypatch.setenv("TIERKV_CPU_KERNEL", "0")
    assert not cpu.decode_usable(b.q, b.cache)
    monkeypatch.delenv("TIERKV_CPU_KERNEL")
    odd = make_batch(
        seed=2, hq=4, hkv=2, d=40, dtype=torch.float32, seqs=[(40, 1)]
    )  # head dim % 16
    mixed = make_batch(
        seed=2, hq=4, hkv=2, d=64, dtype=torch.bfloat16, seqs=[(40, 1)], cache_dtype=torch.float32
    )
    for x in (odd, mixed):
        assert not cpu.decode_usable(x.q, x.cache)
        got, ref = both(x)
        torch.testing.assert_close(got, ref, **tol(x.q.dtype))


def test_kernel_values_are_not_the_reference():
    # Guard against a dispatch that silently runs the reference: the kernel's exp and
    # summation order differ, so fp32 outputs match closely but not bit for bit.
    q, k, v, bt, lens = paged(64, 16, [333, 200], 8, 2, 64, seed=4)
    cache, meta = decodes(k, v, bt, lens)
    want = paged_attention_ref(q, cache, meta, 0.125, cpu_kernel=False)
    got = paged_attention(q, cache, meta, 0.125)
    torch.testing.assert_close(got, want, **tol(torch.float32))
    assert not torch.equal(got, want)


def test_op_rejects_bad_arguments():
    # The op checks what it can without reading the cache: shapes, dtypes, contiguity.
    q, k, v, bt, lens = paged(16, 16, [20, 5], 8, 2, 64, seed=3)
    op = torch.ops.tierkv.paged_decode
    with pytest.raises(RuntimeError, match="int64"):
        op(q, k, v, bt.int(), lens, 0.125, None, None, None, 1)
    with pytest.raises(RuntimeError, match="dtype"):
        op(q.bfloat16(), k, v, bt, lens, 0.125, None, None, None, 1)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(
            q.transpose(0, 1).contiguous().transpose(0, 1),
            k,
            v,
            bt,
            lens,
            0.125,
            None,
            None,
            None,
            1,
        )
    with pytest.raises(RuntimeError, match="fp8"):
        raw = torch.zeros(k.shape, dtype=torch.uint8)
        op(
            q, raw, raw, bt, lens, 0.125, None, None, torch.zeros(256), 1
        )  # fp8 bytes without scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_op_is_bit_identical_to_torch(dtype):
    # The engine's q and k are views split out of one projection; re-rotation passes
    # transposed caches; the op must read any row strides and round exactly as torch does.
    from tierkv.kernels.rope import RotaryEmbedding, rotate, rotate_ref

    rope = RotaryEmbedding(
        64,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    g = torch.Generator().manual_seed(7)
    for n in (0, 1, 13, 300):
        qkv = (torch.randn(n, 768, generator=g) * 4).to(dtype)
        q, k, _ = qkv.split([512, 128, 128], -1)
        cos, sin = rope.cos_sin(torch.randint(0, 20000, (n,), generator=g))
        for x in (
            q.view(n, 8, 64),
            k.view(n, 2, 64),
            k.reshape(n, 2, 64).transpose(0, 1).contiguous().transpose(0, 1),
        ):
            assert cpu.rope_usable(x)
            got = rotate(x, cos, sin)
            assert got.is_contiguous() and torch.equal(got, rotate_ref(x, cos, sin))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.tierkv.rope(q.view(n, 8, 64), cos.double(), sin.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_op_matches_reference(dtype):
    from tierkv.kernels import write_kv
    from tierkv.kernels.ref_kv import write_kv_ref

    g = torch.Generator().manual_seed(3)
    kv = torch.randn(40, 3 * 2 * 64, generator=g).to(dtype)
    _, k, v = kv.split([2 * 64, 2 * 64, 2 * 64], -1)  # views, as the engine's k and v are
    k, v = k.view(40, 2, 64), v.view(40, 2, 64)
    slots = torch.randperm(9 * 16, generator=g)[:40]
    slots[::7] = -1  # padding rows are skipped
    caches = [torch.zeros(9, 16, 2, 64, dtype=dtype) for _ in range(4)]
    cache, ref = LayerCache(caches[0], caches[1]), LayerCache(caches[2], caches[3])
    assert cpu.write_kv_usable(k, v, cache)
    write_kv(k, v, cache, slots)
    write_kv_ref(k, v, ref, slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    before = [c.clone() for c in caches[:2]]
    bad = slots.clone()
    bad[-1] = 9 * 16  # one past the end: an error, and nothing written
    with pytest.raises(ValueError, match="past the end"):
        write_kv(k + 1, v + 1, cache, bad)
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])


def test_load_from_many_threads_at_once():
    # The connector's loop thread may reach the library (re-rotation) while the engine does.
    cpu._load.cache_clear()
    got: list[bool] = []
    threads = [threading.Thread(target=lambda: got.append(cpu.load())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [True] * 4
