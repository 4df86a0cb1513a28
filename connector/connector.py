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

import logging
from typing import Any

import numpy as np
import torch

from tierkv.connector.config import ConnectorConfig
from tierkv.connector.loop import LoopThread
from tierkv.connector.plan import ConnectorStats, LoadPlan, RequestState, StepMeta
from tierkv.connector.requests import (
    model_fingerprint,
    prefix_chunks,
    record_lookup,
    request_state,
)
from tierkv.connector.transfer import EngineKV, Layout
from tierkv.connector.worker import WorkerCore
from tierkv.connector.workflow import Workflows
from tierkv.engine.blend_step import blending
from tierkv.engine.kv_connector import ConnectorRequest, ConnectorStep, KVConnector
from tierkv.kernels import FP8, RotaryEmbedding
from tierkv.storage_backends.hints import KVHint
from tierkv.storage_backends.keys import ChunkHasher, Salt
from tierkv.storage_backends.segment import VERSION, dtype_name
from tierkv.storage_backends.store import TieredStore
from tierkv.storage_backends.tier import Tier

log = logging.getLogger("tierkv.connector")


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

    # -- binding to the engine -------------------------------------------------------------
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
        _, _, block_size, heads, dim = kv_caches[0].shape
        if self.config.chunk_size % block_size:
            raise ValueError(
                f"chunk_size {self.config.chunk_size} is not a multiple of block size {block_size}"
            )
        cache_dtype = kv_caches[0].dtype
        if cache_dtype == FP8 and self.kv_scales is None:
            raise ValueError("an fp8 engine cache needs its kv_scales in bind_model")
        store_dtype = FP8 if self.config.kv_dtype == "fp8" else cache_dtype
        name = dtype_name(store_dtype)
        if name is None:
            raise ValueError(f"no segment can hold a {store_dtype} cache")
        quant = "fp8_e4m3" if store_dtype == FP8 else "none"
        salt = Salt(
            model_fingerprint=self.model_id,
            kv_format=f"tkvs{VERSION}/layer-major/{name}/{quant}",
            chunk_size=self.config.chunk_size,
            namespace=self.ns,
        )
        self._hasher = ChunkHasher(salt)
        layout = Layout(len(kv_caches), heads, dim, name, salt.fingerprint(), block_size, self.rope)
        self.worker.register(
            EngineKV(layout, store_dtype, store_dtype == FP8, kv_caches, self.kv_scales)
        )

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
            hint = getattr(request, "kv_hint", None)  # a workflow's advice (storage_backends.hints)
            if isinstance(hint, KVHint) and st.chunks:
                self.workflows.advise([c.key for c in st.chunks], hint)
        return st

    def prefetch(
        self, token_ids: list[int], hint: KVHint | None = None, cache_salt: str | None = None
    ) -> None:
        """A prompt that will run soon (the next workflow step's agent): its chunk keys are
        tagged with hint, the server moves them up to its cpu tier and those it holds are
        loaded into the local tiers, all in the background; returns at once, never fails."""
        try:
            tokens = np.asarray(token_ids, dtype=np.int32)
            hasher = self.hasher.salted(cache_salt)
            keys = [c.key for c in prefix_chunks(hasher, tokens, self.config.save_partial_chunks)]
            self.workflows.prefetch(keys, hint)
        except Exception as e:  # advice: never the engine's failure
            log.warning("connector prefetch failed (%r): ignored", e)

    def lookup_segments(
        self,
        segments: list[list[int]],
        prefix: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[bool]:
        """Whether the store holds each segment's KV, computed standalone or, given prefix, right
        after that declared shared prefix (one batched lookup), under cache_salt's keys."""
        hasher = self.hasher.salted(cache_salt)
        after = hasher.prefix_key(np.asarray(prefix, dtype=np.int32)) if prefix else None
        keys = [hasher.segment_key(np.asarray(t, dtype=np.int32), after) for t in segments]
        try:
            return self.loop.run(self.store.contains(keys, self.ns), self.config.lookup_timeout_s)
        except Exception as e:
            log.warning("connector segment lookup failed (%r): miss", e)
            return [False] * len(keys)

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int:
        st, blend = self._state(request), blending(request)
        if (
            not st.chunks
            or not (st.prefix_chunks or blend)
            or (self.caches[0].dtype == FP8 and not self.steps)
        ):
            return (
                0  # nothing that could load; an fp8 cache takes its scales from its first forward
            )
        self.stats.lookups += 1
        try:
            where = self.loop.run(
                self.store.locate([c.key for c in st.chunks], self.ns), self.config.lookup_timeout_s
            )
        except Exception as e:  # a slow or failing store is a miss
            log.warning("connector lookup failed (%r): miss", e)
            where = [None] * len(st.chunks)
        new = record_lookup(
            st,
            [self.store.tiers[w].name if w is not None else None for w in where],
            num_computed_tokens,
            blend,
        )
        self.stats.lookup_hit_tokens += new
        return new

    def get_num_prefix_tokens(self, request: ConnectorRequest) -> int:
        st = self.states.get(request.request_id)
        return 0 if st is None else st.exact[1] - st.exact[0]

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        st = self._state(request)
        blocks = torch.tensor(block_ids, dtype=torch.int32)
        blend = blending(request)
        start, end = (
            st.exact
            if blend
            else (request.num_computed_tokens, request.num_computed_tokens + num_external_tokens)
        )
        if end > start:  # a prefix run: loaded exactly, where it was computed
            idx = [
                i for i, c in enumerate(st.chunks[: st.present]) if c.end > start and c.start < end
            ]
            self.pending_loads.append(
                LoadPlan(
                    request.request_id,
                    blocks,
                    start,
                    end,
                    [st.chunks[i] for i in idx],
                    [st.tiers[i] for i in idx],
                    st.tokens,
                )
            )
        for c, hit, tier in zip(st.chunks, st.hits if blend else [], st.tiers):
            if hit:  # a segment: re-rotated from where it was computed to where it is now
                self.pending_loads.append(
                    LoadPlan(
                        request.request_id,
                        blocks,
                        c.start,
                        c.end,
                        [c],
                        [tier],
                        st.tokens,
                        rotate=True,
                    )
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
            stop, block_ids = start + n, None
            while st.saved_upto < len(st.chunks) and st.chunks[st.saved_upto].end <= stop:
                c = st.chunks[st.saved_upto]
                st.saved_upto += 1
                if c.index < st.present or c.end <= start:
                    self.stats.save_skipped += 1  # in the store, or computed before we could see it
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

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        self.worker.save_layer(layer, kv_layer)

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
