"""Tensor-parallel ranks without an engine: which heads a rank holds, the per-head part keys,
the lookup that needs every part, KV saved by a TP=1 worker loading into TP=2 ranks (each its
own heads, nothing else) over a real cpu tier, a missing part as a recompute, and every rank
reporting every finished request, a rank that saved nothing included; pipeline parallelism
refused."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.vllm.harness import local_core
from tierkv.connector.plan import Chunk, LoadPlan
from tierkv.connector.worker import WorkerCore
from tierkv.storage_backends.keys import head_key
from tierkv.vllm.config import connector_config, salt
from tierkv.vllm.ranks import Heads, chunk_tiers, part_keys
from tierkv.vllm.scheduler import SaveSpec, TierKVMetadata
from tierkv.vllm.worker import WorkerSide

L, H, D, BS, NB, T = 2, 2, 8, 4, 8, 10
FP = bytes(range(16))


def test_heads_of_each_rank() -> None:
    assert Heads.of(0, 1, 4) == Heads(0, 4, 4)
    assert [Heads.of(r, 2, 4) for r in range(2)] == [Heads(0, 2, 4), Heads(2, 2, 4)]
    # more ranks than KV heads: vLLM replicates each head; only its first replica saves it
    assert [Heads.of(r, 4, 2) for r in range(4)] == [
        Heads(0, 1, 2, True),
        Heads(0, 1, 2, False),
        Heads(1, 1, 2, True),
        Heads(1, 1, 2, False),
    ]
    with pytest.raises(ValueError, match="do not split"):
        Heads.of(0, 2, 3)


def test_pipeline_parallelism_is_refused_at_start() -> None:
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype="auto"),
        model_config=SimpleNamespace(dtype=torch.float32),
        parallel_config=SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1),
    )
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        salt(cfg, connector_config({"remote": "grpc://127.0.0.1:1"}))


def test_part_keys_are_the_same_for_every_layout() -> None:
    c = Chunk(0, bytes(16), bytes(16), 0, 16)
    one = [p.key for p in Heads.of(0, 1, 4).parts(c)]
    two = [p.key for r in range(2) for p in Heads.of(r, 2, 4).parts(c)]
    assert one == two == [head_key(c.key, h) for h in range(4)] == part_keys([c], 4)
    assert len(set(one)) == 4 and c.key not in one


def test_a_chunk_counts_only_with_every_part() -> None:
    # two chunks of two parts: the first whole (tiers 0 and 1), the second missing a part
    assert chunk_tiers([0, 1, 0, None], 2) == [1, None]


def kv_first(heads: int) -> list[torch.Tensor]:
    return [torch.zeros(2, NB, BS, heads, D) for _ in range(L)]


@pytest.fixture
def core() -> Iterator[WorkerCore]:
    with local_core("test-ranks") as c:
        yield c


def worker(core: WorkerCore, heads: Heads, caches: list[torch.Tensor]) -> WorkerSide:
    w = WorkerSide(core, FP, heads)
    w.register({f"layer.{i}": t for i, t in enumerate(caches)}, D, None)
    return w


def save(w: WorkerSide, caches: list[torch.Tensor], blocks: torch.Tensor, c: Chunk) -> None:
    tokens = np.arange(T, dtype=np.int32)
    w.bind(TierKVMetadata([], [SaveSpec("r", blocks[None], c, tokens[c.start : c.end])]))
    for i, t in enumerate(caches):
        w.save_layer(f"layer.{i}", t)
    w.core.submit()
    w.core.flush()


def load(w: WorkerSide, blocks: torch.Tensor, c: Chunk) -> set[int]:
    tokens = np.arange(T, dtype=np.int32)
    w.start_load([LoadPlan("r", blocks, c.start, c.end, [c], ["cpu"], tokens)], {"r": blocks[None]})
    for i in range(L):
        w.wait_layer(f"layer.{i}")
    return w.core.load_errors()


def test_tp1_saves_and_each_tp2_rank_loads_its_heads(core: WorkerCore) -> None:
    torch.manual_seed(0)
    src = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    blocks = torch.tensor([3, 1, 6], dtype=torch.int32)
    c = Chunk(0, bytes(range(16, 32)), bytes(16), 0, T)
    one = worker(core, Heads.of(0, 1, H), src)
    save(one, src, blocks, c)
    assert core.stats.saved_chunks == H  # one segment per KV head
    for r in range(2):  # each TP=2 rank, its cache holding one head, other blocks
        mine = kv_first(1)
        rank = worker(core, Heads.of(r, 2, H), mine)
        dst = torch.tensor([0, 5, 2], dtype=torch.int32)
        assert load(rank, dst, c) == set()
        for t, s in zip(mine, src):
            want = s[:, blocks.long(), :, r : r + 1].reshape(2, -1, 1, D)[:, :T]
            assert torch.equal(t[:, dst.long()].reshape(2, -1, 1, D)[:, :T], want)
    # and back: TP=2 ranks' parts load whole into a TP=1 cache
    back = kv_first(H)
    assert load(worker(core, Heads.of(0, 1, H), back), blocks, c) == set()
    for t, s in zip(back, src):
        got, want = (x[:, blocks.long()].reshape(2, -1, H, D)[:, :T] for x in (t, s))
        assert torch.equal(got, want)


def test_a_missing_part_is_a_recompute_and_writes_nothing(core: WorkerCore) -> None:
    src = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    blocks = torch.tensor([0, 1, 2], dtype=torch.int32)
    c = Chunk(0, bytes(range(32, 48)), bytes(16), 0, T)
    save(worker(core, Heads.of(0, 1, H), src), src, blocks, c)
    assert core.loop.run(core.store.delete(head_key(c.key, 1)), 10)
    ok, gone = kv_first(1), kv_first(1)
    assert load(worker(core, Heads.of(0, 2, H), ok), blocks, c) == set()
    assert load(worker(core, Heads.of(1, 2, H), gone), blocks, c) == {0, 1, 2}
    assert all(t.abs().sum() == 0 for t in gone)
    whole = kv_first(H)  # a TP=1 reader misses the chunk as a whole
    assert load(worker(core, Heads.of(0, 1, H), whole), blocks, c) == {0, 1, 2}
    assert all(t.abs().sum() == 0 for t in whole)


def test_every_rank_reports_every_finished_request(core: WorkerCore) -> None:
    c = Chunk(0, bytes(range(48, 64)), bytes(16), 0, T)
    blocks = torch.tensor([4, 5, 6], dtype=torch.int32)
    ranks = [worker(core, Heads.of(r, 4, H), kv_first(1)) for r in range(4)]
    for w in ranks:  # ranks 1 and 3 hold replicas: they save nothing, and report all the same
        save(w, [torch.randn(2, NB, BS, 1, D) for _ in range(L)], blocks, c)
    assert core.stats.saved_chunks + core.stats.save_skipped == H
    assert [w.finished({"r"}) for w in ranks] == [{"r"}] * 4
    assert [w.finished(set()) for w in ranks] == [set()] * 4  # once
