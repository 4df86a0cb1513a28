"""Worker side: a step's loads (fetched and verified by tierkv.connector.transfer, scattered
into vLLM's paged layout layer by layer) and saves (gathered out of it during the forward,
put in the background).

Safety contract: nothing reaches vLLM's cache before its segment passed the tier's checksum
and the header check (key, parent, fingerprint, tokens, shape, dtype); a load that fails,
times out or is cancelled scatters nothing more and names the blocks vLLM must recompute.
A save copies its tokens into a staging buffer inside save_kv_layer, while vLLM still holds
the blocks; the request's blocks are released only when its last put has finished.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future

import torch

from tierkv.connector.loading import StagingPool, run_load
from tierkv.connector.loop import LoopThread
from tierkv.connector.plan import ConnectorStats, SavePlan
from tierkv.connector.transfer import Layout, LoadJob, book, run_saves
from tierkv.storage_backends.segment import KVSegment, dtype_name
from tierkv.storage_backends.store import TieredStore
from tierkv.vllm.layout import PagedLayout, detect_layout, gather, probe_tiles, scatter
from tierkv.vllm.scheduler import TierKVMetadata

log = logging.getLogger("tierkv.vllm")
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def scatter_into(
    job: LoadJob, paged: PagedLayout, caches: list[torch.Tensor]
) -> Callable[[list[list[KVSegment]], int], None]:
    """The run_load scatter for vLLM's paged layout: one layer of every plan."""

    def scatter_layer(segs: list[list[KVSegment]], layer: int) -> None:
        for plan, good in zip(job.plans, segs):
            _scatter_plan(
                plan.start,
                plan.end,
                plan.failed_from,
                plan.chunks,
                good,
                layer,
                paged,
                caches[layer],
                plan.block_ids,
            )

    return scatter_layer


def _scatter_plan(
    start: int,
    end: int,
    failed_from: int | None,
    chunks: list,
    good: list[KVSegment],
    layer: int,
    paged: PagedLayout,
    cache: torch.Tensor,
    block_ids: torch.Tensor,
) -> None:
    stop = end if failed_from is None else failed_from
    for seg, c in zip(good, chunks):
        lo, hi = max(start, c.start), min(stop, c.end)
        if hi > lo:
            scatter(paged, cache, seg.layer(layer)[:, lo - c.start : hi - c.start], block_ids, lo)


