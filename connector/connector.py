"""TierKVConnector: the engine's connector hooks over a tiered store (local tiers + remote).

Scheduler side: prompt -> chained chunk keys -> one batched lookup -> tokens to load.
Worker side (connector.worker, shared with tierkv.vllm, over this engine's EngineKV): loads
are fetched and verified on the connector's own loop thread while the step starts, then
scattered into the request's blocks layer by layer (the forward waits only for the layer it
is about to read); saves gather each layer's new full chunks out of the paged cache into
staging buffers during the forward and put them in the background.

The gather for a save finishes inside save_kv_layer, so a finished request's blocks are
never needed after its step: request_finished always lets the engine free them at once.
"""

from __future__ import annotations

from typing import Any

import torch

from tierkv.connector.config import ConnectorConfig
from tierkv.connector.loop import LoopThread
from tierkv.connector.plan import ConnectorStats, LoadPlan, RequestState, StepMeta
from tierkv.connector.requests import located, model_fingerprint, record_lookup, request_state
from tierkv.connector.segments import SegmentStore
from tierkv.connector.steps import chunks_to_save, load_plans
from tierkv.connector.transfer import engine_kv
from tierkv.connector.worker import WorkerCore
from tierkv.connector.workflow import Workflows
from tierkv.engine.blend_step import blending
from tierkv.engine.kv_connector import ConnectorRequest, ConnectorStep, KVConnector
from tierkv.kernels import FP8, RotaryEmbedding
from tierkv.storage_backends.hints import KVHint
from tierkv.storage_backends.keys import ChunkHasher
from tierkv.storage_backends.store import TieredStore
from tierkv.storage_backends.tier import Tier


