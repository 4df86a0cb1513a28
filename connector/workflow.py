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
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierkv.connector.loop import LoopThread
from tierkv.storage_backends.hints import KVHint
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

    def prefetch(self, keys: Sequence[bytes], hint: KVHint | None) -> None:
        """keys are needed soon: tag them (with hint), ask the server to move them up to its
        fastest tier, and load those it holds into the local tiers, all in the background."""
        if self._submit(list(keys), hint, True):
            self.stats.prefetches += 1

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
