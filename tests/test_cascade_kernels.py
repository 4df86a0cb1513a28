"""Cascade decode attention (kernels/cascade.py): the C++ op and the torch reference against the
plain decode over the same batch, for shared prefixes of any length (0, whole blocks, part of a
block: the kernels accept any shared key count; the engine's groups share whole blocks),
suffixes of any length (0 included), GQA groups, block sizes, 1..40 sequences (the C++ op stacks
at most 16 // G sequences per pass over the shared keys, so larger groups are cut) and dtypes.
A merge without the log-sum-exp correction fails these comparisons (test_a_wrong_merge_fails)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cascade_cases import Case, make_case
from tests.test_kernels import tol
from tierkv.kernels import cascade, cpu, paged_attention_ref
from tierkv.kernels.cascade import CascadeGroups, cascade_decode_ref, find_groups

pytestmark = pytest.mark.cpu_path

HEADS = [(2, 2, 64), (9, 3, 64), (16, 1, 64), (8, 1, 128), (6, 2, 80), (4, 4, 16)]


@pytest.fixture(autouse=True)
def _cpu_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TIERKV_CPU_KERNEL", raising=False)
    assert cpu.load(), "the C++ kernels did not build: see the log above"


@st.composite
def cases(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16), fp8=True) -> Case:
    b = draw(st.integers(1, 40))
    ngroups = draw(st.integers(0, 3))
    cuts = sorted(draw(st.lists(st.integers(0, b), min_size=ngroups, max_size=ngroups)))
    sizes = [y - x for x, y in zip([0, *cuts], cuts) if y > x]
    bs = draw(st.sampled_from([8, 16, 32]))
    shared = [draw(st.integers(0, 5) | st.integers(0, 6).map(lambda n: n * bs)) for _ in sizes]
    shared = [p * 9 if draw(st.booleans()) else p for p in shared]  # some long prefixes
    suffix = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    heads = draw(st.sampled_from(HEADS))
    dtype = draw(st.sampled_from(dtypes))
    quant = fp8 and dtype == torch.bfloat16 and draw(st.booleans())
    return make_case(draw(st.integers(0, 2**16)), shared, sizes, suffix, heads, bs, dtype, quant)


def plain_ref(c: Case) -> torch.Tensor:
    """The plain torch reference (ref_attention, no C++) over the same batch."""
    return paged_attention_ref(c.q, c.cache, c.meta(), c.scale, cpu_kernel=False)


def cascade_op(c: Case, chunk: int | None = None) -> torch.Tensor:
    return cpu.paged_decode_cascade(
        c.q, c.cache, c.ids, c.seen, c.scale, c.groups.tensors(torch.device("cpu")), chunk
    )


@settings(max_examples=60, deadline=None)
@given(cases(), st.sampled_from([None, 7, 64]))
def test_cpp_cascade_equals_plain(c, chunk):
    want = cpu.paged_decode(c.q, c.cache, c.ids, c.seen, c.scale, chunk)
    got = cascade_op(c, chunk)
    torch.testing.assert_close(got, want, **tol(c.q.dtype))
    torch.testing.assert_close(got, plain_ref(c), **tol(c.q.dtype))


@settings(max_examples=30, deadline=None)
@given(cases(dtypes=(torch.float32, torch.bfloat16)))
def test_reference_cascade_equals_plain(c):
    got = cascade_decode_ref(c.q, c.cache, c.ids, c.seen, c.groups, c.scale)
    torch.testing.assert_close(got, plain_ref(c), **tol(c.q.dtype))


def test_a_wrong_merge_fails(monkeypatch):
    # The comparisons above can fail: the reference with the prefix's weight left out of the
    # merge (no log-sum-exp correction: the two parts averaged) is far from the plain decode.
    c = make_case(1, [48], [5], [3, 20, 0, 7, 11], (9, 3, 64), 16, torch.float32)
    torch.testing.assert_close(
        cascade_decode_ref(c.q, c.cache, c.ids, c.seen, c.groups, c.scale), plain_ref(c)
    )

    def no_lse(o1, lse1, o2, lse2):
        both = torch.isfinite(lse1) & torch.isfinite(lse2)
        return torch.where(both[..., None], (o1 + o2) / 2, o1 + o2)

    monkeypatch.setattr(cascade, "merge", no_lse)
    bad = cascade_decode_ref(c.q, c.cache, c.ids, c.seen, c.groups, c.scale)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(bad, plain_ref(c), **tol(torch.float32))


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forty_sequences_in_sub_groups(heads, dtype):
    # 40 sequences sharing 100 keys: cut into sub-groups of 16 // G (8 // G on bf16 products).
    g = torch.Generator().manual_seed(heads[0])
    suffix = torch.randint(0, 40, (40,), generator=g).tolist()
    c = make_case(7, [100], [40], suffix, heads, 16, dtype)
    want = cpu.paged_decode(c.q, c.cache, c.ids, c.seen, c.scale, 64)
    torch.testing.assert_close(cascade_op(c, 64), want, **tol(dtype))


def test_op_refuses_a_member_with_other_blocks():
    # The shared keys are read through the group leader's table: a member whose own table
    # points elsewhere for them would get the leader's keys, so the op refuses it.
    c = make_case(2, [64], [3], [5, 5, 5], (4, 2, 64), 16, torch.float32)
    c.ids[1, 0] = c.ids[2, 3]
    with pytest.raises(RuntimeError, match="same blocks"):
        cascade_op(c)


@pytest.mark.parametrize(
    "members,shared,match",
    [
        ([[0, 1], [1, 2]], [16, 16], "two groups"),
        ([[0, 5]], [16], "out of range"),
        ([[0, 1]], [10**6], "same blocks"),
        ([[0, 1], []], [16, 16], "empty group"),
    ],
)
def test_op_rejects_bad_groups(members, shared, match):
    c = make_case(3, [32], [3], [4, 4, 4], (4, 2, 64), 16, torch.float32)
    with pytest.raises(RuntimeError, match=match):
        c.groups = CascadeGroups(members, shared)
        cascade_op(c)


def test_find_groups():
    bs = 16
    tables = [[1, 2, 3, 9], [1, 2, 3, 10], [1, 2, 4], [5, 6], [7], [5, 8], [1, 2, 3, 11]]
    seen = [60, 55, 40, 30, 16, 20, 40]
    g = find_groups(tables, seen, bs)
    # [1, 2] shared by all four starting at block 1 (sequence 2 diverges at its third block);
    # [5]: sequence 5 has filled only one block of 16 (20 keys) and 3 one (30): whole blocks.
    assert g.members == [[0, 1, 2, 6], [3, 5]] and g.shared == [32, 16]
    assert find_groups(tables, seen, bs, min_blocks=2).members == [[0, 1, 2, 6]]
    assert find_groups(tables, [15] * 7, bs).members == []  # no whole block filled
    assert find_groups([[1], [2]], [16, 16], bs).members == []
