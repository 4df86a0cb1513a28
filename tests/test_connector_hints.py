"""The connector's workflow hints through real parts: a request with a kv_hint tags its chunk
keys in the local tier and on a real cache server (in this process, on its gRPC port), and
connector.prefetch loads a prompt's chunks from the server into the local cpu tier."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.test_connector import CFG
from tierkv.cacheserver.cli import build_store
from tierkv.cacheserver.config import ServerConfig
from tierkv.cacheserver.server import Server
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.connector.loop import LoopThread
from tierkv.engine import LLM, SamplingParams
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.hints import KVHint

PROMPT = torch.randint(0, 512, (330,), generator=torch.Generator().manual_seed(7)).tolist()
HINT = KVHint("w1", "coder", next_use={"planner": 1, "coder": 0, "reviewer": 2})
NS = "default"


@dataclass
class Request:
    """A request as the connector sees it (engine.kv_connector.ConnectorRequest), with the
    kv_hint the engine attaches to a workflow's requests."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    block_table: list[int] | None = None
    cache_salt: str | None = None
    blend: Any = None
    kv_hint: KVHint | None = None


def engine(conn: TierKVConnector) -> LLM:
    return LLM(
        CFG, dtype="float32", kv_cache_bytes=4 << 20, enable_prefix_caching=False, kv_connector=conn
    )


@pytest.fixture
def server(tmp_path):
    loop = LoopThread("test-server")
    config = ServerConfig(
        port=0,
        cache_dir=str(tmp_path),
        data_socket="",
        data_port=-1,
        tiers=TiersConfig(cpu_bytes="8MiB", disk_bytes="64MiB", eviction="hinted"),
    )
    s = loop.run(Server.start(config, build_store(config)))
    yield loop, s
    loop.run(s.stop())
    loop.close()


def connector(port: int) -> TierKVConnector:
    return TierKVConnector(
        ConnectorConfig(
            chunk_size=64,
            tiers=TiersConfig(cpu_bytes="16MiB", eviction="hinted"),
            remote=f"grpc://127.0.0.1:{port}",
            data_plane=False,
        )
    )


def on(loop: LoopThread, fn):
    """fn() on loop's thread (the tiers and their HintBooks live there)."""

    async def call():
        return fn()

    return loop.run(call(), 30)


def test_a_hinted_request_tags_its_chunks_here_and_on_the_server(server) -> None:
    sloop, srv = server
    conn = connector(srv.port)
    try:
        engine(conn).generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
        conn.flush()
        req = Request("r1", PROMPT, len(PROMPT), kv_hint=HINT)
        assert conn.get_num_new_matched_tokens(req, 0) == len(PROMPT) - 1
        conn.workflows.flush()
        keys = [c.key for c in conn.states["r1"].chunks]
        local = conn.store.tiers[0]
        assert on(conn.loop, lambda: [local.hints.rank(NS, k) for k in keys]) == [0] * len(keys)
        assert on(conn.loop, lambda: [local.hints.tags_of(NS, k) for k in keys]) == [
            [("w1", "coder")]
        ] * len(keys)
        remote_cpu = srv.store.tiers[0]
        tags = on(sloop, lambda: [remote_cpu.hints.tags_of(NS, k) for k in keys])
        assert tags == [[("w1", "coder")]] * len(keys)
        assert on(sloop, lambda: remote_cpu.hints.rank(NS, keys[0])) == 0
        # a request without a hint tags nothing more
        conn.get_num_new_matched_tokens(Request("r2", PROMPT[:128], 128), 0)
        assert conn.workflows.stats.hinted == 1
    finally:
        conn.close()


def test_prefetch_loads_a_prompt_from_the_server_into_the_local_tier(server) -> None:
    _, srv = server
    writer = connector(srv.port)
    try:
        engine(writer).generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
        writer.flush()
    finally:
        writer.close()
    conn = connector(srv.port)  # a fresh local tier, the same server
    try:
        engine(conn)  # binds the model: the keys' salt
        req = Request("r", PROMPT, len(PROMPT))
        local = conn.store.tiers[0]
        t0 = time.perf_counter()
        conn.prefetch(PROMPT, HINT)
        assert time.perf_counter() - t0 < 0.5  # never waits for the tiers
        conn.get_num_new_matched_tokens(req, 0)  # keys of the same prompt, as a request has them
        keys = [c.key for c in conn.states["r"].chunks]
        end = time.monotonic() + 20
        while not all(conn.loop.run(local.contains(keys, NS), 10)):
            assert time.monotonic() < end, "prefetch did not reach the local tier"
            time.sleep(0.02)
        assert on(conn.loop, lambda: [local.hints.rank(NS, k) for k in keys]) == [0] * len(keys)
        assert conn.workflows.stats.prefetches == 1 and conn.store.prefetcher.stats.moved == len(
            keys
        )
    finally:
        conn.close()
