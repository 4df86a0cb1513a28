"""Worker side: tierkv.connector.worker's core over vLLM's paged layouts (found from the
registered tensors; their gather and scatter: tierkv.vllm.vllm_kv), vLLM's layer names, and
its metadata's saves. Each rank saves and loads the KV head parts (tierkv.vllm.ranks) of the
heads its cache holds, and nothing else.

Safety contract: the core's (tierkv.connector.transfer.PagedKV): nothing reaches vLLM's cache
before its segment passed the tier's checksum and the header check, and a load that fails,
times out or is cancelled scatters nothing more and names the blocks vLLM must recompute.
A save copies its tokens into a staging buffer inside save_kv_layer, while vLLM still holds
the blocks; the request's blocks are released only when its last put has finished. Each layer
reads and writes its own KV cache group's block table (tierkv.vllm.groups): a sliding-window
layer saves the blocks vLLM may have handed on as zeros and loads only into its window's blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.connector.config import ConnectorConfig
from tierkv.connector.loop import LoopThread
from tierkv.connector.plan import LoadPlan
from tierkv.connector.transfer import Layout
from tierkv.connector.worker import WorkerCore
from tierkv.storage_backends.segment import dtype_name
from tierkv.storage_backends.store import TieredStore
from tierkv.vllm.groups import NULL, Groups
from tierkv.vllm.kvdtype import Stored
from tierkv.vllm.layout import detect_layout, probe_tiles
from tierkv.vllm.ranks import Heads, PartNames, heads_of
from tierkv.vllm.scheduler import TierKVMetadata
from tierkv.vllm.stats import ObservedStats
from tierkv.vllm.vllm_kv import VllmKV

log = logging.getLogger("tierkv.vllm")
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(slots=True, eq=False)
class WorkerSide:
    """vLLM's worker hooks over the core: layer names, the metadata's saves, held blocks."""

    core: WorkerCore
    fingerprint: bytes  # the salt's: every segment this worker reads or writes carries it
    heads: Heads  # the KV heads this rank holds
    names: PartNames = field(default_factory=PartNames)  # head-0 parts -> chunks (events)
    index: dict[str, int] = field(default_factory=dict)  # layer name -> layer
    had_saves: set[str] = field(default_factory=set)  # requests the scheduler holds blocks for
    closing: set[str] = field(default_factory=set)  # finished requests waiting for their saves
    groups: Groups | None = None  # vLLM's KV cache groups, once registered

    @staticmethod
    def start(
        vllm_config: Any,
        loop: LoopThread,
        store: TieredStore,
        cfg: ConnectorConfig,
        fingerprint: bytes,
        hook: Callable[..., None],
        names: PartNames,
    ) -> WorkerSide:
        """This rank's worker over its store, its changes to hook (the KV events); with
        metrics_port, its counters on metrics_port + rank."""
        pc = vllm_config.parallel_config
        rank = pc.rank % pc.tensor_parallel_size
        store.watch(hook)
        core = WorkerCore(loop, store, cfg, stats=ObservedStats())
        if cfg.metrics_port:
            from tierkv.connector.metrics import serve_metrics

            serve_metrics(core, cfg.metrics_port + rank)  # one port per rank
        heads = Heads.of(rank, pc.tensor_parallel_size, heads_of(vllm_config))
        return WorkerSide(core, fingerprint, heads, names=names)

    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        head_dim: int,
        write: Writer | None,
        groups: Groups | None = None,
        stored: Stored | None = None,
    ) -> None:
        """The layers' tensors (several groups' layers may share one); groups None: one group
        of full attention; stored: what the caches hold (default: values of their own
        dtype)."""
        self.index = {name: i for i, name in enumerate(kv_caches)}
        caches = list(kv_caches.values())
        first = caches[0]
        paged = detect_layout(first, self.heads.count, head_dim)
        if any(t.shape != first.shape or t.dtype != first.dtype for t in caches):
            raise ValueError(
                "tierkv.vllm needs every layer's KV tensor alike (one head size, dtype and "
                "block size for every layer and KV cache group)"
            )
        groups = groups or Groups({n: 0 for n in kv_caches}, (None,), paged.block_size)
        missing = sorted(set(kv_caches) - set(groups.of_layer))
        if missing or groups.block_size != paged.block_size:
            raise ValueError(
                f"the KV cache groups do not match the registered layers (layers {missing} "
                f"in no group; block size {groups.block_size} against {paged.block_size})"
            )
        stored = stored or Stored(first.dtype)
        name = dtype_name(stored.dtype)
        if name is None or stored.dtype.itemsize != first.dtype.itemsize:
            raise ValueError(f"no segment can hold a {first.dtype} cache of {stored.dtype}")
        if paged.kind == "cpu_heads_first":
            if write is None:
                raise ValueError("the CPU layout needs the attention backend's KV writer")
            probe_tiles(paged, first.dtype, stored.dtype, write)
        scales = stored.part_scales()
        layout = Layout(len(caches), 1, head_dim, name, self.fingerprint, paged.block_size)
        layout.scales = scales
        group = [groups.of_layer[n] for n in kv_caches]
        windowed = [w is not None for w in groups.windows]
        self.groups = groups
        kv = VllmKV(layout, stored.dtype, scales is not None, paged, caches, group, windowed)
        self.core.register(kv)
        h = self.heads
        log.info(
            "tierkv.vllm: %d layers, layout %s %s, KV heads [%d, %d) of %d, groups %s",
            len(caches),
            paged.kind,
            list(first.shape),
            h.first,
            h.first + h.count,
            h.total,
            groups.windows,
        )

    def bind(self, meta: TierKVMetadata) -> None:
        """A new step: stage its saves (the buffers the forward's layers are copied into)."""
        staged = []
        self.names.note([s.chunk.key for s in meta.saves])
        for s in meta.saves:
            self.had_saves.add(s.request_id)  # reported by every rank, saving or not
            if not self.heads.saves:  # a replica of a head another rank saves
                continue
            for j, part in enumerate(self.heads.parts(s.chunk)):
                plan = self.core.stage(s.request_id, s.block_ids, part, s.tokens, head=j)
                if plan is not None:
                    staged.append(plan)
        self.core.bind(staged)

    def start_load(self, loads: list[LoadPlan], tables: dict[str, torch.Tensor]) -> None:
        """The step's loads over this rank's parts of their chunks, each request's blocks in
        tables ([groups, blocks])."""
        self.names.note([c.key for p in loads for c in p.chunks])
        if self.core.kv is not None:
            assert isinstance(self.core.kv, VllmKV)
            self.core.kv.tables = tables
        self.core.start_load([self.heads.plan(p) for p in loads])

    def loaded(self) -> tuple[set[str], set[str]]:
        """With several KV cache groups (loads asynchronous to vLLM, failures by request): wait
        for this step's load, book it, and name its requests and those whose load failed (vLLM
        recomputes them whole). Nothing with one group: its loads are in-step, by block."""
        job = self.core.job
        if job is None or self.groups is None or not self.groups.by_request:
            return set(), set()
        for layer in range(len(job.events)):
            self.core.wait_layer(layer)
        self.core.load_errors()  # the counters; block ids name no request across groups
        failed = {p.request_id for p in job.plans if p.failed_from is not None}
        return {p.request_id for p in job.plans}, failed

    def load_errors(self) -> set[int]:
        """One group: blocks from the first token each of this step's loads did not deliver
        (a sliding window's null blocks are no request's: left out)."""
        if self.groups is not None and self.groups.by_request:
            return set()
        return self.core.load_errors() - ({NULL} if self.groups and self.groups.windowed else set())

    def wait_layer(self, name: str) -> None:
        self.core.wait_layer(self.index[name])

    def save_layer(self, name: str, kv_layer: torch.Tensor) -> None:
        self.core.save_layer(self.index[name], kv_layer)

    def hand_off(self, request_ids: list[str]) -> None:
        """Prefill requests for a remote decode whose prompt ended this step: vLLM sends their
        response once this step's output is back, before get_finished, so the step waits here
        (at most load_timeout_s each) until their puts ended and the write-behind reached the
        shared tier; a decode instance that still misses a chunk waits for it (tierkv.vllm.pd)."""
        core = self.core
        core.settled(set(), set(request_ids))
        try:
            core.loop.run(core.store.drain(), core.config.load_timeout_s)
        except Exception as e:  # the decode instance waits, then recomputes what is missing
            log.warning("tierkv: hand-off of %s not on the shared tier: %r", request_ids, e)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks vLLM may free now: finished, every save of theirs put. vLLM
        names a finished request once, in the step after it ended, and may idle after that
        step: so this waits (at most load_timeout_s) for the puts of the requests it names
        now, and their blocks go back in this step unless a put is slower than that."""
        new = finished_req_ids & self.had_saves
        self.had_saves -= new
        self.closing |= new
        done = self.core.settled(self.closing, new)
        self.closing -= done
        return done