class TierKVConnector(KVConnector):
    supports_segments = True

    def __init__(
        self, config: ConnectorConfig | None = None, tiers: list[Tier] | None = None
    ) -> None:
        """tiers, when given, replaces the tiers the config would build (fastest first)."""
        self.config = config or ConnectorConfig()
        self.stats = ConnectorStats()
        self.loop = LoopThread()
        self.store = self.loop.run(self._build_store(tiers))
        self.worker = WorkerCore(self.loop, self.store, self.config, self.stats)
        self.ns = self.config.namespace
        self.workflows = Workflows(self.loop, self.store, self.ns)
        self.states: dict[str, RequestState] = {}
        self.finished: dict[str, dict[str, Any]] = {}  # metrics of finished requests, read once
        self.pending_loads: list[LoadPlan] = []
        # the segments this connector stores, bounded apart from the prefix KV; scheduler side
        # (the engine's thread) only
        self.segments = SegmentStore(self.loop, self.store, self.config, self.stats)
        self.steps = 0  # forwards seen
        self.caches: list[torch.Tensor] = []
        self.kv_scales: torch.Tensor | None = None
        self._hasher: ChunkHasher | None = None
        self.model_id: str | None = None
        self.rope: RotaryEmbedding | None = None
        if self.config.metrics_port:
            from tierkv.connector.metrics import serve_metrics

            serve_metrics(self, self.config.metrics_port)

    async def _build_store(self, tiers: list[Tier] | None) -> TieredStore:
        return TieredStore(tiers) if tiers else self.config.build_store()

    def bind_model(
        self,
        model: torch.nn.Module,
        model_config: Any,
        dtype: torch.dtype,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Called by the engine before register_kv_caches: fixes the salt of every key."""
        self.model_id = model_fingerprint(model, model_config, dtype)
        self.kv_scales = kv_scales
        self.rope = RotaryEmbedding(
            model_config.head_dim,
            model_config.rope_theta,
            model_config.rope_scaling,
            model_config.max_position_embeddings,
        )

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        if self.model_id is None:
            raise RuntimeError("bind_model must be called before register_kv_caches")
        self.caches = kv_caches
        salt, kv = engine_kv(
            kv_caches, self.model_id, self.kv_scales, self.rope, self.config, self.ns
        )
        self._hasher = ChunkHasher(salt)
        self.worker.register(kv)

    @property
    def hasher(self) -> ChunkHasher:
        """The chunk keys under this model's salt (made by register_kv_caches)."""
        if self._hasher is None:
            raise RuntimeError("register_kv_caches must be called before the connector is used")
        return self._hasher

    # -- scheduler side --------------------------------------------------------------------
    def _state(self, request: ConnectorRequest) -> RequestState:
        st = self.states.get(request.request_id)
        if st is None:
            st = self.states[request.request_id] = request_state(
                request, self.hasher.salted(request.cache_salt), self.config.save_partial_chunks
            )
            self.workflows.advise_request(request, st.chunks)
        return st

    def prefetch(
        self, token_ids: list[int], hint: KVHint | None = None, cache_salt: str | None = None
    ) -> None:
        """Its chunk keys, tagged with hint, moved up the tiers in the background; never fails."""
        partial = self.config.save_partial_chunks
        self.workflows.prefetch_prompt(
            lambda: self.hasher.salted(cache_salt), token_ids, hint, partial
        )

    def get_num_prefetched_tokens(self, request: ConnectorRequest, num_computed: int) -> int:
        """get_num_new_matched_tokens over the local tier alone (where a prefetch lands)."""
        st = self._state(request)
        if not st.chunks or blending(request) or (self.caches[0].dtype == FP8 and not self.steps):
            return 0
        where = self.workflows.local_tiers([c.key for c in st.chunks], self.config.lookup_timeout_s)
        return record_lookup(st, where, num_computed, False)

    def lookup_segments(
        self,
        segments: list[list[int]],
        prefix: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[bool]:
        """Whether the store holds each segment's KV (one batched lookup)."""
        return self.segments.lookup(self.hasher.salted(cache_salt), segments, prefix)

    def sight_segments(
        self,
        segments: list[list[int]],
        prefix: list[int] | None = None,
        cache_salt: str | None = None,
        times: list[int] | None = None,
    ) -> list[bool]:
        """A sighting of each segment in the bounded segment store (connector/segments.py)."""
        return self.segments.sight(self.hasher.salted(cache_salt), segments, prefix, times)

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int:
        st, blend = self._state(request), blending(request)
        fp8_cold = self.caches[0].dtype == FP8 and not self.steps  # scaled by its first forward
        if not st.chunks or not (st.prefix_chunks or blend) or fp8_cold:
            return 0  # nothing that could load
        self.stats.lookups += 1
        keys, timeout = [c.key for c in st.chunks], self.config.lookup_timeout_s
        where = located(self.loop, self.store, keys, self.ns, timeout)
        names = [self.store.tiers[w].name if w is not None else None for w in where]
        new = record_lookup(st, names, num_computed_tokens, blend)
        self.stats.lookup_hit_tokens += new
        for c, hit in zip(st.chunks, st.hits if blend else []):
            if hit:  # a segment hit: the bounded store's most recently used
                self.segments.book.touch(c.key)
        return new

    def get_num_prefix_tokens(self, request: ConnectorRequest) -> int:
        st = self.states.get(request.request_id)
        return 0 if st is None else st.exact[1] - st.exact[0]

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        self.pending_loads += load_plans(
            request, self._state(request), block_ids, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: ConnectorStep) -> StepMeta:
        meta = StepMeta(self.pending_loads, [])
        self.pending_loads = []
        if not self.config.save or not self.caches:
            return meta
        for seq, n in zip(scheduler_output.seqs, scheduler_output.num_new_tokens):
            start = seq.num_computed_tokens
            if start >= seq.num_prompt_tokens or (seq.blend is not None and not seq.blend.ingest):
                continue  # decoding, or a prompt in parts (its KV may be blended): never stored
            st = self._state(seq)
            block_ids = None
            for c in chunks_to_save(st, start, start + n, self.stats):
                if seq.blend is not None and not self.segments.book_chunk(st, c, self.worker.kv):
                    continue
                if block_ids is None:
                    block_ids = torch.tensor(seq.block_table, dtype=torch.int32)
                plan = self.worker.stage(seq.request_id, block_ids, c, st.tokens[c.start : c.end])
                if plan is not None:
                    meta.saves.append(plan)
        return meta

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        st = self.states.pop(request.request_id, None)
        if st is not None:
            self.finished[request.request_id] = {
                "loaded_tokens": dict(st.loaded),
                "recomputed_tokens": st.recomputed,
            }
        return False

    def request_metrics(self, request_id: str) -> dict[str, Any]:
        return self.finished.pop(request_id, {})

    # -- worker side -----------------------------------------------------------------------
    def start_load_kv(self, meta: object) -> None:
        step = meta if isinstance(meta, StepMeta) else StepMeta()
        self.worker.bind(step.saves)
        self.worker.start_load(step.loads)

    def wait_for_layer_load(self, layer: int) -> None:
        self.worker.wait_layer(layer)

    def hold_load(self, request_id: str) -> bool:
        return self.worker.hold(request_id)

    def resume_held(self, request_id: str | None) -> None:
        self.worker.held.resume(request_id)

    def end_held(self, request_id: str, cancel: bool = False) -> None:
        self.worker.held.end(request_id, cancel)

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        self.worker.save_layer(layer, kv_layer)

    def layer_work(self) -> bool:
        return self.worker.layer_work()

    def wait_for_save(self) -> None:
        self.steps += 1
        self.worker.submit()

    def get_finished(self) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_loaded_ranges(self, request_id: str) -> list[tuple[int, int]]:
        return self.worker.loaded_ranges(request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks from the first token each failed load did not deliver; also books the metrics."""
        return self.worker.load_errors(self.states)

    # -- lifecycle ---------------------------------------------------------------------------
    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every save so far has reached every tier (tests, benchmarks, shutdown)."""
        self.worker.flush(timeout)

    def close(self) -> None:
        try:
            self.worker.close()
        finally:
            self.loop.close()
