"""Blend rules: which loaded rows a blend prefill recomputes, and how its kept rows attend.

A rule spec is names joined by "+" (docs/cacheblend.md):
- ranking rules, at most one: "cacheblend" (fresh-vs-cached K/V deviation at the check layer),
  "query_early" (the question's attention at the check layer), "query_late" (the question's
  attention at about 3/4 depth, from a question-only pass over the cached KV); each keeps the
  top blend_ratio of the loaded rows;
- "legolink": the first blend_sink_tokens of every loaded segment (fixed rows, kept at every
  layer); alone it runs no full layer; with a ranking rule the kept set is the union;
- "ape": a modifier, no recompute of its own: the kept rows' queries see the still-cached
  context block with APE's temperature and scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

RANKING = ("cacheblend", "query_early", "query_late")
NAMES = (*RANKING, "legolink", "ape")


@dataclass(frozen=True, slots=True)
class Rule:
    rank: str | None  # the ranking rule; None: only fixed rows (the question, sinks)
    sinks: bool = False  # legolink
    ape: bool = False

    @property
    def spec(self) -> str:
        names = ["legolink"] * self.sinks + [self.rank or ""] * bool(self.rank) + ["ape"] * self.ape
        return "+".join(names)


def parse_rule(spec: object, field: str = "blend_rule") -> Rule:
    """A rule spec as a Rule; ValueError naming field when a name is unknown or repeated, or
    two ranking rules are joined (a union is legolink with one ranking rule)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{field} must be a non-empty string of {'/'.join(NAMES)} joined by '+'")
    names = [s.strip() for s in spec.split("+")]
    for s in names:
        if s not in NAMES:
            raise ValueError(f"{field}: unknown rule {s!r} (one of {', '.join(NAMES)})")
    if len(set(names)) != len(names):
        raise ValueError(f"{field}: a rule is named twice in {spec!r}")
    ranks = [s for s in names if s in RANKING]
    if len(ranks) > 1:
        raise ValueError(
            f"{field}: {ranks[0]!r} and {ranks[1]!r} both rank the loaded rows; join legolink "
            "or ape with one of them"
        )
    return Rule(ranks[0] if ranks else None, "legolink" in names, "ape" in names)


def count(share: float, n: int) -> int:
    """Rows in share of n: ceil, with float dust below an integer ignored."""
    return min(n, math.ceil(share * n - 1e-9))


def select(fresh: torch.Tensor, cached: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices (ascending) of the ceil(ratio * N) rows of fresh/cached [N, H, D] that differ
    most."""
    m = count(ratio, fresh.shape[0])
    if m == 0:
        return torch.zeros(0, dtype=torch.long, device=fresh.device)
    dev = (fresh.float() - cached.float()).pow(2).sum(dim=(1, 2))
    return torch.topk(dev, m, sorted=False).indices.sort().values


def random_rows(rows: torch.Tensor, ratio: float) -> torch.Tensor:
    """A seeded random ceil(ratio * N) of rows, ascending: the same prompt picks the same."""
    m = count(ratio, rows.numel())
    g = torch.Generator().manual_seed(rows.numel())
    return rows[torch.randperm(rows.numel(), generator=g)[:m].sort().values]


def sink_rows(
    segments: list[tuple[int, int, bool]], start: int, loaded: torch.Tensor, k: int
) -> torch.Tensor:
    """legolink: mask of the rows (tokens start..) that are among the first k tokens of a
    reusable segment, and loaded."""
    mask = torch.zeros_like(loaded)
    for a, b, reusable in segments:
        if reusable:
            mask[max(a - start, 0) : max(min(a + k, b) - start, 0)] = True
    return mask & loaded


def question_rows(loaded: torch.Tensor) -> torch.Tensor:
    """The rows after the last loaded one (the question), or the last row if none."""
    n = loaded.numel()
    last = int(torch.nonzero(loaded).max()) if loaded.any() else -1
    return torch.arange(last + 1, n) if last + 1 < n else torch.tensor([n - 1])


def top_attended(mass: torch.Tensor, loaded: torch.Tensor, share: float, w: int) -> torch.Tensor:
    """Query rules: mask of the ceil(share * loaded) loaded rows whose attention mass (per row,
    [N]), summed with that of the w loaded rows each side, is largest."""
    x = torch.where(loaded, mass.float().cpu(), 0.0)  # N scores: ranked on the host
    if w:
        x = F.conv1d(x[None, None], torch.ones(1, 1, 2 * w + 1), padding=w)[0, 0]
    rows = torch.nonzero(loaded).flatten()
    top = torch.topk(x[rows], count(share, rows.numel()), sorted=False).indices
    picked = torch.zeros_like(loaded)
    picked[rows[top]] = True
    return picked
