"""The torch reference keeps the plan it derives from the metadata (checks, decode block ids,
masks) while equal metadata comes back: reuse must never serve a stale plan, and a bad
edit must still be caught."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels_cases import Batch, dense_attention, make_batch
from tierkv.kernels import paged_attention_ref


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def run(b: Batch) -> torch.Tensor:
    return paged_attention_ref(b.q, b.cache, b.meta, b.scale)


def tol() -> dict:
    return dict(atol=2e-5, rtol=1e-4)


def test_same_metadata_new_layer():
    # Every layer of a step: same metadata, another layer's q and caches.
    a = make_batch(
        seed=1, hq=8, hkv=2, d=64, dtype=torch.float32, seqs=[(50, 1), (20, 1), (70, 9), (33, 1)]
    )
    b = make_batch(
        seed=2, hq=8, hkv=2, d=64, dtype=torch.float32, seqs=[(50, 1), (20, 1), (70, 9), (33, 1)]
    )
    for f in ("block_tables", "seq_lens", "cu_seqlens_q", "q_positions"):
        setattr(b.meta, f, getattr(a.meta, f))
    b.blocks, b.positions = a.blocks, a.positions
    for x in (a, b, a):
        torch.testing.assert_close(run(x), dense_attention(x), **tol())


@pytest.mark.parametrize("inference", [False, True])
def test_in_place_edit_is_seen(inference):
    # Under inference_mode (the engine's) tensors keep no version counter: edits still show.
    with torch.inference_mode(inference):
        _edit_is_seen()


def _edit_is_seen() -> None:
    b = make_batch(seed=3, hq=4, hkv=2, d=64, dtype=torch.float32, seqs=[(40, 1), (64, 1), (17, 1)])
    torch.testing.assert_close(run(b), dense_attention(b), **tol())
    b.meta.seq_lens[1] -= 5  # the last 5 keys of sequence 1 leave, its query moves back with them
    b.meta.q_positions[1] -= 5
    b.positions[1] = [p - 5 for p in b.positions[1]]
    torch.testing.assert_close(run(b), dense_attention(b), **tol())
    b.meta.block_tables[0, 0] = b.cache.k.shape[0]  # out of the cache: an error, not a stale plan
    with pytest.raises(ValueError, match="outside the cache"):
        run(b)


def test_interleaved_groups():
    # A step's decode groups alternate within each layer: each must get its own plan back.
    groups = [
        make_batch(
            seed=10 + i, hq=8, hkv=2, d=64, dtype=torch.float32, seqs=[(20 + 30 * i, 1), (9 + i, 1)]
        )
        for i in range(3)
    ]
    for _ in range(3):
        for b in groups:
            torch.testing.assert_close(run(b), dense_attention(b), **tol())


def test_new_metadata_each_call():
    b = make_batch(seed=4, hq=8, hkv=1, d=64, dtype=torch.float32, seqs=[(30, 1), (0, 0), (45, 1)])
    want = dense_attention(b)
    for _ in range(3):
        b.meta.block_tables, b.meta.seq_lens = b.meta.block_tables.clone(), b.meta.seq_lens.clone()
        torch.testing.assert_close(run(b), want, **tol())


def test_workspace_from_inference_mode_serves_callers_outside_it() -> None:
    """The engine calls under inference_mode; a later plain caller reuses the same scratch."""
    from tierkv.kernels import AttentionMeta, LayerCache, paged_attention

    nb, bs, h, d = 64, 16, 2, 64
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(nb, bs, h, d, generator=g).to(torch.float8_e4m3fn)
    vc = torch.randn(nb, bs, h, d, generator=g).to(torch.float8_e4m3fn)
    q = torch.randn(4, 8, d, generator=g).bfloat16()
    args = (
        LayerCache(kc, vc, torch.ones(h), torch.ones(h)),
        AttentionMeta(
            torch.arange(64, dtype=torch.int32).view(4, 16),
            torch.full((4,), 250, dtype=torch.int32),
            torch.arange(5, dtype=torch.int32),
            torch.full((4,), 249, dtype=torch.int32),
        ),
        0.125,
    )
    with torch.inference_mode():
        first = paged_attention(q, *args).clone()
    again = paged_attention(q.clone(), *args)  # outside inference_mode, same workspace
    torch.testing.assert_close(again, first)
