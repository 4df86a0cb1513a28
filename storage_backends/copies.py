"""Payload copy counting, a test hook: each place in tierkv that copies payload bytes reports
them here, so a test can hold the copy table of docs/architecture.md to the code.

Off unless a test turns it on with `counting()`; off, a report is one global read."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

_counts: Counter[str] | None = None
_lock = threading.Lock()  # the connector's loop thread and the caller's thread both report


def copied(site: str, nbytes: int) -> None:
    """Report that `site` copied nbytes of payload (a no-op unless a test is counting)."""
    counts = _counts
    if counts is not None:
        with _lock:
            counts[site] += nbytes


@contextmanager
def counting() -> Iterator[Counter[str]]:
    """Count payload bytes copied per site while the block runs (process-wide)."""
    global _counts
    prev, _counts = _counts, Counter()
    try:
        yield _counts
    finally:
        _counts = prev
