"""The connector's side of workflow hints (KVFlow): tag a request's chunk keys with its
agent, in the local tiers and on the cache server, and prefetch the prompts of the agents that
run next (the local tiers from the server, the server from its disk or Redis).

Safety contract: nothing here blocks the engine or fails a request; every call is fire and
forget on the connector's loop thread (the tiers' one event loop, so their HintBooks are
touched from it alone); at most `max_pending` advice calls wait there, more are dropped and
counted; a failing server is a no-op (hints are advice).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tierkv.connector.loop import LoopThread
from tierkv.connector.plan import Chunk
from tierkv.connector.requests import prefix_chunks
from tierkv.storage_backends.hints import KVHint
from tierkv.storage_backends.keys import ChunkHasher
from tierkv.storage_backends.store import TieredStore

log = logging.getLogger("tierkv.connector")


@dataclass(slots=True)
class WorkflowStats:
    hinted: int = 0  # requests whose chunk keys were tagged
    prefetches: int = 0  # prefetch calls accepted
    dropped: int = 0  # advice calls dropped: too many waiting on the loop thread


@dataclass(slots=True, eq=False)
class Workflows:
    loop: LoopThread
    store: TieredStore
    ns: str
    max_pending: int = 256  # advice calls waiting on the loop thread
    stats: WorkflowStats = field(default_factory=WorkflowStats)
    pending: set[concurrent.futures.Future] = field(default_factory=set)

    def advise(self, keys: Sequence[bytes], hint: KVHint) -> None:
        """A request of hint's agent uses keys: tag them here and on the server."""
        if self._submit(list(keys), hint, False):
            self.stats.hinted += 1

    def advise_request(self, request: object, chunks: Sequence[Chunk]) -> None:
        """A request that carries a workflow's advice (its kv_hint, storage_backends.hints):
        its chunk keys are tagged with it."""
        hint = getattr(request, "kv_hint", None)
        if isinstance(hint, KVHint) and chunks:
            self.advise([c.key for c in chunks], hint)

    def prefetch(self, keys: Sequence[bytes], hint: KVHint | None) -> None:
        """keys are needed soon: tag them (with hint), ask the server to move them up to its
        fastest tier, and load those it holds into the local tiers, all in the background."""
        if self._submit(list(keys), hint, True):
            self.stats.prefetches += 1

    def prefetch_prompt(
        self,
        hasher: Callable[[], ChunkHasher],
        token_ids: list[int],
        hint: KVHint | None,
        partial: bool,
    ) -> None:
        """prefetch the chunk keys of a prompt (keyed by hasher()); never raises."""
        try:
            tokens = np.asarray(token_ids, dtype=np.int32)
            self.prefetch([c.key for c in prefix_chunks(hasher(), tokens, partial)], hint)
        except Exception as e:  # advice: never the engine's failure
            log.warning("connector prefetch failed (%r): ignored", e)

    def local_tiers(self, keys: list[bytes], timeout: float) -> list[str | None]:
        """The local tier's name (tiers[0], where a prefetch lands) for each key it holds, else
        None; all None when tiers[0] is the server's or the lookup fails (a miss)."""
        from tierkv.cacheserver.client import RemoteTier

        local = self.store.tiers[0]
        if isinstance(local, RemoteTier) or not keys:
            return [None] * len(keys)
        try:
            held = self.loop.run(local.contains(keys, self.ns), timeout)
        except Exception as e:
            log.warning("connector local lookup failed (%r): miss", e)
            return [None] * len(keys)
        return [local.name if h else None for h in held]

    def _submit(self, keys: list[bytes], hint: KVHint | None, prefetch: bool) -> bool:
        if not keys:
            return False
        if len(self.pending) >= self.max_pending:
            self.stats.dropped += 1
            return False
        fut = self.loop.submit(self._run(keys, hint, prefetch))
        self.pending.add(fut)
        fut.add_done_callback(self.pending.discard)
        return True

    async def _run(self, keys: list[bytes], hint: KVHint | None, prefetch: bool) -> None:
        from tierkv.cacheserver.client import RemoteTier  # the server's client, when there is one

        try:
            if hint is not None:
                self.store.hint(keys, self.ns, hint)
            for t in self.store.tiers:
                if isinstance(t, RemoteTier) and (hint is not None or prefetch):
                    await t.hint(keys, hint, prefetch=prefetch)
            if prefetch:
                self.store.prefetch(keys, self.ns)
        except Exception as e:  # advice: a failure only costs speed
            log.warning("workflow hint failed (%r): ignored", e)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for the advice calls so far, and the prefetches they started (tests)."""
        concurrent.futures.wait(list(self.pending), timeout)
        self.loop.run(self.store.prefetcher.drain(), timeout)
