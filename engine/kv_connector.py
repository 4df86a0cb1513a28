"""The connector hooks (the shape of vLLM's KVConnectorBase_V1); the default connector,
NoOpConnector, is in engine/noop_connector.py.

One connector object serves both sides in this single-process engine.

Scheduler side, per step, in this order:
  1. get_num_new_matched_tokens(seq, num_computed_tokens) when a sequence is admitted:
     how many tokens beyond the local prefix-cache hit the connector can load. The engine
     clamps the answer so the last prompt token is always computed.
  2. update_state_after_alloc(seq, block_ids, num_external_tokens) once its blocks exist:
     the connector records where to load (block i holds tokens [i*bs, (i+1)*bs)).
  3. build_connector_meta(scheduler_output) after every step's schedule: an opaque object
     handed to start_load_kv for that same step.
  4. request_finished(seq, block_ids) when a sequence ends: True means the connector keeps
     the blocks (for an async save) until get_finished() names the request; the engine
     frees them then. False: the engine frees them at once.
Worker side, per step: start_load_kv(meta) before the forward; for each layer i,
wait_for_layer_load(i) before layer i's attention reads the cache, save_kv_layer(i, kv, md)
after layer i wrote its new KV; wait_for_save() after the forward; then get_finished() and
get_block_ids_with_load_errors() (those blocks' tokens are recomputed). A layered prefill may
hold its admission step's load past the step (hold_load, resume_held, end_held).

What a connector may read of a request is ConnectorRequest, of a step's schedule
ConnectorStep; it never changes either.

Validity: block ids are valid only while the sequence holds them (until request_finished
returns False, or until get_finished reports it). kv_layer and attn_metadata passed to
save_kv_layer are valid only during that call. The engine never calls hooks concurrently.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from tierkv.engine.blend_step import BlendState
    from tierkv.storage_backends.hints import KVHint


class ConnectorRequest(Protocol):
    """A request as its connector sees it (the engine passes its sequences)."""

    @property
    def request_id(self) -> str: ...
    @property
    def token_ids(self) -> list[int]: ...  # the prompt, then the output so far
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...  # tokens whose KV is in its blocks
    @property
    def block_table(self) -> list[int]: ...
    @property
    def cache_salt(self) -> str | None: ...  # KV is shared only under the same salt
    @property
    def blend(self) -> BlendState | None: ...  # a prompt in parts (segments, ingest)
    @property
    def kv_hint(self) -> KVHint | None: ...  # the workflow step it runs for, or None


class ConnectorStep(Protocol):
    """A step's schedule as the connector sees it: each sequence and its new tokens."""

    @property
    def seqs(self) -> Sequence[ConnectorRequest]: ...
    @property
    def num_new_tokens(self) -> list[int]: ...


