"""Debug checks of the tiers' own bookkeeping.

`TIERKV_CHECK_INVARIANTS=1` in the environment (read when a tier is made) makes every local
tier run its integrity check after each eviction; a broken invariant raises InvariantError.
Off by default: the check walks the whole index. The engine has its own (engine.invariants):
storage_backends and engine import nothing of each other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

CHECK_INVARIANTS_ENV = "TIERKV_CHECK_INVARIANTS"


class InvariantError(RuntimeError):
    """Internal bookkeeping that no longer adds up (index, byte counts, pages): a bug, never a
    fault of the input or of the storage below. Raised by check_integrity."""


def invariant(ok: bool, what: str) -> None:
    """Raise InvariantError(what) unless ok (not an assert: it holds under python -O too)."""
    if not ok:
        raise InvariantError(what)


def check_invariants_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether TIERKV_CHECK_INVARIANTS asks for invariant checks (any value but '', 0, false,
    no, off)."""
    value = (os.environ if env is None else env).get(CHECK_INVARIANTS_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")
