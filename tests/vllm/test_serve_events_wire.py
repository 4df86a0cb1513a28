"""tierkv serve's KV event batches (tierkv.engine.serve.kv_events, written without vLLM) decode
with vLLM's own KVEventBatch decoder, field for field."""

from __future__ import annotations

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from tierkv.engine.serve import kv_events as ours


def test_vllm_decodes_serve_batches() -> None:
    batch = ours.KVEventBatch(
        12.5,
        [
            ours.BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None,
                             locality="LOCAL"),
            ours.BlockStored([3], 2, list(range(16)), 16, None, None, None, locality="REMOTE",
                             ownership="SERVER"),
            ours.BlockRemoved([1], "CPU", locality="LOCAL"),
            ours.AllBlocksCleared(),
        ],
    )  # fmt: skip
    got = msgspec.msgpack.Decoder(type=KVEventBatch).decode(msgspec.msgpack.encode(batch))
    assert got.ts == 12.5 and got.data_parallel_rank is None
    a, b, c, d = got.events
    assert isinstance(a, BlockStored) and a.block_hashes == [1, 2] and a.medium == "GPU"
    assert a.token_ids == list(range(32)) and a.block_size == 16 and a.parent_block_hash is None
    assert isinstance(b, BlockStored) and b.parent_block_hash == 2 and b.medium is None
    assert b.locality == "REMOTE" and b.ownership == "SERVER"
    assert isinstance(c, BlockRemoved) and c.block_hashes == [1] and c.medium == "CPU"
    assert type(d).__name__ == "AllBlocksCleared"
