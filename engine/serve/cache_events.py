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

With a tierkv-server behind the connector, the shared tier's events come from the server's
Watch stream (tierkv.connector.server_watch), not from this replica's own puts: every replica
sharing the server announces what any of them stored there (so a router credits each as able
to load it) and what the server evicted or deleted. What the server held before the replica
subscribed, or stored while its stream was down, is not announced.

A prompt under a cache_salt is a tenant's own: its prefix-cache blocks are not published (the
tree keys them by a salted first token, not the prompt's).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import numpy as np
import xxhash

from tierkv.connector.event_blocks import EventBlocks
from tierkv.connector.placement import SHARED, placement
from tierkv.connector.server_watch import follow
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
    """Hooks that turn the prefix cache's, the tiers' and the server's changes into events for
    publisher."""

    def __init__(self, publisher: Publisher, block_size: int, chunk_size: int, ns: str) -> None:
        self.publisher, self.block_size, self.ns = publisher, block_size, ns
        self.blocks = EventBlocks(block_size, chunk_size)
        self.watcher: concurrent.futures.Future | None = None  # following the server, if any

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        self.publisher.close()

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
        if c.ns != self.ns or (self.watcher is not None and c.tier in SHARED):
            return
        if c.kind == "stored" and c.header is not None:
            self._stored(c.tier, c.key, bytes(c.header.parent), c.header.tokens)
        else:
            self._removed(c.tier, c.key)

    def server(self, ev: Any) -> None:
        """A WatchEvent of the server behind the shared tier (the connector's loop)."""
        for st in ev.stored:
            self._stored("remote", st.key, st.parent, st.tokens)
        for r in ev.removed:
            self._removed("remote", r.key)

    def _stored(self, tier: str, key: bytes, parent: bytes, tokens: Any) -> None:
        b = self.blocks.stored(key, parent, tokens)
        if b is not None:
            bs, at = self.block_size, placement(tier)
            self.publisher.add(
                [BlockStored(b.hashes, b.parent, b.tokens, bs, None, lora_name=None, **at)]
            )

    def _removed(self, tier: str, key: bytes) -> None:
        self.publisher.add([BlockRemoved(self.blocks.removed(key), **placement(tier))])


def start_events(cfg: Any, llm: Any, connector: Any) -> CacheEvents | None:
    """A publisher fed by the engine's prefix cache, the connector's tiers and the server
    behind them, if asked for."""
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
        shared = connector.store.tiers[-1]
        if hasattr(shared, "watch"):  # a tierkv-server
            job = follow(shared, events.server, stored=True, who="tierkv serve")
            events.watcher = connector.loop.submit(job)
        connector.store.watch(events.tiers)
    return events
