"""tierkv.vllm without an engine: the paged layouts (GPU ones included, found from shapes),
the knobs, and the stats vLLM aggregates."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.connector.plan import ConnectorStats
from tierkv.vllm.blocks import Blocks
from tierkv.vllm.config import connector_config
from tierkv.vllm.layout import detect_layout, gather, scatter
from tierkv.vllm.stats import Reporter, TierKVStats

H, D, BS, NB = 2, 8, 16, 6


@pytest.mark.parametrize(
    ("shape", "kind"),
    [((2, NB, BS, H, D), "kv_first"), ((NB, 2, BS, H, D), "blocks_first")],
)
def test_gpu_layouts_round_trip(shape: tuple[int, ...], kind: str) -> None:
    cache = torch.zeros(shape)
    lay = detect_layout(cache, H, D)
    assert (lay.kind, lay.num_blocks, lay.block_size) == (kind, NB, BS)
    blocks = torch.tensor([5, 2, 0], dtype=torch.int32)
    src = torch.randn(2, 40, H, D)
    scatter(lay, cache, src[:, 3:], blocks, 3)
    assert torch.equal(gather(lay, cache, blocks, 3, 40), src[:, 3:])
    k = cache[0] if kind == "kv_first" else cache[:, 0]
    assert torch.equal(k[2, 1], src[0, BS + 1])  # token 17 sits in the second block, slot 1
    assert k[5, :3].abs().sum() == 0  # tokens before 3 untouched


def test_unknown_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="no known layout"):
        detect_layout(torch.zeros(NB, BS, H * D), H, D)


def test_knobs_are_connector_configs() -> None:
    cfg = connector_config({"remote": "grpc://127.0.0.1:1", "chunk_size": 64, "cpu_bytes": "1MiB"})
    assert (cfg.chunk_size, cfg.tiers.cpu_bytes) == (64, 1 << 20)
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) \['chunk'\]"):
        connector_config({"chunk": 64})
    with pytest.raises(ValueError, match="kv_dtype"):
        connector_config({"kv_dtype": "fp8"})


def test_stats_report_what_changed_and_add_up() -> None:
    stats, rep = ConnectorStats(), Reporter()
    assert rep.delta(stats) is None
    stats.loaded_tokens += 7
    one = rep.delta(stats)
    assert one is not None and one.data == {"loaded_tokens": 7}
    stats.loaded_tokens += 3
    total = TierKVStats({}).aggregate(one).aggregate(rep.delta(stats) or TierKVStats())
    assert total.reduce() == {"loaded_tokens": 10} and not total.is_empty()


def _packings(bs: int, d: int) -> dict[str, torch.Tensor]:
    """Tile packings (token, element -> offset) of the kinds the CPU backend's ISAs use
    (token-major, element-major, element pairs) and one that strides cannot express."""
    t, e = torch.arange(bs)[:, None], torch.arange(d)[None, :]
    return {
        "tokens": t * d + e,
        "elements": e * bs + t,
        "pairs": (e // 2) * bs * 2 + t * 2 + e % 2,
        "shuffled": torch.randperm(bs * d, generator=torch.Generator().manual_seed(bs + d)).view(
            bs, d
        ),
    }


@settings(max_examples=120, deadline=None)
@given(
    kind=st.sampled_from(["kv_first", "blocks_first", "cpu_heads_first"]),
    heads=st.integers(1, 3),
    bs=st.sampled_from([2, 4, 16]),
    d=st.sampled_from([2, 8]),
    span=st.tuples(st.integers(0, 100), st.integers(0, 100)),
    packs=st.tuples(st.sampled_from(list(_packings(4, 2))), st.sampled_from(list(_packings(4, 2)))),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_block_copies_equal_token_copies(
    kind: str,
    heads: int,
    bs: int,
    d: int,
    span: tuple[int, int],
    packs: tuple[str, str],
    dtype: torch.dtype,
) -> None:
    """Whole-block copies (tierkv.vllm.blocks) write and read exactly what the per-token
    index copies do, at any start and length, in every layout and packing."""
    nb = 8
    shape = {
        "kv_first": (2, nb, bs, heads, d),
        "blocks_first": (nb, 2, bs, heads, d),
        "cpu_heads_first": (nb, heads, bs, 2 * d),
    }[kind]
    a = torch.randn(shape).to(dtype)
    b = a.clone()
    lay = detect_layout(a, heads, d)
    if kind == "cpu_heads_first":
        lay.kpos, lay.vpos = (_packings(bs, d)[p] for p in packs)
    fast = Blocks.of(lay)
    if kind == "cpu_heads_first":
        assert [s is None for s in fast.strided] == [p == "shuffled" for p in packs]
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(sum(span)))[:6].int()
    lo, hi = sorted(x % (6 * bs + 1) for x in span)
    src = torch.randn(2, hi - lo, heads, d).to(dtype)
    scatter(lay, a, src, ids, lo)
    fast.scatter(b, src, ids, lo)
    assert torch.equal(a, b)
    assert torch.equal(fast.gather(b, ids, lo, hi), src)
    assert torch.equal(fast.gather(b, ids, lo, hi), gather(lay, a, ids, lo, hi))
