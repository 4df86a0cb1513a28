"""The connector end to end: a hit gives the same greedy tokens as a cold run (fp32), from
every tier; faults and foreign KV are recomputed, counted and never injected."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from tierkv.cacheserver.launch import ServerProcess
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig

CFG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=4096,
)
CHUNK = 64
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(
        0, CFG["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


PROMPT = tokens(330, 1)  # 5 full chunks of 64 and a partial one
HIT = len(PROMPT) - 1  # a repeat loads all but the last token: the full chunks and the tail


def engine(conn=None, seed: int = 0, dtype: str = "float32") -> LLM:
    return LLM(
        CFG,
        dtype=dtype,
        kv_cache_bytes=4 << 20,
        enable_prefix_caching=False,
        kv_connector=conn,
        seed=seed,
    )


@pytest.fixture(scope="module")
def cold() -> dict[str, list[int]]:
    """Greedy outputs without any cache, for every prompt the tests use."""
    llm = engine()
    prompts = {
        "full": PROMPT,
        "partial": PROMPT[:200] + tokens(90, 2),
        "longer": PROMPT + tokens(150, 3),
    }
    return {k: llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for k, p in prompts.items()}


def run(conn: TierKVConnector, prompt: list[int]):
    out = engine(conn).generate([prompt], GREEDY, use_tqdm=False)[0]
    conn.flush()
    return out


def check_reuse(writer: TierKVConnector, reader, cold: dict, tier: str) -> None:
    """writer stores PROMPT's chunks; reader (a connector, or a function making one after the
    writer ran) then serves full, partial and longer prompts."""
    first = run(writer, PROMPT)
    assert first.token_ids == cold["full"]
    assert writer.stats.saved_chunks == 6  # 5 full chunks and the partial tail
    if not isinstance(reader, TierKVConnector):
        reader = reader()
    full = run(reader, PROMPT)
    assert full.token_ids == cold["full"]
    assert full.metrics.external_tokens == len(PROMPT) - 1  # the tail too; the last token computes
    assert full.metrics.connector["loaded_tokens"] == {tier: len(PROMPT) - 1}
    part = run(reader, PROMPT[:200] + tokens(90, 2))  # the hit ends inside the prompt's 4th chunk
    assert part.token_ids == cold["partial"]
    assert part.metrics.external_tokens == 3 * CHUNK
    longer = run(reader, PROMPT + tokens(150, 3))  # all 5 chunks hit, then new tokens
    assert longer.token_ids == cold["longer"]
    assert longer.metrics.external_tokens == 5 * CHUNK
    assert (
        reader.stats.load_rejected
        == reader.stats.load_errors
        == reader.stats.recomputed_tokens
        == 0
    )


@pytest.mark.triton_path
def test_reuse_from_cpu_tier(cold) -> None:
    conn = TierKVConnector(ConnectorConfig(chunk_size=CHUNK, tiers=TiersConfig(cpu_bytes="16MiB")))
    try:
        check_reuse(conn, conn, cold, "cpu")
        assert conn.stats.save_skipped >= 5  # a second run of the same prompt stores nothing again
    finally:
        conn.close()


def test_reuse_from_disk_tier(cold, tmp_path) -> None:
    cfg = ConnectorConfig(
        chunk_size=CHUNK, tiers=TiersConfig(cpu_bytes=0, disk_dir=tmp_path / "kv")
    )
    readers = []

    def restart() -> (
        TierKVConnector
    ):  # the writer's process is gone; the index comes from the files
        writer.close()
        readers.append(TierKVConnector(cfg))
        return readers[0]

    writer = TierKVConnector(cfg)
    try:
        check_reuse(writer, restart, cold, "disk")
    finally:
        for r in readers:
            r.close()


@pytest.mark.parametrize(
    "path", [pytest.param("shm", marks=pytest.mark.triton_path), "tcp", "grpc"]
)
def test_reuse_through_cache_server(cold, path: str) -> None:
    """Loads over the server's data plane, by shared memory (the default on this host) or its
    TCP port, or over gRPC streams."""
    server = ServerProcess().start()
    try:
        cfg = ConnectorConfig(
            chunk_size=CHUNK,
            tiers=TiersConfig(cpu_bytes=0),
            remote=f"grpc://{server.target}",
            data_plane=path != "grpc",
            shared_memory=path == "shm",
        )
        writer, reader = TierKVConnector(cfg), TierKVConnector(cfg)
        try:
            check_reuse(writer, reader, cold, "remote")
            tier = reader.store.tiers[-1]
            assert type(tier).__name__ == ("RemoteTier" if path == "grpc" else "DataTier")
            assert tier.stats().errors == 0 and tier.stats().hits >= 3
            session = getattr(tier, "_session", None)
            assert (session is not None) == (path != "grpc")
            assert (session is not None and session.region is not None) == (path == "shm")
        finally:
            writer.close()
            reader.close()
    finally:
        server.stop(kill=True)


def test_reuse_from_redis(cold, redis_proc) -> None:
    cfg = ConnectorConfig(chunk_size=CHUNK, tiers=TiersConfig(cpu_bytes=0), remote=redis_proc.url)
    writer, reader = TierKVConnector(cfg), TierKVConnector(cfg)
    try:
        check_reuse(writer, reader, cold, "redis")
    finally:
        writer.close()
        reader.close()


def test_local_tier_promotes_remote_hits(cold, redis_proc) -> None:
    writer = TierKVConnector(
        ConnectorConfig(chunk_size=CHUNK, tiers=TiersConfig(cpu_bytes=0), remote=redis_proc.url)
    )
    reader = TierKVConnector(
        ConnectorConfig(
            chunk_size=CHUNK, tiers=TiersConfig(cpu_bytes="16MiB"), remote=redis_proc.url
        )
    )
    try:
        run(writer, PROMPT)
        assert run(reader, PROMPT).metrics.connector["loaded_tokens"] == {"redis": HIT}
        again = run(reader, PROMPT)
        assert again.token_ids == cold["full"]
        assert again.metrics.connector["loaded_tokens"] == {"cpu": HIT}
    finally:
        writer.close()
        reader.close()


def test_second_process_reuses_first_process_kv_through_server(cold) -> None:
    """Two separate interpreters; the second starts with an empty local cache."""
    import json
    import subprocess
    import sys

    server = ServerProcess().start()
    try:
        outs = []
        for _ in range(2):
            p = subprocess.run(
                [sys.executable, "-m", "tests.conn_worker", server.target, "1", "330"],
                capture_output=True,
                text=True,
                timeout=240,
                check=True,
            )
            outs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        a, b = outs
        assert a["tokens"] == b["tokens"] == cold["full"]
        assert a["metrics"]["external_tokens"] == 0
        assert b["metrics"]["external_tokens"] == HIT
        assert b["metrics"]["connector"]["loaded_tokens"] == {"remote": HIT}
    finally:
        server.stop(kill=True)


class FaultTier(CpuTier):
    """A real cpu tier whose reads can be made to fail in one way (tests only, not product)."""

    mode = "none"  # none | raise | slow | flip | tokens | drop

    async def get(self, key, ns="default", out=None):
        seg = await super().get(key, ns, out)
        if seg is None or self.mode == "none":
            return seg
        if self.mode == "raise":
            raise RuntimeError("injected tier fault")
        if self.mode == "slow":
            await asyncio.sleep(3.0)
            return seg
        if self.mode == "drop":
            return None
        if self.mode == "flip":  # the recorded checksums no longer match the bytes
            payload = seg.payload.clone()
            payload.view(torch.uint8).view(-1)[1234] ^= 0x10
            return dataclasses.replace(seg, payload=payload)
        other = (seg.tokens + 1) % CFG["vocab_size"]  # valid checksums, other tokens
        return type(seg).from_tensor(
            seg.payload,
            key=seg.key,
            parent=seg.header.parent,
            tokens=other,
            fingerprint=seg.header.fingerprint,
        )

    async def stream(self, keys, ns, sink):
        """Loads come as streams: the same faults, on the stream's way."""
        if self.mode == "raise":
            raise RuntimeError("injected tier fault")
        if self.mode == "slow":
            await asyncio.sleep(3.0)
        if self.mode == "drop":
            for i in range(len(keys)):
                sink.drop(i, "miss")
            return
        if self.mode == "flip":  # the tier's own memory corrupted: its stream's check finds it
            for key in keys:
                entry = self.index.get((ns, key))
                if entry is not None:
                    at = entry.pages[0] * self.page_bytes + entry.header.header_nbytes + 1234
                    self._mv[at] ^= 0x10
        if self.mode == "tokens":  # valid checksums, other tokens
            sink = OtherTokens(sink)
        await super().stream(keys, ns, sink)


