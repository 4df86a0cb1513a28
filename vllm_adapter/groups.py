"""vLLM's KV cache groups (its hybrid KV cache manager): which block table each layer's KV
lies in, and what a sliding-window group keeps.

vLLM gives every group its own block table (block ids index one pool shared by all groups).
A sliding-window group keeps only the blocks its window reaches: a block wholly below
`computed - window + 1` is freed, reused at once (by another request, or by another group of
the same request) and stands as the null block in the scheduler's tables. So tierkv.vllm:

- saves every layer of each chunk (any chunk may be the last of a later prompt's prefix,
  whose window then reaches back into it), a windowed layer's tokens below `kept_from` as
  zeros: vLLM may have handed their blocks on, and nothing of another request is ever read;
- loads a windowed layer only into the blocks vLLM allocated for its window (the table's
  non-null blocks), which always lie at or above what the save of that chunk zeroed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

NULL = 0  # vLLM's null block: the first block of its pool, standing for a freed slot


@dataclass(frozen=True, slots=True)
class Groups:
    """Each attention layer's group, and per group its sliding window (None: full attention)."""

    of_layer: dict[str, int]
    windows: tuple[int | None, ...]
    block_size: int

    @staticmethod
    def of(kv_cache_config: Any) -> Groups:
        """The groups of vLLM's KVCacheConfig; ValueError for a group tierkv cannot store (not
        plain full or sliding-window attention) or groups of different block sizes."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        of_layer: dict[str, int] = {}
        windows: list[int | None] = []
        sizes = set()
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if type(spec) is SlidingWindowSpec:
                windows.append(spec.sliding_window)
            elif type(spec) is FullAttentionSpec:
                windows.append(None)
            else:
                raise ValueError(
                    f"tierkv.vllm stores full and sliding-window attention KV only; KV cache "
                    f"group {g} ({', '.join(group.layer_names[:3])}...) is a "
                    f"{type(spec).__name__}"
                )
            sizes.add(spec.block_size)
            of_layer.update({name: g for name in group.layer_names})
        if len(sizes) != 1:
            raise ValueError(f"tierkv.vllm needs one block size for every KV group, got {sizes}")
        return Groups(of_layer, tuple(windows), sizes.pop())

    @property
    def by_request(self) -> bool:
        """Several groups: vLLM takes load failures per request only (its block ids are unique
        within a group), which it offers for asynchronous loads alone."""
        return len(self.windows) > 1

    @property
    def windowed(self) -> bool:
        """Some group keeps only its window: its chunks' early tokens may be stored as zeros."""
        return any(w is not None for w in self.windows)

    def kept_from(self, group: int, computed: int) -> int:
        """The first token whose block group still holds during a step that starts with
        `computed` tokens computed: vLLM frees whole blocks below `computed - window + 1`, and
        a later load reaches no lower than that (its prefix ends past `computed`)."""
        w = self.windows[group]
        return 0 if w is None else max(0, computed - w + 1) // self.block_size * self.block_size

    def table(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Per-group block ids as one int32 [groups, blocks] tensor, short tables padded with the
        null block (never read or written)."""
        n = max((len(t) for t in ids), default=0)
        return torch.tensor([list(t) + [NULL] * (n - len(t)) for t in ids], dtype=torch.int32)


def held_range(ids: torch.Tensor, lo: int, hi: int, block_size: int) -> int:
    """The first token of [lo, hi) from which every block of a table row is allocated (not
    null): a windowed group's nulls lead its table. hi when none is; ValueError for a null
    after an allocated block (a table tierkv does not understand: nothing is written)."""
    if hi <= lo:
        return hi
    first, last = lo // block_size, (hi - 1) // block_size
    held = (ids[first : last + 1] != NULL).tolist()
    if True not in held:
        return hi
    at = held.index(True)
    if False in held[at:]:
        raise ValueError("a KV group's block table has a null block inside its window")
    return max(lo, (first + at) * block_size)
