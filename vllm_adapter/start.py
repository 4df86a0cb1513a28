"""How each process's side of tierkv.vllm's connector starts: the scheduler's over the shared
tier alone (following a tierkv-server's changes when KV events are published), a worker's over
every tier."""

from __future__ import annotations

import dataclasses
from typing import Any

from tierkv.connector.config import ConnectorConfig
from tierkv.connector.event_blocks import EventBlocks
from tierkv.connector.loop import LoopThread
from tierkv.connector.server_watch import follow
from tierkv.storage_backends.keys import ChunkHasher
from tierkv.vllm.events import Outbox, SchedulerEvents, from_server, recorder
from tierkv.vllm.groups import Groups
from tierkv.vllm.pd import Roles
from tierkv.vllm.ranks import PartNames, heads_of
from tierkv.vllm.scheduler import SchedulerSide
from tierkv.vllm.worker import WorkerSide


def start_scheduler(
    vllm_config: Any,
    ktc: Any,
    loop: LoopThread,
    cfg: ConnectorConfig,
    hasher: ChunkHasher,
    fp: bytes,
    groups: Groups,
    events: SchedulerEvents,
    blocks: EventBlocks | None,
) -> tuple[SchedulerSide, Any]:
    """The scheduler's side, and its job following the server's changes (None: not followed).
    Sets ktc's kv_load_failure_policy to "recompute"."""
    # The shared tier alone: the worker's local tiers live in its own process.
    remote = dataclasses.replace(cfg.tiers, gpu_bytes=0, cpu_bytes=0, disk_dir=None)
    shared = dataclasses.replace(cfg, tiers=remote)
    store = loop.run(_build(shared))
    roles = Roles.of(ktc, fp.hex(), cfg.load_timeout_s)
    sched = SchedulerSide(loop, store, hasher, cfg, heads_of(vllm_config), groups, roles)
    # A failed load is recomputed, never a failed request (vLLM's default is "fail").
    ktc.kv_load_failure_policy = "recompute"
    watcher = None
    if blocks and hasattr(store.tiers[-1], "watch"):  # a tierkv-server: what it holds
        handle = from_server(events.box, sched.names, blocks, hasher)
        job = follow(store.tiers[-1], handle, stored=True, who="tierkv.vllm")
        watcher = loop.submit(job)
    return sched, watcher


def start_worker(
    vllm_config: Any,
    loop: LoopThread,
    cfg: ConnectorConfig,
    fp: bytes,
    outbox: Outbox,
    blocks: EventBlocks | None,
) -> WorkerSide:
    """A worker's side over every tier, its tiers' changes recorded into outbox."""
    store = loop.run(_build(cfg))
    names = PartNames()
    hook = recorder(outbox, cfg.namespace, blocks, names)
    return WorkerSide.start(vllm_config, loop, store, cfg, fp, hook, names)


async def _build(cfg: Any) -> Any:
    return cfg.build_store()