@dataclasses.dataclass
class OtherTokens:
    sink: object

    def open(self, i, h):
        return self.sink.open(i, dataclasses.replace(h, tokens=(h.tokens + 1) % CFG["vocab_size"]))

    def into(self, i, layer):
        return self.sink.into(i, layer)

    def drop(self, i, why):
        self.sink.drop(i, why)

    async def ready(self, layer):
        await self.sink.ready(layer)


@pytest.mark.parametrize(
    "mode,counter",
    [
        ("raise", "load_errors"),
        # times the load deadline against steps of milliseconds: the CPU kernels
        pytest.param("slow", "load_timeouts", marks=pytest.mark.cpu_path),
        ("flip", "load_misses"),  # found by the tier: its miss
        ("tokens", "load_rejected"),
        ("drop", "load_misses"),
    ],
)
def test_faults_recompute_and_count(cold, mode: str, counter: str) -> None:
    tier = FaultTier(CpuTierConfig(capacity_bytes="16MiB"))
    conn = TierKVConnector(ConnectorConfig(chunk_size=CHUNK, load_timeout_s=0.5), tiers=[tier])
    try:
        run(conn, PROMPT)
        tier.mode = mode
        out = run(conn, PROMPT)
        assert out.token_ids == cold["full"]
        assert getattr(conn.stats, counter) >= 1
        assert conn.stats.recomputed_tokens == HIT
        assert out.metrics.connector["recomputed_tokens"] == HIT
        assert out.metrics.connector["loaded_tokens"] == {}
        if mode == "slow":  # the engine waited about its deadline, not the tier's 3 s
            assert out.metrics.ttft < 2.5
        tier.mode = "none"
        if mode == "flip":  # the corrupt entry was removed: the next run stores it again
            assert run(conn, PROMPT).metrics.connector["loaded_tokens"] == {}
        assert run(conn, PROMPT).metrics.connector["loaded_tokens"] == {"cpu": HIT}
    finally:
        conn.close()


