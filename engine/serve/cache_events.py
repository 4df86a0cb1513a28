"""What serve publishes as KV events: the engine's prefix cache (its blocks, medium GPU, as vLLM
names device blocks) and the connector's tiers.

Every event names engine blocks (`block_size` tokens, the size routers split token ids by): a
prefix-cache block under a chained xxh3_64 of its tokens, a stored chunk as its full blocks
(tierkv.connector.event_blocks, shared with tierkv.vllm). Hashes are unsigned 64-bit ints, as
vLLM writes its own by default; routers match prompts by the token ids.

Media as vllm-router's kv_aware admits and credits them (tierkv.connector.placement): the
replica's own tiers are `GPU`, `CPU` and `DISK` with locality LOCAL and no ownership (device,
host and disk credits); the shared tier is medium None, locality REMOTE and ownership `SERVER`
(a tierkv-server) or `REDIS` (external credit).

A prompt under a cache_salt is a tenant's own: its prefix-cache blocks are not published (the
tree keys them by a salted first token, not the prompt's).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from tierkv.connector.event_blocks import EventBlocks
from tierkv.connector.placement import placement
from tierkv.engine.serve.kv_events import BlockRemoved, BlockStored, KVCacheEvent, Publisher
from tierkv.storage_backends.tier import TierChange

PREFIX_SEED = b"tierkv-prefix-cache"


def chain(tokens: tuple[int, ...], block_size: int) -> list[int]:
    """One chained hash per full block of tokens."""
    out, prev = [], PREFIX_SEED
    arr = np.asarray(tokens, dtype="<i4")
    for i in range(len(tokens) // block_size):
        h = xxhash.xxh3_64(prev)
        h.update(arr[i * block_size : (i + 1) * block_size].tobytes())
        prev = h.digest()
        out.append(h.intdigest())
    return out


class CacheEvents:
    """Hooks that turn the prefix cache's and the tiers' changes into events for publisher."""

    def __init__(self, publisher: Publisher, block_size: int, chunk_size: int, ns: str) -> None:
        self.publisher, self.block_size, self.ns = publisher, block_size, ns
        self.blocks = EventBlocks(block_size, chunk_size)

    def prefix_cache(self, kind: str, path: tuple[int, ...], n: int) -> None:
        """RadixTree.on_change: the last n blocks of path came or went (engine thread)."""
        if not path or path[0] < 0:
            return
        bs = self.block_size
        hashes = chain(path, bs)
        ev: KVCacheEvent
        if kind == "stored":
            parent = hashes[-n - 1] if len(hashes) > n else None
            tokens = [int(t) for t in path[len(path) - n * bs :]]
            ev = BlockStored(hashes[-n:], parent, tokens, bs, None, "GPU", None, locality="LOCAL")
        else:
            ev = BlockRemoved(hashes[-n:], "GPU", locality="LOCAL")
        self.publisher.add([ev])

    def tiers(self, c: TierChange) -> None:
        """TieredStore.watch: a chunk came into a tier or left it (the connector's loop)."""
        if c.ns != self.ns:
            return
        where = placement(c.tier)
        ev: KVCacheEvent
        if c.kind == "stored" and c.header is not None:
            h = c.header
            b = self.blocks.stored(c.key, bytes(h.parent), h.tokens)
            if b is None:
                return
            bs = self.block_size
            ev = BlockStored(b.hashes, b.parent, b.tokens, bs, None, lora_name=None, **where)
        else:
            ev = BlockRemoved(self.blocks.removed(c.key), **where)
        self.publisher.add([ev])


def start_events(cfg: Any, llm: Any, connector: Any) -> Publisher | None:
    """A publisher fed by the engine's prefix cache and the connector's tiers, if asked for."""
    if cfg.kv_events_endpoint is None:
        return None
    pub = Publisher(
        cfg.kv_events_endpoint,
        cfg.kv_events_replay_endpoint,
        cfg.kv_events_topic,
        cfg.kv_events_buffer_steps,
    )
    chunk = connector.config.chunk_size if connector is not None else llm.config.block_size
    ns = connector.ns if connector is not None else ""
    events = CacheEvents(pub, llm.config.block_size, chunk, ns)
    if llm.blocks.tree is not None:
        llm.blocks.tree.on_change = events.prefix_cache
    if connector is not None:
        connector.store.watch(events.tiers)
    return pub