class WorkerSide:
    def __init__(
        self,
        loop: LoopThread,
        store: TieredStore,
        namespace: str,
        fingerprint: bytes,
        codec: str,
        max_pending_saves: int,
        load_timeout_s: float,
        staging_bytes: int,
    ) -> None:
        self.loop, self.store, self.ns, self.fingerprint = loop, store, namespace, fingerprint
        self.staging = StagingPool(staging_bytes)
        self.codec, self.max_pending, self.load_timeout_s = codec, max_pending_saves, load_timeout_s
        self.stats = ConnectorStats()
        self.index: dict[str, int] = {}
        self.caches: list[torch.Tensor] = []
        self.paged: PagedLayout | None = None
        self.layout: Layout | None = None
        self.job: LoadJob | None = None
        self.staged: list[SavePlan] = []
        self.lock = threading.Lock()
        self.saved = threading.Condition(self.lock)  # notified whenever a put ends
        self.pending = 0  # staged chunks not yet put
        self.outstanding: Counter[str] = Counter()  # per request: saves not yet put
        self.had_saves: set[str] = set()  # requests the scheduler holds blocks for
        self.closing: set[str] = set()  # finished requests waiting for their saves
        self.futures: list[Future] = []

    def register(
        self, kv_caches: dict[str, torch.Tensor], heads: int, head_dim: int, write: Writer | None
    ) -> None:
        self.index = {name: i for i, name in enumerate(kv_caches)}
        self.caches = list(kv_caches.values())
        first = self.caches[0]
        paged = detect_layout(first, heads, head_dim)
        if any(t.shape != first.shape or t.dtype != first.dtype for t in self.caches):
            raise ValueError("tierkv.vllm needs every layer's KV tensor alike (one KV group)")
        if paged.kind == "cpu_heads_first":
            if write is None:
                raise ValueError("the CPU layout needs the attention backend's KV writer")
            probe_tiles(paged, first.dtype, write)
        name = dtype_name(first.dtype)
        if name is None:
            raise ValueError(f"no segment can hold a {first.dtype} cache")
        self.paged = paged
        self.layout = Layout(
            len(self.caches), heads, head_dim, name, self.fingerprint, paged.block_size
        )
        log.info(
            "tierkv.vllm: %d layers, layout %s %s", len(self.caches), paged.kind, list(first.shape)
        )

    def bind(self, meta: TierKVMetadata) -> None:
        """A new step: stage its saves (the buffers the forward's layers are copied into)."""
        self.staged = []
        lay = self.layout
        for s in meta.saves:
            with self.lock:
                self.had_saves.add(s.request_id)
                if lay is None or self.pending >= self.max_pending:
                    self.stats.save_dropped += 1
                    continue
                self.pending += 1
                self.outstanding[s.request_id] += 1
            staging = torch.empty(
                lay.num_layers,
                2,
                s.chunk.end - s.chunk.start,
                lay.num_kv_heads,
                lay.head_dim,
                dtype=self.caches[0].dtype,
            )
            self.staged.append(
                SavePlan(s.request_id, s.block_ids, s.chunk, s.tokens, staging, None)
            )

    def start_load(self, meta: TierKVMetadata) -> None:
        self.job = None
        if not meta.loads or self.layout is None or self.paged is None:
            return
        self.job = LoadJob(meta.loads, [threading.Event() for _ in self.caches])
        self.loop.submit(
            run_load(
                self.job,
                self.store,
                self.ns,
                self.layout,
                scatter_into(self.job, self.paged, self.caches),
                self.stats,
                self.load_timeout_s,
                self.staging,
            )
        )

    def wait_layer(self, name: str) -> None:
        job = self.job
        if job is not None and not job.events[self.index[name]].wait(self.load_timeout_s):
            self.stats.load_timeouts += 1
            job.cancel()

    def save_layer(self, name: str, kv_layer: torch.Tensor) -> None:
        if self.paged is None:
            return
        layer = self.index[name]
        for p in self.staged:
            c = p.chunk
            p.staging[layer].copy_(gather(self.paged, kv_layer, p.block_ids, c.start, c.end))

    def submit_saves(self) -> None:
        staged, self.staged = self.staged, []
        if staged and self.layout is not None:
            fut = self.loop.submit(
                run_saves(
                    staged,
                    self.store,
                    self.ns,
                    self.fingerprint,
                    self.codec,
                    self.stats,
                    self._saved,
                )
            )
            self.futures = [f for f in self.futures if not f.done()] + [fut]

    def _saved(self, plan: SavePlan) -> None:
        with self.lock:
            self.pending -= 1
            self.outstanding[plan.request_id] -= 1
            self.saved.notify_all()

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks vLLM may free now: finished, every save of theirs put. vLLM
        names a finished request once, in the step after it ended, and may idle after that
        step: so this waits (at most load_timeout_s) for the puts of the requests it names
        now, and their blocks go back in this step unless a put is slower than that."""
        with self.lock:
            new = finished_req_ids & self.had_saves
            self.had_saves -= new
            self.closing |= new
            self.saved.wait_for(
                lambda: all(self.outstanding[r] <= 0 for r in new), self.load_timeout_s
            )
            done = {rid for rid in self.closing if self.outstanding[rid] <= 0}
            self.closing -= done
            for rid in done:
                self.outstanding.pop(rid, None)
        return done

    def load_errors(self) -> set[int]:
        job, self.job = self.job, None
        if job is None or self.paged is None:
            return set()
        return book(job, {}, self.stats, self.paged.block_size)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every save so far has reached every tier (shutdown, tests)."""
        for f in list(self.futures):
            f.result(timeout)
        self.futures = []
        self.loop.run(self.store.drain(), timeout)