class KVConnector(ABC):
    # Any-position reuse (CacheBlend): a connector that stores segments sets this and
    # implements lookup_segments, get_num_prefix_tokens and get_loaded_ranges.
    supports_segments: bool = False

    # scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int:
        """Tokens of request.token_ids after num_computed_tokens that can be loaded (0 = none)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks now allocated for request; the first num_external_tokens after its local hit
        are to load."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: ConnectorStep) -> object:
        """Per-step metadata for the worker side (what to load and save this step)."""

    @abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        """True: keep block_ids until get_finished() reports request.request_id saved."""

    # worker side
    def bind_model(
        self,
        model: torch.nn.Module,
        model_config: Any,
        dtype: torch.dtype,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Once at start, before register_kv_caches: the model (its weights identify its KV),
        its config and dtype, and the fp8 cache scales [L, 2, Hkv] (None without fp8).
        An optional hook: the default does nothing."""
        return None

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Once at start: per layer [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    @abstractmethod
    def start_load_kv(self, meta: object) -> None:
        """Begin loading this step's external KV into its blocks (may return before done)."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Block until layer's loads are in the cache."""

    @abstractmethod
    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Layer's new KV of this step is written; start saving what should be saved."""

    def layer_work(self) -> bool:
        """Whether the step begun by the last start_load_kv needs the two per-layer hooks.
        Safety: False only where both would do nothing this step; the runner then skips them
        and may run the step's layers in one call. Optional: the default says True."""
        return True

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves no longer read the cache (the blocks may be reused)."""

    @abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(request ids whose async save is done, request ids whose async load is done)."""

    @abstractmethod
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed this step; the engine recomputes from the first of them."""

    # any-position reuse (CacheBlend), with supports_segments
    def lookup_segments(
        self,
        segments: list[list[int]],
        prefix: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[bool]:
        """Whether the store holds each segment's KV, computed standalone or right after the
        declared shared prefix, under cache_salt's keys."""
        raise NotImplementedError(f"{type(self).__name__} does not store segments")

    def sight_segments(
        self,
        segments: list[list[int]],
        prefix: list[int] | None = None,
        cache_salt: str | None = None,
        times: list[int] | None = None,
    ) -> list[bool]:
        """Count a sighting of each segment (times[i] prompts hold segments[i]) met in prompts:
        whether each is admitted to the store (to be stored when it is missing). The default
        admits every one."""
        return [True] * len(segments)

    def get_num_prefix_tokens(self, request: ConnectorRequest) -> int:
        """Of the tokens get_num_new_matched_tokens just counted for a blend request, how many
        are its declared shared prefix, loaded exactly right after its local hit (the engine
        counts them as computed; the rest are segments to blend)."""
        return 0

    def get_loaded_ranges(self, request_id: str) -> list[tuple[int, int]]:
        """Token ranges of a blend request's segments loaded into its blocks this step, valid
        after wait_for_layer_load(0); only verified KV is named."""
        return []

    # a load that spans steps (engine/layered.py: a layered prefill reads its layers over steps)
    def hold_load(self, request_id: str) -> bool:
        """Keep this step's load going past the step, when it loads for request_id alone (else
        False). From then wait_for_layer_load and get_loaded_ranges read it only while
        resume_held names request_id; end_held ends it. Safety: it writes only into that
        request's blocks; the first get_block_ids_with_load_errors after end_held reports what
        it failed to deliver. Optional: the default keeps every load within its step."""
        return False

    def resume_held(self, request_id: str | None) -> None:
        """Whose held load wait_for_layer_load reads from now (None: the step's own)."""
        return None

    def end_held(self, request_id: str, cancel: bool = False) -> None:
        """request_id's held load is over (its last layer ran); cancel: its blocks are about to be
        freed, and nothing is written into them once this returns."""
        return None

    def flush(self) -> None:
        """Block until every save started so far is stored. An optional hook: the default does
        nothing."""
        return None

    def prefetch(
        self, token_ids: list[int], hint: KVHint | None = None, cache_salt: str | None = None
    ) -> None:
        """Start moving the KV of token_ids' prefix (under cache_salt's keys, tagged with hint)
        up the connector's tiers, for a request expected soon (the next workflow step's agent).
        Safety: runs in the background and returns at once (the engine calls it on its own
        thread, between steps); advice only, a failed or late prefetch leaves a request to load
        or compute normally. An optional hook: the default does nothing."""
        return None

    def get_num_prefetched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        """get_num_new_matched_tokens counting only KV in the connector's own process (its local
        tier, where a prefetch lands): what the engine's block prefetch (engine/block_prefetch.py)
        may load within a step without waiting on a slower tier. update_state_after_alloc then
        follows as for a request, and request_finished ends it. Safety: cheap, no remote call;
        the engine asks only for plain prompts, between steps. An optional hook: the default
        (0) turns block prefetch off."""
        return 0

    def request_metrics(self, request_id: str) -> dict[str, Any]:
        """Per-request numbers copied into the output metrics, e.g.
        {"loaded_tokens": {"cpu": 256}}."""
        return {}
