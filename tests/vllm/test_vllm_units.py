"""tierkv.vllm without an engine: the paged layouts (GPU ones included, found from shapes),
the knobs, and the stats vLLM aggregates."""

from __future__ import annotations

import pytest
import torch

from tierkv.connector.plan import ConnectorStats
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
