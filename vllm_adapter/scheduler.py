"""Scheduler side: vLLM's requests and scheduler output -> tierkv's chunk keys, lookups and the
per-step metadata the worker acts on.

vLLM runs its scheduler and its worker in different processes (on the CPU platform always),
so this side looks up the shared tier only; the worker's local tiers are a cache in front of
it. The metadata holds plain data (ids, keys, tokens): the worker makes its own buffers.
Block ids are kept per KV cache group (tierkv.vllm.groups); with several groups, loads are
asynchronous to vLLM, so that a failed one is recomputed by request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from tierkv.connector.config import ConnectorConfig
from tierkv.connector.loop import LoopThread
from tierkv.connector.plan import Chunk, ConnectorStats, LoadPlan, RequestState
from tierkv.connector.requests import located, prefix_chunks, record_lookup
from tierkv.connector.steps import chunks_to_save, prefix_load
from tierkv.connector.workflow import Workflows
from tierkv.storage_backends.keys import ChunkHasher
from tierkv.storage_backends.store import TieredStore
from tierkv.vllm.groups import NULL, Groups
from tierkv.vllm.hints import advise
from tierkv.vllm.pd import Claim, Roles, Waiting, hands_off, read_claim, takes_over
from tierkv.vllm.ranks import PartNames, chunk_tiers, part_keys

log = logging.getLogger("tierkv.vllm")


@dataclass(slots=True)
class SaveSpec:
    """Save chunk of request_id, whose tokens lie in block_ids, after this step's forward."""

    request_id: str
    block_ids: torch.Tensor  # int32 [groups, blocks]: a window's possibly freed blocks null
    chunk: Chunk
    tokens: np.ndarray


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    """One step's work for the worker: loads before the layers read, saves after they write."""

    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # the loads' requests' blocks, [groups, blocks] (a LoadPlan's block_ids is group 0's)
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    # prefill requests for a remote decode whose prompt ends this step: the step ends only
    # once their chunks are on the shared tier (tierkv.vllm.pd)
    handoffs: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Tracked:
    """A request from its first lookup to request_finished."""

    state: RequestState
    lookup_from: int = 0  # the local hit the last lookup was asked after
    tables: list[list[int]] = field(default_factory=list)  # block ids per KV cache group
    saving: bool = False  # a save was planned: its blocks are held until the worker reports it
    failed: bool = False  # a load of it failed: vLLM recomputes it whole, loading nothing
    handoff: bool = False  # a prefill for a remote decode: every chunk saved, a claim returned
    waiting: Waiting | None = None  # a remote prefill's decode, until its chunks are present