def test_salts_other_model_dtype_or_namespace_never_hit(redis_proc) -> None:
    def conn(ns: str) -> TierKVConnector:
        return TierKVConnector(
            ConnectorConfig(
                chunk_size=CHUNK,
                tiers=TiersConfig(cpu_bytes=0),
                remote=redis_proc.url,
                namespace=ns,
            )
        )

    a, b = conn("tenant-a"), conn("tenant-b")
    try:
        run(a, PROMPT)
        assert a.stats.saved_chunks == 6
        other_weights = engine(a, seed=1).generate([PROMPT], GREEDY, use_tqdm=False)[0]
        other_dtype = engine(a, dtype="bfloat16").generate([PROMPT], GREEDY, use_tqdm=False)[0]
        other_tenant = run(b, PROMPT)
        for out in (other_weights, other_dtype, other_tenant):
            assert out.metrics.external_tokens == 0
        assert run(a, PROMPT).metrics.external_tokens == HIT  # the owner still hits
        import redis

        r = redis.Redis(port=redis_proc.port)
        assert len(r.keys("tierkv:tenant-a:*")) == 6 + 6 + 6  # three models' chunks, all tenant a
        assert len(r.keys("tierkv:tenant-b:*")) == 6
    finally:
        a.close()
        b.close()


def test_prometheus_metrics(cold) -> None:
    import urllib.request

    from tierkv.cacheserver.launch import free_port

    port = free_port()
    conn = TierKVConnector(
        ConnectorConfig(chunk_size=CHUNK, tiers=TiersConfig(cpu_bytes="16MiB"), metrics_port=port)
    )
    try:
        run(conn, PROMPT)
        run(conn, PROMPT)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert f"tierkv_connector_loaded_tokens_total {HIT}.0" in text
        assert "tierkv_connector_saved_chunks_total 6.0" in text
        assert 'tierkv_tier_hits_total{tier="cpu"}' in text
    finally:
        conn.close()


def test_fp8_engine_cache_reuse_matches_its_own_cold_run() -> None:
    """An fp8 KV cache stores fp8 segments with the engine's scales; a hit gives the same
    greedy tokens as the same fp8 engine computing cold."""
    conn = TierKVConnector(ConnectorConfig(chunk_size=CHUNK, tiers=TiersConfig(cpu_bytes="16MiB")))
    try:
        llm = LLM(
            CFG,
            dtype="float32",
            kv_cache_bytes=4 << 20,
            enable_prefix_caching=False,
            kv_cache_dtype="fp8",
            kv_connector=conn,
        )
        first = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
        conn.flush()
        again = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
        assert again.metrics.external_tokens == HIT
        assert again.token_ids == first.token_ids
    finally:
        conn.close()
