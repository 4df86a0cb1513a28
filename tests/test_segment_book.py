"""The bounded segment store's bookkeeping (connector/segment_book.py) against a plain model:
a segment is admitted on its admit_after-th sighting, the stored bytes never pass the budget,
and making room evicts only stored segments, least recently used first."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.connector.config import ConnectorConfig
from tierkv.connector.segment_book import SegmentBook

KEYS = [bytes([i]) * 16 for i in range(12)]
op = st.one_of(
    st.tuples(st.just("sight"), st.sampled_from(KEYS), st.integers(1, 3)),
    st.tuples(st.just("reserve"), st.sampled_from(KEYS), st.integers(1, 120)),
    st.tuples(st.just("touch"), st.sampled_from(KEYS), st.just(0)),
    st.tuples(st.just("forget"), st.sampled_from(KEYS), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(
    budget=st.integers(0, 300),
    admit_after=st.integers(1, 4),
    watch=st.integers(1, 6),
    ops=st.lists(op, max_size=80),
)
def test_book_follows_the_model(budget: int, admit_after: int, watch: int, ops) -> None:
    book = SegmentBook(budget, admit_after, watch)
    seen: dict[bytes, int] = {}  # sightings, oldest first
    stored: dict[bytes, int] = {}  # bytes, least recently used first
    for what, key, n in ops:
        if what == "sight":
            if key in stored:
                stored[key] = stored.pop(key)
                expect = True
            else:
                total = seen.pop(key, 0) + n
                if admit_after > 1:
                    seen[key] = min(total, admit_after - 1)
                while len(seen) > watch:
                    del seen[next(iter(seen))]
                expect = total >= admit_after
            assert book.sight(key, n) is expect
        elif what == "reserve":
            got = book.reserve(key, n)
            if key in stored:
                stored[key] = stored.pop(key)
                assert got == []
            elif budget and n > budget:
                assert got is None
            else:
                out = []
                while budget and sum(stored.values()) + n > budget:
                    old = next(iter(stored))
                    out.append(old)
                    del stored[old]
                assert got == out  # stored segments only, least recently used first
                seen.pop(key, None)
                stored[key] = n
        elif what == "touch":
            book.touch(key)
            if key in stored:
                stored[key] = stored.pop(key)
        else:
            book.forget(key)
            stored.pop(key, None)
        book.check_integrity()
        assert list(book.stored.items()) == list(stored.items())
        assert dict(book.sightings) == seen
        assert not budget or book.used <= budget


def test_bad_knobs_are_refused() -> None:
    for bad in (
        dict(segment_bytes=-1),
        dict(segment_admit_after=0),
        dict(segment_watch=0),
        dict(segment_bytes="lots"),
    ):
        with pytest.raises(ValueError):
            ConnectorConfig(**bad)  # type: ignore[arg-type]
    assert ConnectorConfig(segment_bytes="1MiB").segment_bytes == 1 << 20
