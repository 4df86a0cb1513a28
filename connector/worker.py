"""The worker side of a connector, once for every engine (tierkv's own and tierkv.vllm): a
step's saves (staged within the pending-save limit, gathered as the forward writes each layer,
put in the background) and its loads (streamed, verified and scattered layer by layer by
connector.loading, then booked). An engine supplies its `PagedKV` (transfer.py), the only
code that touches its blocks, and translates its own metadata into stage, bind and start_load.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from tierkv.connector.config import ConnectorConfig
from tierkv.connector.held import HeldLoads
from tierkv.connector.loading import StagingPool, run_load
from tierkv.connector.loop import LoopThread
from tierkv.connector.plan import Chunk, ConnectorStats, LoadPlan, RequestState, SavePlan
from tierkv.connector.saving import run_saves
from tierkv.connector.transfer import LoadJob, PagedKV
from tierkv.storage_backends.store import TieredStore

log = logging.getLogger("tierkv.connector")


@dataclass(slots=True, eq=False)
class WorkerCore:
    """One engine process's saves and loads over its store. The engine's thread calls every
    method; puts and loads run on `loop`, and a finished put releases its place under `lock`."""

    loop: LoopThread
    store: TieredStore
    config: ConnectorConfig
    stats: ConnectorStats = field(default_factory=ConnectorStats)
    kv: PagedKV | None = None  # the engine's cache, once registered
    job: LoadJob | None = None  # this step's load
    held: HeldLoads = field(default_factory=HeldLoads)  # loads kept past their step (held.py)
    saves: list[SavePlan] = field(default_factory=list)  # this step's, gathered layer by layer
    pending: int = 0  # staged chunks not yet put
    outstanding: Counter[str] = field(default_factory=Counter)  # per request: chunks not yet put
    futures: list[Future] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    saved: threading.Condition = field(init=False)  # notified whenever a put ends
    staging: StagingPool = field(init=False)  # load buffers kept between steps

    def __post_init__(self) -> None:
        self.saved = threading.Condition(self.lock)
        self.staging = StagingPool(int(self.config.staging_bytes))

    def register(self, kv: PagedKV) -> None:
        self.kv = kv

    def stage(
        self,
        request_id: str,
        block_ids: torch.Tensor,
        chunk: Chunk,
        tokens: np.ndarray,
        head: int = 0,
    ) -> SavePlan | None:
        """A save of chunk (of layout.num_kv_heads heads from the cache's `head` on) with its
        staging buffer, or None (counted as dropped) while max_pending_saves segments wait for
        their put or before the cache is registered."""
        with self.lock:
            if self.kv is None or self.pending >= self.config.max_pending_saves:
                self.stats.save_dropped += 1
                return None
            self.pending += 1
            self.outstanding[request_id] += 1
        kv, lay, n = self.kv, self.kv.layout, chunk.end - chunk.start
        staging = torch.empty(lay.num_layers, 2, n, lay.num_kv_heads, lay.head_dim, dtype=kv.dtype)
        scales = torch.empty(lay.num_layers, 2, lay.num_kv_heads) if kv.scaled else None
        return SavePlan(request_id, block_ids, chunk, tokens, staging, scales, head)

    def bind(self, saves: list[SavePlan]) -> None:
        """The step's staged saves: save_layer gathers each layer into them."""
        self.saves = saves

    def start_load(self, loads: list[LoadPlan]) -> None:
        """Stream the step's loads on the loop thread; returns at once."""
        self.job = None
        kv = self.kv
        if not loads or kv is None:
            return
        job = self.job = LoadJob(loads, [threading.Event() for _ in range(kv.layout.num_layers)])
        if kv.scatter_on_wait:
            job.staged = {}
        cfg = self.config
        self.loop.submit(
            run_load(
                job,
                self.store,
                cfg.namespace,
                kv.layout,
                partial(kv.scatter, job),
                self.stats,
                cfg.load_timeout_s,
                self.staging,
            )
        )

    def hold(self, request_id: str) -> bool:
        """This step's load goes on past the step for request_id (HeldLoads.hold)."""
        if not self.held.hold(request_id, self.job):
            return False
        self.job = None
        return True

    def wait_layer(self, layer: int) -> None:
        """Until layer's loads are in the blocks (the resumed held load's, while one is); past
        load_timeout_s the load is given up."""
        job, kv = self.held.active or self.job, self.kv
        if job is None or kv is None:
            return
        if not job.events[layer].wait(self.config.load_timeout_s):
            self.stats.load_timeouts += 1
            job.cancel()
            return
        if job.staged is not None:
            with job.lock:
                segs = job.staged.pop(layer, None)
                if segs is not None and not job.cancelled:
                    job.scattering = True
                    try:
                        kv.scatter(job, segs, layer)
                    except Exception as e:  # a recompute, never a failed request
                        self.stats.load_errors += 1
                        log.warning("connector scatter failed (%r); recomputing", e)
                        job.cancelled = True
                        for p in job.plans:
                            p.failed_from = p.start
                job.waited += 1

    def layer_work(self) -> bool:
        """Whether wait_layer or save_layer has anything to do in this step."""
        return self.job is not None or self.held.active is not None or bool(self.saves)

    def save_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        if self.kv is not None and self.saves:
            self.kv.gather(self.saves, layer, kv_layer)

    def submit(self) -> None:
        """The forward is done: the step's staged saves go to the background puts."""
        saves, self.saves, kv, cfg = self.saves, [], self.kv, self.config
        if saves and kv is not None:
            put = run_saves(
                saves,
                self.store,
                cfg.namespace,
                kv.layout.fingerprint,
                cfg.codec,
                self.stats,
                self._saved,
            )
            self.futures = [f for f in self.futures if not f.done()] + [self.loop.submit(put)]

    def _saved(self, plan: SavePlan) -> None:
        with self.lock:
            self.pending -= 1
            self.outstanding[plan.request_id] -= 1
            if self.outstanding[plan.request_id] <= 0:
                del self.outstanding[plan.request_id]
            self.saved.notify_all()

    def settled(self, request_ids: set[str], wait: set[str]) -> set[str]:
        """Of request_ids, those with no put in flight, after waiting (at most
        load_timeout_s) until none of wait has one."""
        with self.lock:
            self.saved.wait_for(
                lambda: not any(self.outstanding[r] for r in wait), self.config.load_timeout_s
            )
            return {r for r in request_ids if not self.outstanding[r]}

    def loaded_ranges(self, request_id: str) -> list[tuple[int, int]]:
        """Token ranges of request_id whose segments' cached KV this step's load put in its
        blocks, for every layer; valid after wait_layer(0). Only verified segments are named (a
        declared prefix loaded exactly is not: the scheduler counted it as computed)."""
        job = self.held.active or self.job
        if job is None:
            return []
        return [
            (p.start, p.end)
            for p in job.plans
            if p.request_id == request_id and p.rotate and p.failed_from is None
        ]

    def load_errors(self, states: dict[str, RequestState] | None = None) -> set[int]:
        """Blocks from the first token each of this step's loads, and each held load ended in it,
        did not deliver; books their metrics (per request too, for the requests in states)."""
        job, self.job, kv = self.job, None, self.kv
        jobs = ([] if job is None else [job]) + self.held.take_ended()
        if kv is None:
            return set()
        failed: set[int] = set()
        for j in jobs:
            if j.staged is not None and j.waited < kv.layout.num_layers:
                j.cancel()  # a layer the engine never waited for was never scattered
            failed |= book(j, states or {}, self.stats, kv.layout.block_size)
        return failed

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every save so far has reached every tier (tests, benchmarks, shutdown)."""
        for f in list(self.futures):
            f.result(timeout)
        self.futures = []
        self.loop.run(self.store.drain(), timeout)

    def close(self) -> None:
        """Cancel the held loads, flush, then close the store (the loop is the caller's)."""
        for rid in list(self.held.jobs):
            self.held.end(rid, cancel=True)
        self.flush()
        self.loop.run(self.store.close(), 30)


def book(
    job: LoadJob, states: dict[str, RequestState], stats: ConnectorStats, block_size: int
) -> set[int]:
    """After a step: count what each plan loaded (per tier) or left to recompute, and return the
    blocks the engine must recompute. A blend segment that failed before any scatter is not
    among them: the blend computed its tokens in full. A chunk loaded as several parts (KV
    heads, one after another in the plan) counts its tokens once."""
    failed: set[int] = set()
    for p in job.plans:
        st = states.get(p.request_id)
        stop = p.end if p.failed_from is None else p.failed_from
        if p.failed_from is not None:
            stats.recomputed_tokens += p.end - p.failed_from
            if st is not None:
                st.recomputed += p.end - p.failed_from
            if not (p.rotate and not job.scattering):
                first = p.failed_from // block_size
                failed.update(int(b) for b in p.block_ids[first : -(-p.end // block_size)].tolist())
        last = -1
        for c, tier in zip(p.chunks, p.tiers):
            if c.index == last:  # another part of the chunk just counted
                continue
            last = c.index
            n = max(0, min(stop, c.end) - max(p.start, c.start))
            stats.loaded_tokens += n
            if st is not None and n:
                st.loaded[tier] = st.loaded.get(tier, 0) + n
    return failed
