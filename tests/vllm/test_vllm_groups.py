"""vLLM's KV cache groups without an engine: groups from vLLM's own spec classes (and the ones
refused), what a sliding window keeps, and a worker over two groups sharing one tensor (as
vLLM's hybrid manager lays them out) over a real cpu tier: a windowed layer saves the blocks
vLLM may have handed on as zeros and loads only into its window's blocks, never the null
block; with several groups a failed load is named by request, never by block."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

from tests.vllm.harness import local_core
from tierkv.connector.plan import Chunk, LoadPlan
from tierkv.connector.worker import WorkerCore
from tierkv.vllm.groups import NULL, Groups, held_range
from tierkv.vllm.ranks import Heads
from tierkv.vllm.scheduler import SaveSpec, TierKVMetadata
from tierkv.vllm.worker import WorkerSide

H, D, BS, NB, W = 1, 8, 4, 12, 5  # W: the sliding window, in tokens
FP = bytes(range(16))


def spec(window: int | None, block_size: int = BS) -> FullAttentionSpec | SlidingWindowSpec:
    kw = dict(block_size=block_size, num_kv_heads=H, head_size=D, dtype=torch.float32)
    return (
        FullAttentionSpec(**kw)
        if window is None
        else SlidingWindowSpec(sliding_window=window, **kw)
    )


def config(*specs) -> SimpleNamespace:
    groups = [
        SimpleNamespace(layer_names=[f"layer.{g}"], kv_cache_spec=s) for g, s in enumerate(specs)
    ]
    return SimpleNamespace(kv_cache_groups=groups)


def test_groups_from_vllm_specs() -> None:
    g = Groups.of(config(spec(W), spec(None)))
    assert g.of_layer == {"layer.0": 0, "layer.1": 1} and g.windows == (W, None)
    assert g.by_request and g.windowed
    plain = Groups.of(config(spec(None)))
    assert not plain.by_request and not plain.windowed


def test_groups_tierkv_cannot_store_are_refused() -> None:
    mamba = MambaSpec(block_size=BS, shapes=((4,),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="group 1 .* is a MambaSpec"):
        Groups.of(config(spec(None), mamba))
    with pytest.raises(ValueError, match="one block size"):
        Groups.of(config(spec(W), spec(None, 2 * BS)))


def test_what_a_window_keeps() -> None:
    g = Groups.of(config(spec(W), spec(None)))
    # vLLM frees whole blocks below computed - W + 1: at 12 computed, tokens 8.. stay
    assert [g.kept_from(0, c) for c in (0, 4, 8, 12, 13)] == [0, 0, 4, 8, 8]
    assert g.kept_from(1, 12) == 0  # full attention keeps everything
    assert g.table([[1, 2], [3]]).tolist() == [[1, 2], [3, NULL]]
    ids = torch.tensor([NULL, NULL, 5, 6])
    assert held_range(ids, 0, 16, BS) == 8 and held_range(ids, 10, 16, BS) == 10
    assert held_range(ids, 0, 8, BS) == 8  # nothing held: nothing to write
    with pytest.raises(ValueError, match="null block inside"):
        held_range(torch.tensor([5, NULL, 6]), 0, 12, BS)


@pytest.fixture
def core() -> Iterator[WorkerCore]:
    with local_core("test-groups") as c:
        yield c


def worker(core: WorkerCore, shared: torch.Tensor) -> WorkerSide:
    """Layer 0 windowed (group 0), layer 1 full attention (group 1), one tensor for both."""
    w = WorkerSide(core, FP, Heads.of(0, 1, H))
    groups = Groups.of(config(spec(W), spec(None)))
    w.register({"layer.0": shared, "layer.1": shared}, D, None, groups)
    return w


def test_a_window_saves_what_it_kept_and_loads_into_its_blocks(core: WorkerCore) -> None:
    torch.manual_seed(0)
    src = torch.randn(2, NB, BS, H, D)
    n = 12  # one chunk of 12 tokens; its step started at 8 computed: tokens 0-3 may be gone
    c = Chunk(0, bytes(range(16, 32)), bytes(16), 0, n)
    tokens = np.arange(n, dtype=np.int32)
    table = torch.tensor([[NULL, 2, 3], [4, 5, 6]], dtype=torch.int32)  # block 1 was handed on
    w = worker(core, src)
    w.bind(TierKVMetadata([], [SaveSpec("r", table, c, tokens)]))
    for name in ("layer.0", "layer.1"):
        w.save_layer(name, src)
    w.core.submit()
    w.core.flush()

    dst = torch.zeros_like(src)
    dst[:, NULL] = 7.0  # vLLM's null block: never written
    r = worker(core, dst)
    # a prefix ending at 12 in the reader: the window's blocks are 1 and 2 (tokens 4-11)
    tables = {"r": torch.tensor([[NULL, 8, 9], [10, 11, 1]], dtype=torch.int32)}
    r.start_load([LoadPlan("r", tables["r"][0], 0, n, [c], ["cpu"], tokens)], tables)
    assert r.loaded() == ({"r"}, set())  # two groups: loads are named by request
    assert r.load_errors() == set()
    assert (dst[:, NULL] == 7.0).all()
    assert torch.equal(dst[:, [8, 9]], src[:, [2, 3]])  # the window: what the writer held
    assert torch.equal(dst[:, [10, 11, 1]], src[:, [4, 5, 6]])  # full attention: every token
    assert dst[:, 2:8].abs().sum() == 0  # no other block


def test_a_failed_load_with_several_groups_names_its_request(core: WorkerCore) -> None:
    dst = torch.zeros(2, NB, BS, H, D)
    w = worker(core, dst)
    c = Chunk(0, bytes(range(32, 48)), bytes(16), 0, 8)  # never stored
    tables = {"q": torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)}
    tokens = np.arange(8, dtype=np.int32)
    w.start_load([LoadPlan("q", tables["q"][0], 0, 8, [c], ["cpu"], tokens)], tables)
    assert w.loaded() == ({"q"}, {"q"})
    assert w.load_errors() == set()  # vLLM takes no block ids across groups
    assert dst.abs().sum() == 0
