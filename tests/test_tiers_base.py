"""Shared tier pieces: sizes, namespaces, leases, and the page allocator on its own."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierkv.storage_backends.leases import Leases
from tierkv.storage_backends.names import check_namespace
from tierkv.storage_backends.pages import PageAllocator, runs
from tierkv.storage_backends.sizes import format_size, parse_size


@pytest.mark.parametrize(
    "text, n",
    [
        ("4096", 4096),
        ("8GiB", 8 << 30),
        ("512 MiB", 512 << 20),
        ("1.5G", 1_500_000_000),
        ("64kib", 64 << 10),
        ("2TB", 2 * 10**12),
        ("10B", 10),
        (7, 7),
    ],
)
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "GiB", "-1", "1.2.3", "8 GiBs", "5i", -4, "1e9"])
def test_parse_size_refuses(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size_and_namespaces():
    assert format_size(512) == "512 B" and format_size(3 << 30) == "3.0 GiB"
    for ok in ["default", "tenant-1", "a.b_c", "_x"]:
        assert check_namespace(ok) == ok
    for bad in ["", ".hidden", "-x", "a/b", "..", "x" * 65, "é", None]:
        with pytest.raises(ValueError):
            check_namespace(bad)


def test_leases_end_by_release_or_ttl():
    leases = Leases()
    with leases.take("ns", b"k" * 16, ttl=60):
        assert leases.held("ns", b"k" * 16)
    assert not leases.held("ns", b"k" * 16)
    short = leases.take("ns", b"k" * 16, ttl=0.01)
    long = leases.take("ns", b"k" * 16, ttl=60)
    time.sleep(0.02)
    assert leases.held("ns", b"k" * 16)  # the long one still holds
    long.release()
    long.release()  # idempotent
    assert not leases.held("ns", b"k" * 16) and not leases.active
    short.release()


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9)), max_size=80))
def test_allocator_never_overlaps_or_leaks(ops):
    pages = PageAllocator(24)
    held: list[list[int]] = []
    for alloc, n in ops:
        if alloc or not held:
            got = pages.alloc(n)
            assert (got is None) == (n > pages.num_free + (len(got) if got else 0))
            if got is not None:
                assert got == sorted(got) and len(got) == n
                held.append(got)
        else:
            pages.release(held.pop(n % len(held)))
        pages.check_integrity(held)
    with pytest.raises(ValueError):
        pages.release([99])


@given(st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True), st.integers(1, 64))
def test_runs_cover_the_range_in_order(page_list, page_bytes):
    total = len(page_list) * page_bytes
    got = list(runs(page_list, page_bytes, 0, total))
    assert sum(n for _, _, n in got) == total
    pos = 0
    for at, logical, n in got:
        assert logical == pos
        for b in range(n):  # every byte lands on the page that holds its logical offset
            i, within = divmod(logical + b, page_bytes)
            assert at + b == page_list[i] * page_bytes + within
        pos += n
