"""The engine's invariant checks: a named error, raised even under `python -O`."""

from __future__ import annotations

import os


class InvariantError(RuntimeError):
    """The engine's bookkeeping (queues, blocks, prefix tree) no longer adds up: a bug. The
    storage tiers raise their own (storage_backends.invariants): the engine imports nothing
    of theirs."""


def invariant(ok: bool, what: str) -> None:
    if not ok:
        raise InvariantError(what)


def check_invariants_enabled() -> bool:
    """The debug setting TIERKV_CHECK_INVARIANTS=1 (any value but '', 0, false, no, off)."""
    value = os.environ.get("TIERKV_CHECK_INVARIANTS", "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")
