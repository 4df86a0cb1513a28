"""TierKVConnector: vLLM v1's KVConnectorBase_V1 over tierkv's keys, segments and tiers.

Safety contract (what vLLM may rely on):
- A load never fails a request and never injects unverified KV: a miss, a tier fault, a
  timeout or a segment whose checksum, key, parent, tokens or fingerprint do not match leaves
  the blocks from the first undelivered token to vLLM's load-failure path
  (`get_block_ids_with_load_errors`, with `kv_load_failure_policy="recompute"`, which this
  connector sets), and vLLM recomputes them.
- One KV cache group: loads are in-step and layer-wise (`wait_for_layer_load(layer)` returns
  once that layer is in the blocks or given up). Several (tierkv.vllm.groups): loads are
  asynchronous, and `get_transfer_results` names each request received or failed.
- `save_kv_layer` copies the step's new prompt chunks out of the blocks before it returns; the
  puts run in the background. `request_finished_all_groups` is True for a request with saves;
  `get_finished` names it once every put of it has ended: its blocks are held until then.
- Keys are salted with vLLM as the engine, the model's KV-shaping config, its dtype, a digest
  of its weight files, the chunk size and the namespace: KV of another model, dtype, engine or
  tenant never loads.
- Under tensor parallelism each rank moves only its KV heads' parts (tierkv.vllm.ranks), the
  scheduler counts a chunk only when every part is stored, and every rank names each request
  with saves in `get_finished` once; a rank's failed load is recomputed on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from tierkv.connector.event_blocks import EventBlocks
from tierkv.connector.loop import LoopThread
from tierkv.storage_backends.keys import ChunkHasher
from tierkv.vllm.config import connector_config, salt, shared
from tierkv.vllm.events import (
    Outbox,
    SchedulerEvents,
    TierKVEvents,
    hit_sources,
)
from tierkv.vllm.groups import NULL, Groups
from tierkv.vllm.kvdtype import backend_writer
from tierkv.vllm.prom import TierKVProm
from tierkv.vllm.scheduler import SchedulerSide, TierKVMetadata
from tierkv.vllm.start import start_scheduler, start_worker
from tierkv.vllm.stats import Reporter, TierKVStats
from tierkv.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

log = logging.getLogger("tierkv.vllm")


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):
    """tierkv for vLLM; kv_connector_extra_config holds ConnectorConfig's knobs. SupportsHMA:
    vLLM keeps a hybrid model's KV cache groups (a sliding window keeps only its blocks)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = shared(connector_config(self._kv_transfer_config.kv_connector_extra_config))
        self.groups = Groups.of(kv_cache_config)
        self.config, self.salt = cfg, salt(vllm_config, cfg, self.groups.windowed)
        self.hasher = ChunkHasher(self.salt)
        self.loop = LoopThread("tierkv-vllm")
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.reporter = Reporter()
        kv_events = getattr(vllm_config, "kv_events_config", None)
        publish = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        self.events = SchedulerEvents(publish)  # the scheduler's
        # chunks told as blocks of vLLM's one block size (its groups share it, Groups.of)
        blocks = EventBlocks(self.groups.block_size, cfg.chunk_size) if publish else None
        self.outbox = Outbox()  # the worker's: its tiers' changes until the step's output
        self.watcher: Any = None
        fp = self.salt.fingerprint()
        if role == KVConnectorRole.SCHEDULER:
            ktc = self._kv_transfer_config
            self.sched, self.watcher = start_scheduler(
                vllm_config, ktc, self.loop, cfg, self.hasher, fp, self.groups, self.events, blocks
            )
        else:
            self.worker = start_worker(vllm_config, self.loop, cfg, fp, self.outbox, blocks)

    # -- worker side -----------------------------------------------------------------------
    def _w(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("a worker-side hook called on the scheduler's connector")
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Once at start: the layout is found from the tensors' shapes; the CPU backend's K
        packing is measured with its own writer on a scratch block; an fp8 cache's per-layer
        scales are read from its attention layers."""
        stored, write = backend_writer(self._vllm_config, list(kv_caches))
        head_size = self._vllm_config.model_config.get_head_size()
        self._w().register(kv_caches, head_size, write, self.groups, stored)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, TierKVMetadata):
            self._w().bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads on the connector's thread; returns at once."""
        meta = self._get_connector_metadata()
        if isinstance(meta, TierKVMetadata):
            self._w().start_load(meta.loads, meta.tables)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this layer's loads are in the blocks (or were given up)."""
        self._w().wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Copy this layer's tokens of the step's new prompt chunks into their staging."""
        self._w().save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Hand the step's staged chunks to the background puts; a prefill for a remote
        decode that ends this step waits until its chunks are on the shared tier."""
        self._w().core.submit()
        meta = self._get_connector_metadata()
        if isinstance(meta, TierKVMetadata) and meta.handoffs:
            self._w().hand_off(meta.handoffs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        done = self._w().finished(finished_req_ids)
        return (done or None), None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Saves done (get_finished); with several KV cache groups, this step's loads too."""
        done, _ = self.get_finished(finished_req_ids)
        received, failed = self._w().loaded()
        return KVConnectorTransferResults(set(done or ()), received, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """One KV cache group: blocks from the first token each of this step's loads did not
        deliver (several: none, get_transfer_results names the requests)."""
        return self._w().load_errors()

    def get_kv_connector_kv_cache_events(self) -> TierKVEvents | None:
        """This worker's tiers' changes since the last step (to the scheduler's take_events)."""
        items = self.outbox.take()
        return TierKVEvents(items) if items else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters changed since the last call: loads and saves from the worker, lookups and
        hits by tier from the scheduler (vLLM asks both sides and adds them up)."""
        if self.worker is not None:
            extra = {"events_dropped": self.outbox.dropped}
            return self.reporter.delta(self.worker.core.stats, extra)
        if self.sched is None:
            return None
        extra = {f"hit_tokens.{t}": n for t, n in self.sched.hits.items()}
        extra["events_dropped"] = self.events.box.dropped
        extra.update(self.sched.roles.counters())
        return self.reporter.delta(self.sched.stats, extra)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads and saves run Python between layers: no whole-model CUDA graph."""
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return TierKVStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TierKVProm:
        """tierkv's counters in vLLM's /metrics (tierkv.vllm.prom)."""
        return TierKVProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Put every staged save, drain the write-through to the shared tier, close."""
        try:
            if self.watcher is not None:
                self.watcher.cancel()
            if self.worker is not None:
                self.worker.core.close()
            elif self.sched is not None:
                self.loop.run(self.sched.store.close(), 30)
        except Exception as e:
            log.warning("tierkv.vllm shutdown: %r", e)
        finally:
            self.loop.close()

    # -- scheduler side --------------------------------------------------------------------
    def _s(self) -> SchedulerSide:
        if self.sched is None:
            raise RuntimeError("a scheduler-side hook called on a worker's connector")
        return self.sched

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Prompt tokens past the local hit that the shared tier holds: loaded in-step with one
        KV cache group, asynchronously with several. None while a remote prefill's chunks are
        awaited (tierkv.vllm.pd)."""
        n = self._s().matched(request, num_computed_tokens)
        return n, bool(n) and self.groups.by_request

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._s().after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """The workers take a null block in a sliding window's table for vLLM's, block 0."""
        if gpu_block_pool.null_block.block_id != NULL:
            raise ValueError(f"tierkv.vllm expects vLLM's null block to be block {NULL}")

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._s().build_meta(scheduler_output)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """vLLM's admitted external tokens by tier (counted in vllm:tierkv_hit_tokens too)."""
        return hit_sources(self._s().sources(request, num_external_tokens, self.events.tier_of))

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' tier changes of the step (vLLM combines the ranks' into one)."""
        ev = connector_output.kv_cache_events
        if isinstance(ev, TierKVEvents):
            self.events.from_workers(ev)
        self._s().load_failed(set(connector_output.failed_recving))

    def take_events(self) -> Iterable[KVCacheEvent]:
        """tierkv's KV events since the last step, for vLLM's publisher."""
        return self.events.take()

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """True while the request's saves are in flight: vLLM frees its blocks (of every KV
        cache group) once get_finished names it. A prefill for a remote decode returns the
        kv_transfer_params the decode instance needs (tierkv.vllm.pd)."""
        return self._s().finished(request)
