"""Redis faults: a real engine with a TierKVConnector while its Redis is killed and
restarted under load, and a Redis Cluster (with replicas) whose master is killed. Misses
meanwhile, hits again afterwards, never an exception, never other tokens than a cold run."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time

import torch

from tests.test_connector import CHUNK, GREEDY, engine, tokens
from tierkv.cacheserver.launch import RedisProcess
from tierkv.cacheserver.launch_cluster import RedisCluster
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.redis_tier import RedisTier, RedisTierConfig
from tierkv.storage_backends.segment import KVSegment

PROMPTS = [tokens(330, 10 + i) for i in range(4)]  # 5 full chunks and a partial tail each


def generate(conn: TierKVConnector, prompts: list[list[int]]):
    outs = engine(conn).generate(prompts, GREEDY, use_tqdm=False)
    conn.flush()
    return outs


def test_redis_killed_and_restarted_under_load(redis_proc: RedisProcess) -> None:
    cold = [o.token_ids for o in engine().generate(PROMPTS, GREEDY, use_tqdm=False)]
    cfg = ConnectorConfig(
        chunk_size=CHUNK,
        tiers=TiersConfig(cpu_bytes=0),
        remote=redis_proc.url,
        lookup_timeout_s=1.0,
        load_timeout_s=1.0,
    )
    writer = TierKVConnector(cfg)
    try:
        assert [o.token_ids for o in generate(writer, PROMPTS)] == cold
        assert writer.stats.saved_chunks == 24
        # Killed while a batch that hits Redis is running: loads fail midway or miss.
        killer = threading.Timer(0.2, redis_proc.stop, kwargs={"kill": True})
        killer.start()
        during = generate(TierKVConnector(cfg), PROMPTS)
        killer.join()
        assert [o.token_ids for o in during] == cold
        down = generate(TierKVConnector(cfg), PROMPTS)  # Redis gone: all misses, same tokens
        assert [o.token_ids for o in down] == cold and all(
            o.metrics.external_tokens == 0 for o in down
        )
        redis_proc.start()  # back, empty (no persistence)
        conn = TierKVConnector(cfg)
        deadline = time.monotonic() + 30
        while True:  # the tier's backoff ends; saves land again; then a run hits
            outs = generate(conn, PROMPTS)
            assert [o.token_ids for o in outs] == cold
            if all(o.metrics.external_tokens == 329 for o in outs):
                break
            assert time.monotonic() < deadline, "no hits from Redis 30 s after its restart"
            time.sleep(0.5)
        assert all(o.metrics.connector["loaded_tokens"] == {"redis": 329} for o in outs)
        assert conn.stats.load_rejected == 0
    finally:
        writer.close()


def segment(seed: int) -> KVSegment:
    kv = torch.randn(2, 2, 16, 2, 16, generator=torch.Generator().manual_seed(seed)).half()
    return KVSegment.from_tensor(
        kv, key=seed.to_bytes(16, "little"), tokens=range(16), fingerprint=b"cluster"
    )


def _masters(cluster: RedisCluster) -> list[RedisProcess]:
    out = []
    for n in cluster.nodes:
        role = subprocess.run(
            ["redis-cli", "-p", str(n.port), "role"], capture_output=True, text=True
        ).stdout
        if n.proc is not None and role.startswith("master"):
            out.append(n)
    return out


async def test_cluster_master_killed_fails_over() -> None:
    cluster = RedisCluster(masters=3, replicas=1).start()
    tier = RedisTier(
        RedisTierConfig(
            url=cluster.url, cluster=True, timeout_s=0.5, backoff_s=0.2, max_backoff_s=1.0
        )
    )
    try:
        segs = [segment(i) for i in range(1, 31)]
        assert all([await tier.put(s.key, s) for s in segs])
        for n in _masters(cluster):  # replication is asynchronous: wait until a replica has it all
            deadline = (
                time.monotonic() + 30
            )  # (a replica still syncing, on a loaded machine, cannot take over)
            while (
                subprocess.run(
                    ["redis-cli", "-p", str(n.port), "wait", "1", "2000"],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.strip()
                != "1"
            ):
                assert time.monotonic() < deadline, (
                    f"no replica of master {n.port} acknowledged the writes"
                )
        victim = _masters(cluster)[0]
        victim.stop(kill=True)
        misses = 0
        deadline = time.monotonic() + 30
        while True:  # misses (no exception) until the replica takes over and the client follows
            got = [await tier.get(s.key) for s in segs]
            misses += sum(g is None for g in got)
            if all(g is not None for g in got):
                break
            assert time.monotonic() < deadline, "the cluster client did not follow the failover"
            await asyncio.sleep(0.2)
        assert misses > 0 and len(_masters(cluster)) == 3  # a replica was promoted
        for s, g in zip(segs, got):  # every segment survived, served by the promoted replica
            assert torch.equal(g.payload, s.payload)
        late = segment(99)
        assert await tier.put(late.key, late) and torch.equal(
            (await tier.get(late.key)).payload, late.payload
        )
        assert tier.stats().errors >= 1
    finally:
        await tier.close()
        cluster.stop()
