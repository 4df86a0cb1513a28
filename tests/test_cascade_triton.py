"""The Triton cascade decode (kernels/triton_cascade.py), run by the Triton interpreter on the CPU
(TRITON_INTERPRET=1), against the plain Triton decode and the torch reference on the batches of
tests/cascade_cases.py. Small shapes: the interpreter takes milliseconds per tile product.

Interpreter caveat (as in tests/test_kernels_triton.py): a bf16 tl.dot returns garbage there, so
queries are fp32; a bf16 or fp8 cache is still loaded as such and upcast by the kernel. A GPU
runs bf16 end to end (`make gpu-check` runs this file compiled with TIERKV_TEST_DEVICE=cuda).
"""

# E402: triton and the kernel modules are imported only after TRITON_INTERPRET is set below, on
# purpose (the variable is read when @triton.jit decorates, i.e. at import).
# ruff: noqa: E402

from __future__ import annotations

import importlib
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

GPU = os.environ.get("TIERKV_TEST_DEVICE") == "cuda"
_prev = os.environ.get("TRITON_INTERPRET")
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates, i.e. at import
from triton.runtime.interpreter import InterpretedFunction

from tierkv.kernels import triton_attention, triton_cascade, triton_softmax

# The shared device functions first: the kernels' modules import them.
for _m in (triton_softmax, triton_attention, triton_cascade):
    if GPU != (not any(isinstance(v, InterpretedFunction) for v in vars(_m).values())):
        importlib.reload(_m)  # imported earlier in the other mode
if _prev is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _prev

from tests.cascade_cases import Case, make_case
from tests.test_kernels import tol
from tierkv.kernels import LayerCache, paged_attention_ref

DEV = torch.device("cuda" if GPU else "cpu")


@pytest.fixture(autouse=True)
def _mode(monkeypatch):
    if not GPU:  # the launch reads it too
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def on_device(c: Case) -> Case:
    k, v = c.cache.k.to(DEV), c.cache.v.to(DEV)
    sc = [None if s is None else s.to(DEV) for s in (c.cache.k_scale, c.cache.v_scale)]
    q = c.q.float().to(DEV)  # fp32 queries: see the module docstring
    return Case(q, LayerCache(k, v, *sc), c.ids.to(DEV), c.seen.to(DEV), c.groups, c.scale)


def both(c: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cascade, plain Triton, plain torch reference) over the case."""
    meta = c.meta()
    meta.block_tables, meta.seq_lens = meta.block_tables.to(DEV), meta.seq_lens.to(DEV)
    meta.cu_seqlens_q, meta.q_positions = meta.cu_seqlens_q.to(DEV), meta.q_positions.to(DEV)
    got = triton_attention.paged_attention_triton(c.q, c.cache, meta, c.scale)
    meta.cascade = None
    plain = triton_attention.paged_attention_triton(c.q, c.cache, meta, c.scale)
    sides = (c.cache.k, c.cache.v, c.cache.k_scale, c.cache.v_scale)
    host = LayerCache(*(None if x is None else x.cpu() for x in sides))
    ref = paged_attention_ref(c.q.cpu(), host, c.meta(), c.scale)
    return got, plain, ref.to(DEV)


@settings(max_examples=8, deadline=None)
@given(
    st.integers(1, 40),
    st.sampled_from([0, 5, 16, 48, 70]),
    st.sampled_from([(4, 2, 16), (6, 2, 32), (2, 2, 16)]),
    st.sampled_from([8, 16]),
    st.sampled_from([torch.float32, torch.bfloat16, "fp8"]),
    st.integers(0, 2**16),
)
def test_triton_cascade_equals_plain(b, shared, heads, bs, dtype, seed):
    # One group of up to 40 sequences (more than one program's rows at G = 2: cut), the others
    # alone; a second group of two where there is room.
    g = torch.Generator().manual_seed(seed)
    sizes = [max(1, b - 3)] + ([2] if b >= 3 else [])
    suffix = torch.randint(0, 30, (b,), generator=g).tolist()
    fp8 = dtype == "fp8"
    kind = torch.bfloat16 if fp8 else dtype
    c = on_device(make_case(seed, [shared, 9][: len(sizes)], sizes, suffix, heads, bs, kind, fp8))
    got, plain, ref = both(c)
    torch.testing.assert_close(got, plain, **tol(torch.float32))
    torch.testing.assert_close(got, ref, **tol(torch.float32))


def test_no_groups_and_empty_suffixes():
    # A group whose members have no key past the prefix, and one sequence with no key at all.
    c = on_device(make_case(5, [32], [3], [0, 0, 4, 0], (4, 2, 16), 16, torch.float32))
    got, plain, ref = both(c)
    torch.testing.assert_close(got, plain, **tol(torch.float32))
    torch.testing.assert_close(got, ref, **tol(torch.float32))
