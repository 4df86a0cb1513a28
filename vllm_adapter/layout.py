"""vLLM's paged KV layouts, found from the registered tensors' shapes, and the copies between
one layer of them and a segment's layer `[2, T, Hkv, D]`.

Each layout is addressed by index tuples that select K and V of a list of (block, offset)
slots as `[T, Hkv, D]`; a copy indexes the layer's storage in place, so no layout needs a
kernel of its own and nothing is copied whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# name -> what a layer's tensor looks like (nb = blocks, bs = block size)
LAYOUTS = {
    "kv_first": "[2, nb, bs, Hkv, D]  (FlashAttention, Triton and other GPU backends)",
    "blocks_first": "[nb, 2, bs, Hkv, D]  (FlashInfer)",
    "cpu_heads_first": "[nb, Hkv, bs, 2*D]  (the CPU backend: K then V along the last axis)",
}


@dataclass(slots=True)
class PagedLayout:
    """How one engine's per-layer KV tensors are laid out (the same for every layer).

    kpos, vpos (cpu_heads_first only): where token t's element d lies within one (block, head)
    tile of K and of V, `[bs, D]` offsets; the CPU backend packs K's tile (for its vector
    ISAs, d-major), so these are measured by `probe_tiles` with the backend's own writer."""

    kind: str  # a key of LAYOUTS
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kpos: torch.Tensor | None = None
    vpos: torch.Tensor | None = None

    def index(self, t: torch.Tensor, b: torch.Tensor, o: torch.Tensor) -> list[tuple]:
        """Index tuples into (a view of) t that address K and V of tokens at (block b, offset o),
        each selecting `[T, Hkv, D]`."""
        if self.kind == "kv_first":
            return [(0, b, o), (1, b, o)]
        if self.kind == "blocks_first":
            return [(b, 0, o), (b, 1, o)]
        if self.kpos is None or self.vpos is None:
            raise ValueError("the CPU layout needs its tile offsets (probe_tiles)")
        h = torch.arange(self.num_kv_heads, device=b.device)[None, :, None]
        bb = b[:, None, None]
        return [
            (bb, h, kv, pos.to(b.device)[o][:, None, :])
            for kv, pos in enumerate((self.kpos, self.vpos))
        ]

    def addressable(self, t: torch.Tensor) -> torch.Tensor:
        """The view of t that index() addresses (the CPU tiles flattened: [nb, H, 2, bs*D])."""
        if self.kind != "cpu_heads_first":
            return t
        return t.view(self.num_blocks, self.num_kv_heads, 2, self.block_size * self.head_dim)


def detect_layout(t: torch.Tensor, num_kv_heads: int, head_dim: int) -> PagedLayout:
    """The layout of a registered KV tensor, from its shape and the model's KV heads and head
    size; ValueError when no known layout fits (or more than one)."""
    s, h, d = tuple(t.shape), num_kv_heads, head_dim
    fits = []
    if len(s) == 5 and s[0] == 2 and s[3:] == (h, d):
        fits.append(PagedLayout("kv_first", s[1], s[2], h, d))
    if len(s) == 5 and s[1] == 2 and s[3:] == (h, d):
        fits.append(PagedLayout("blocks_first", s[0], s[2], h, d))
    if len(s) == 4 and s[1] == h and s[3] == 2 * d:
        fits.append(PagedLayout("cpu_heads_first", s[0], s[2], h, d))
    if len(fits) != 1:
        known = "; ".join(LAYOUTS.values())
        raise ValueError(
            f"KV tensor of shape {list(s)} (Hkv={h}, D={d}) matches "
            f"{'no' if not fits else 'more than one'} known layout: {known}"
        )
    return fits[0]


Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def probe_tiles(
    layout: PagedLayout, cache: torch.dtype, stored: torch.dtype, write: Writer
) -> None:
    """Measure where the backend's writer (kv_cache, key, value, slot_mapping; key and value
    are the values the cache is to hold) puts each token's K and V element within a (block,
    head) tile of the CPU layout, on a one-block scratch cache of dtype `cache` holding
    `stored` values (uint8 bytes of float8 values under fp8).

    It writes each token's index t, then each element's index d, one base-8 digit a pass: digit
    k as 2**k, which every float and fp8 dtype holds exactly, read back as the nearest power of
    two (vLLM's fp8 writers round toward zero, so a scale's rounding can leave a value just
    under 2**k; integers such as t + 1 are not exact in fp8 above 16)."""
    bs, d = layout.block_size, layout.head_dim
    found = []
    for n, index in (
        (bs, torch.arange(bs)[:, None].expand(bs, d)),
        (d, torch.arange(d)[None, :].expand(bs, d)),
    ):
        got = torch.zeros(2, bs * d, dtype=torch.long)
        for i in range(len(f"{n - 1:o}")):  # the base-8 digits of the largest index
            x = torch.pow(2.0, (index // 8**i % 8).to(torch.float32))[:, None, :].contiguous()
            scratch = torch.zeros(1, 1, bs, 2 * d, dtype=cache)
            write(scratch, x, x, torch.arange(bs, dtype=torch.long))
            e = torch.log2(scratch.view(stored).view(2, bs * d).to(torch.float32))
            if not torch.isfinite(e).all():  # 0 (unwritten) or a negative or NaN value
                raise ValueError("the backend's writer left part of a KV tile unwritten")
            k = e.round()
            if ((e - k).abs() > 0.25).any() or (k < 0).any() or (k > 7).any():
                raise ValueError("the backend's writer stored values other than those written")
            got += k.to(torch.long) * 8**i
        found.append(got)
    pos = []
    for kv in (0, 1):
        t_of, d_of = found[0][kv], found[1][kv]
        if (t_of >= bs).any() or (d_of >= d).any():
            raise ValueError("the backend's writer stored values other than those written")
        p = torch.full((bs, d), -1, dtype=torch.long)
        p[t_of, d_of] = torch.arange(bs * d)
        if (p < 0).any():
            raise ValueError("the backend's writer does not map tokens one to one into a tile")
        pos.append(p)
    layout.kpos, layout.vpos = pos


def slots(
    block_ids: torch.Tensor, start: int, end: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) index tensors of tokens [start, end) of a request with these blocks."""
    pos = torch.arange(start, end)
    return block_ids.to(torch.long)[pos // block_size], pos % block_size


def gather(
    layout: PagedLayout, t: torch.Tensor, block_ids: torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """Tokens [start, end) of one layer as `[2, T, Hkv, D]` (a new tensor on t's device)."""
    b, o = (x.to(t.device) for x in slots(block_ids, start, end, layout.block_size))
    view = layout.addressable(t)
    return torch.stack([view[i] for i in layout.index(t, b, o)])


def scatter(
    layout: PagedLayout, t: torch.Tensor, src: torch.Tensor, block_ids: torch.Tensor, start: int
) -> None:
    """Write src `[2, T, Hkv, D]` into tokens [start, start+T) of one layer, in place."""
    b, o = (
        x.to(t.device) for x in slots(block_ids, start, start + src.shape[1], layout.block_size)
    )
    view, src = layout.addressable(t), src.to(device=t.device, dtype=t.dtype)
    for kv, i in enumerate(layout.index(t, b, o)):
        view[i] = src[kv]
