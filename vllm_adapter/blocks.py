"""Whole-block copies between a segment's layer `[2, T, Hkv, D]` and vLLM's paged layouts: the
tokens of a copy that fill whole blocks move as one `index_copy_` (or `index_select`) per K and
V over the block axis, the CPU layout's tile packing applied by one precomputed gather; only
the tokens of a block a copy starts or ends inside go through layout.py's per-token indexing.

An 8000-token load into the CPU layout spent most of its time building and applying
per-element index tensors; whole blocks cost two memory passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.vllm import layout as slots_io
from tierkv.vllm.layout import PagedLayout


@dataclass(slots=True, eq=False)
class Blocks:
    """One layout's block copies. pack[kv] (CPU layout only): for each element of one block's
    `[Hkv, bs*D]` tiles, its index in the block's tokens `[bs, Hkv, D]` flattened; unpack[kv]
    the reverse."""

    paged: PagedLayout
    pack: list[torch.Tensor]
    unpack: list[torch.Tensor]
    strided: list[Strides | None]  # the packing as strides, where it is one (the usual case)
    cache: dict[tuple, torch.Tensor] = field(default_factory=dict)  # _order's, per block count

    @classmethod
    def of(cls, paged: PagedLayout) -> Blocks:
        if paged.kind != "cpu_heads_first":
            return cls(paged, [], [], [])
        if paged.kpos is None or paged.vpos is None:
            raise ValueError("the CPU layout needs its tile offsets (probe_tiles)")
        bs, h, d = paged.block_size, paged.num_kv_heads, paged.head_dim
        heads = torch.arange(h)[:, None]
        pack, unpack, strided = [], [], []
        for pos in (paged.kpos, paged.vpos):
            flat = pos.reshape(-1)  # (t, d) -> tile element
            inv = torch.empty_like(flat)
            inv[flat] = torch.arange(bs * d)  # tile element -> t*D + d
            t, dd = inv // d, inv % d
            pack.append(((t[None, :] * h + heads) * d + dd[None, :]).reshape(-1))
            unpack.append((heads[None] * bs * d + pos[:, None, :]).reshape(-1))
            strided.append(affine(pos))
        return cls(paged, pack, unpack, strided)

    def _view(self, t: torch.Tensor, kv: int) -> torch.Tensor:
        """K or V of every block: [nb, bs, Hkv, D], or [nb, Hkv, bs*D] in the CPU layout."""
        p = self.paged
        if p.kind == "kv_first":
            return t[kv]
        if p.kind == "blocks_first":
            return t[:, kv]
        return p.addressable(t)[:, :, kv]

    def _split(self, start: int, n: int) -> tuple[int, int]:
        """(a, b): tokens [a, b) of a copy of n tokens from `start` fill whole blocks."""
        bs = self.paged.block_size
        a = min(n, -start % bs)
        return a, a + (n - a) // bs * bs

    def _order(self, which: list[torch.Tensor], kv: int, n: int, device: torch.device) -> Any:
        """`which[kv]` repeated over n blocks, as indexes into n blocks' elements flattened."""
        key = (id(which), kv, n, device)
        if key not in self.cache:
            per = which[kv].numel()
            at = torch.arange(n)[:, None] * per + which[kv][None, :]
            self.cache[key] = at.reshape(-1).to(device)
        return self.cache[key]

    def _tile(self, view: torch.Tensor, block: int, kv: int) -> torch.Tensor:
        """One block's tiles (a view of the cache) as `[Hkv, T1, T2, D1, D2]`."""
        st = self.strided[kv]
        assert st is not None
        tile = view[block]  # [Hkv, bs*D], each head's tile contiguous
        return tile.as_strided(
            (tile.shape[0],) + st.sizes, (tile.stride(0),) + st.steps, tile.storage_offset()
        )

    def _tokens(self, x: torch.Tensor, kv: int) -> torch.Tensor:
        """One block of tokens `[bs, Hkv, D]` as `[Hkv, T1, T2, D1, D2]` (a view)."""
        st = self.strided[kv]
        assert st is not None
        t1, t2, d1, d2 = st.sizes
        return x.reshape(t1, t2, self.paged.num_kv_heads, d1, d2).permute(2, 0, 1, 3, 4)

    def _put(self, view: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, kv: int) -> None:
        """Tokens x `[m*bs, Hkv, D]` into blocks idx of K or V's per-block view."""
        m, bs = len(idx), self.paged.block_size
        if self.pack and self.strided[kv] is not None:  # straight into each block's tiles
            for j, block in enumerate(idx.tolist()):
                self._tile(view, block, kv).copy_(self._tokens(x[j * bs : (j + 1) * bs], kv))
            return
        if self.pack:
            x = x.reshape(-1).take(self._order(self.pack, kv, m, x.device))
        view.index_copy_(0, idx, x.reshape((m,) + view.shape[1:]))

    def _get(self, view: torch.Tensor, idx: torch.Tensor, kv: int, out: torch.Tensor) -> None:
        """Blocks idx of K or V's per-block view into out `[m*bs, Hkv, D]`."""
        m, bs = len(idx), self.paged.block_size
        if self.pack and self.strided[kv] is not None:
            for j, block in enumerate(idx.tolist()):
                self._tokens(out[j * bs : (j + 1) * bs], kv).copy_(self._tile(view, block, kv))
            return
        x = view.index_select(0, idx)
        if self.pack:
            x = x.reshape(-1).take(self._order(self.unpack, kv, m, x.device))
        out.copy_(x.reshape(out.shape))

    def scatter(
        self, t: torch.Tensor, src: torch.Tensor, block_ids: torch.Tensor, start: int
    ) -> None:
        """Write src `[2, T, Hkv, D]` into tokens [start, start+T) of one layer, in place."""
        p, n = self.paged, src.shape[1]
        a, b = self._split(start, n)
        src = src.to(device=t.device, dtype=t.dtype)
        if b > a:
            first, m = (start + a) // p.block_size, (b - a) // p.block_size
            idx = block_ids[first : first + m].to(t.device, torch.long)
            bits, raw = _bits(t), _bits(src)
            for kv in (0, 1):
                self._put(self._view(bits, kv), raw[kv, a:b], idx, kv)
        for lo, hi in ((0, a), (b, n)):
            if hi > lo:
                slots_io.scatter(p, t, src[:, lo:hi], block_ids, start + lo)

    def gather(
        self, t: torch.Tensor, block_ids: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        """Tokens [start, end) of one layer as `[2, T, Hkv, D]` (a new tensor on t's device)."""
        p, n = self.paged, end - start
        a, b = self._split(start, n)
        out = torch.empty(2, n, p.num_kv_heads, p.head_dim, dtype=t.dtype, device=t.device)
        if b > a:
            first, m = (start + a) // p.block_size, (b - a) // p.block_size
            idx = block_ids[first : first + m].to(t.device, torch.long)
            bits, raw = _bits(t), _bits(out)
            for kv in (0, 1):
                self._get(self._view(bits, kv), idx, kv, raw[kv, a:b])
        for lo, hi in ((0, a), (b, n)):
            if hi > lo:
                out[:, lo:hi] = slots_io.gather(p, t, block_ids, start + lo, start + hi)
        return out


# Copies move bits: integer views take torch's fast paths, which bf16 and fp8 lack.
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(INTS[x.element_size()])


@dataclass(slots=True, frozen=True)
class Strides:
    """A tile packing that strides express: token t = t1*T2 + t2 and element d = d1*D2 + d2
    lie at t1*steps[0] + t2*steps[1] + d1*steps[2] + d2*steps[3]."""

    sizes: tuple[int, int, int, int]  # T1, T2, D1, D2
    steps: tuple[int, int, int, int]


def affine(pos: torch.Tensor) -> Strides | None:
    """The packing `pos` [bs, D] (token, element -> tile offset) as strides over a split of the
    token and element axes into powers of two (row-major, d-major, pairs of elements...), or
    None when no such split expresses it."""
    bs, d = pos.shape
    for t2 in _pow2(bs):
        for d2 in _pow2(d):
            sizes = (bs // t2, t2, d // d2, d2)
            p = pos.reshape(sizes)
            steps = tuple(
                int(p[tuple(int(j == i) for j in range(4))] - p[0, 0, 0, 0]) if n > 1 else 0
                for i, n in enumerate(sizes)
            )
            grid = torch.zeros(sizes, dtype=torch.long) + p[0, 0, 0, 0]
            for i, n in enumerate(sizes):
                shape = [1, 1, 1, 1]
                shape[i] = n
                grid = grid + torch.arange(n).view(shape) * steps[i]
            if int(p[0, 0, 0, 0]) == 0 and torch.equal(grid, p):
                return Strides(sizes, steps)  # type: ignore[arg-type]
    return None


def _pow2(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length()) if n % (1 << k) == 0]