class SchedulerSide:
    def __init__(
        self,
        loop: LoopThread,
        store: TieredStore,
        hasher: ChunkHasher,
        cfg: ConnectorConfig,
        heads: int = 1,  # the model's KV heads: each chunk is stored as one part per head
        groups: Groups | None = None,  # vLLM's KV cache groups (None: one, full attention)
        roles: Roles | None = None,  # kv_role and P/D (None: kv_both)
    ) -> None:
        self.loop, self.store, self.hasher, self.ns = loop, store, hasher, cfg.namespace
        self.partial, self.save = cfg.save_partial_chunks, cfg.save
        self.lookup_timeout_s = cfg.lookup_timeout_s
        self.heads, self.groups = heads, groups or Groups({}, (None,), 1)
        self.roles = roles or Roles(wait_s=cfg.load_timeout_s)
        self.pending_tables: dict[str, torch.Tensor] = {}
        self.names = PartNames()  # the looked-up chunks' head-0 parts (the server's removals)
        self.stats = ConnectorStats()
        self.hits: dict[str, int] = {}  # tokens vLLM admitted as external hits, by tier
        self.tracked: dict[str, Tracked] = {}
        self.pending_loads: list[LoadPlan] = []
        self.workflows = Workflows(loop, store, self.ns)  # kv_hints: tierkv.vllm.hints

    def _track(self, request: Any) -> Tracked:
        tr = self.tracked.get(request.request_id)
        if tr is None:
            tokens = np.asarray(request.prompt_token_ids or [], dtype=np.int32)
            params, roles = getattr(request, "kv_transfer_params", None), self.roles
            handoff = roles.produce and self.save and hands_off(params)
            remote = roles.consume and takes_over(params)
            # P/D moves the whole prompt: its partial last chunk too
            chunks = prefix_chunks(self.hasher, tokens, self.partial or handoff or remote)
            tr = Tracked(RequestState(chunks, tokens, prefix_chunks=len(chunks)), handoff=handoff)
            if remote:
                claim = read_claim(params, chunks, roles.salt)
                if isinstance(claim, str):
                    roles.refused += 1
                    log.warning("tierkv: request %s: %s: not waited for", request.request_id, claim)
                else:
                    tr.waiting = Waiting(claim.chunks, time.monotonic() + roles.wait_s)
            self.tracked[request.request_id] = tr
            advise(self.workflows, request, part_keys(chunks, self.heads))
        return tr

    def matched(self, request: Any, num_computed_tokens: int) -> int | None:
        """Prompt tokens after num_computed_tokens whose chunks the shared tier holds (never
        the last prompt token). A chunk counts only when every KV head's part (every rank's)
        is present: one lookup of all parts. None: a remote prefill's chunks are not all
        present yet (vLLM asks again in a later step)."""
        tr = self._track(request)
        st = tr.state
        tr.lookup_from = num_computed_tokens
        if not st.chunks or tr.failed or not self.roles.consume:
            return 0
        if tr.waiting is not None and not tr.waiting.due():
            return None
        self.stats.lookups += 1
        self.names.note([c.key for c in st.chunks])
        keys = part_keys(st.chunks, self.heads)
        found = located(self.loop, self.store, keys, self.ns, self.lookup_timeout_s)
        where = chunk_tiers(found, self.heads)
        if tr.waiting is not None:
            ready = tr.waiting.settled(where)
            if ready is None:
                return None
            self.roles.timeouts += not ready
            tr.waiting = None
        names = [self.store.tiers[w].name if w is not None else None for w in where]
        new = record_lookup(st, names, num_computed_tokens, False)
        self.stats.lookup_hit_tokens += new
        return new

    def after_alloc(
        self, request: Any, tables: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """Plan the load of the tokens vLLM took from the lookup into the blocks it allocated
        (tables: one list per KV cache group)."""
        if num_external_tokens <= 0:
            return
        tr = self._track(request)
        table = self.groups.table(tables)
        self.pending_tables[request.request_id] = table
        start = tr.lookup_from
        plan = prefix_load(
            request.request_id, table[0], tr.state, start, start + num_external_tokens
        )
        self.pending_loads.append(plan)

    def sources(self, request: Any, n: int, tier_of: Callable[[bytes, str], str]) -> dict[str, int]:
        """The n tokens vLLM admitted after the lookup's local hit, split by the tier holding
        each chunk (tier_of(key, shared tier's name)), and counted in `hits`."""
        tr = self.tracked.get(request.request_id)
        if tr is None or n <= 0:
            return {}
        st, start = tr.state, tr.lookup_from
        split: dict[str, int] = {}
        for i, c in enumerate(st.chunks[: st.present]):
            k = min(c.end, start + n) - max(c.start, start)
            if k > 0:
                t = tier_of(c.key, st.tiers[i])
                split[t] = split.get(t, 0) + k
        for t, k in split.items():
            self.hits[t] = self.hits.get(t, 0) + k
        return split

    def build_meta(self, so: Any) -> TierKVMetadata:
        meta = TierKVMetadata(self.pending_loads, [], self.pending_tables)
        self.pending_loads, self.pending_tables = [], {}
        for new in so.scheduled_new_reqs:
            tr = self.tracked.get(new.req_id)
            if tr is not None:
                tr.tables = [list(t) for t in new.block_ids]
                self._plan_saves(new.req_id, tr, new.num_computed_tokens, so, meta)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self.tracked.get(rid)
            if tr is None:
                continue
            blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # after a preemption: new block tables
                tr.tables = [list(t) for t in blocks] if blocks else []
            elif blocks:
                for mine, more in zip(tr.tables, blocks):
                    mine.extend(more)
            self._plan_saves(rid, tr, cached.num_computed_tokens[i], so, meta)
        return meta

    def _plan_saves(
        self, rid: str, tr: Tracked, computed: int, so: Any, meta: TierKVMetadata
    ) -> None:
        """The prompt chunks this step completes, unless the store had them or they were
        computed before the connector saw the request."""
        st = tr.state
        if not self.save or not self.roles.produce or computed >= len(st.tokens):
            return
        stop, blocks = computed + so.num_scheduled_tokens.get(rid, 0), None
        if tr.handoff and stop >= len(st.tokens):
            meta.handoffs.append(rid)
        for c in chunks_to_save(st, computed, stop, self.stats):
            if blocks is None:
                blocks = self._save_table(tr.tables, computed)
            meta.saves.append(SaveSpec(rid, blocks, c, st.tokens[c.start : c.end]))
            tr.saving = True

    def _save_table(self, tables: list[list[int]], computed: int) -> torch.Tensor:
        """The request's blocks for a save in a step that starts at `computed`: a windowed
        group's blocks that vLLM may have freed (and handed on) by then as null."""
        t = self.groups.table(tables)
        for g in range(len(t)):
            t[g, : self.groups.kept_from(g, computed) // self.groups.block_size] = NULL
        return t

    def load_failed(self, request_ids: set[str]) -> None:
        """Requests whose (asynchronous) load failed: vLLM recomputes them from their first
        token, and a lookup of theirs from now on finds nothing."""
        for rid in request_ids:
            tr = self.tracked.get(rid)
            if tr is not None:
                tr.failed = True

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """True: hold the request's blocks until the worker reports its saves done; and, for
        a prefill whose decode runs elsewhere, the claim the decode instance needs."""
        tr = self.tracked.pop(request.request_id, None)
        if tr is None:
            return False, None
        n = tr.state.saved_upto
        if not tr.handoff or not n:
            return tr.saving, None
        self.roles.handoffs += 1
        claim = Claim(tr.state.chunks[n - 1].end, n, self.roles.salt)
        return tr.saving, claim.params()
