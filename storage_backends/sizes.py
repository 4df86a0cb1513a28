"""Sizes in human units: the one converter of every size knob ("8GiB", "1.5GB", 4096)."""

from __future__ import annotations

import re

MiB = 1 << 20
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", re.IGNORECASE)


def parse_size(s: str | int) -> int:
    """'8GiB' -> 8 * 2**30, '1.5G' -> 1.5e9, '4096' -> 4096; ValueError on anything else."""
    if isinstance(s, int) and not isinstance(s, bool):
        if s < 0:
            raise ValueError(f"size must be >= 0, got {s}")
        return s
    m = _SIZE.fullmatch(str(s))
    if not m:
        raise ValueError(f"bad size {s!r}: use e.g. 4096, 512MiB, 8GiB, 1.5GB")
    num, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    if binary and not unit:
        raise ValueError(f"bad size {s!r}: 'i' needs a unit (KiB, MiB, GiB, TiB)")
    power = "KMGT".index(unit) + 1 if unit else 0
    return int(num * (1024 if binary else 1000) ** power)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
