"""The cache server as a real process: round trips through every tier, restart, Redis faults,
health, reflection, metrics, the stats CLI and graceful shutdown."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tierkv.cacheserver import cli
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.frames import put_frames
from tierkv.cacheserver.launch import RedisProcess, ServerProcess, free_port
from tierkv.proto import tierkv_pb2 as pb
from tierkv.proto import tierkv_pb2_grpc as pb_grpc
from tierkv.storage_backends.segment import KVSegment, decode_layer


def segment(seed: int, layers: int = 4, tokens: int = 32) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, tokens, 2, 16, generator=g).to(torch.bfloat16)
    return KVSegment.from_tensor(
        kv, key=seed.to_bytes(16, "little"), tokens=list(range(tokens)), fingerprint=b"test"
    )


@pytest.fixture
def server():
    s = ServerProcess().start()
    yield s
    s.stop(kill=True)


async def check_round_trip(tier: RemoteTier, segs: list[KVSegment], where: str | None) -> None:
    r = await tier.lookup([s.key for s in segs] + [bytes(16)] + [segs[0].key])
    assert list(r.present) == [True] * len(segs) + [False, True] and r.prefix_len == len(segs)
    if where is not None:
        assert set(r.tier[: len(segs)]) == {where} and r.tier[len(segs)] == ""
    for s in segs:
        got = await tier.get(s.key)
        assert (
            got is not None
            and torch.equal(got.payload, s.payload)
            and got.tokens.tolist() == s.tokens.tolist()
        )
        seen = []
        async for c in tier.get_layers(s.key):  # data is valid until the iterator advances
            assert torch.equal(decode_layer(c.header, c.layer, c.data), s.layer(c.layer))
            seen.append(c.layer)
        assert seen == list(range(s.num_layers))


async def test_round_trip_cpu_and_disk_restart(server: ServerProcess) -> None:
    tier = RemoteTier(target=server.target)
    segs = [segment(i) for i in range(1, 6)]
    assert all([await tier.put(s.key, s) for s in segs])
    await check_round_trip(tier, segs, "cpu")
    assert await tier.delete(segs[0].key) and not await tier.delete(segs[0].key)
    assert await tier.get(segs[0].key) is None and await tier.contains([segs[0].key]) == [False]
    assert server.stop() == 0  # SIGTERM: drains the write-behind queue into the disk tier
    server.start()
    await check_round_trip(tier, segs[1:], "disk")  # the channel reconnects by itself
    # A hit on disk was promoted: the cpu tier serves it now.
    assert list((await tier.lookup([segs[1].key])).tier) == ["cpu"]
    assert await tier.get(segs[0].key) is None
    st = {t.name: (t.hits, t.misses, t.count) for t in (await tier.server_stats()).tiers}
    # Per tier since the restart: 4 gets from disk, then 4 layer streams from cpu, one miss.
    assert st == {"cpu": (4, 5, 4), "disk": (4, 1, 4)}
    await tier.close()


async def test_get_many_in_order(server: ServerProcess) -> None:
    segs = [segment(i, layers=3) for i in range(10, 14)]
    tier = RemoteTier(target=server.target)
    for s in segs:
        await tier.put(s.key, s)
    keys = [segs[2].key, bytes(16), segs[0].key, segs[3].key]
    with grpc.insecure_channel(server.target) as ch:
        frames = list(pb_grpc.TierKVStub(ch).GetMany(pb.GetManyRequest(keys=keys)))
    kinds = [
        (f.index, f.kind, f.layer) for f in frames if f.kind != pb.SegmentFrame.LAYER or f.data
    ]
    assert kinds[0][:2] == (0, pb.SegmentFrame.HEADER) and (1, pb.SegmentFrame.MISS, 0) in kinds
    assert [i for i, _, _ in kinds] == sorted(i for i, _, _ in kinds)  # one key after another
    for i, want in ((0, segs[2]), (2, segs[0]), (3, segs[3])):
        layers = [f.layer for f in frames if f.index == i and f.kind == pb.SegmentFrame.LAYER]
        assert layers == sorted(layers) and set(layers) == {0, 1, 2}
        data = b"".join(f.data for f in frames if f.index == i)  # small test segment
        assert torch.equal(KVSegment.decode(data).payload, want.payload)
    await tier.close()


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
async def test_round_trip_redis(kind: str, request) -> None:
    redis = request.getfixturevalue("redis_proc" if kind == "standalone" else "redis_cluster")
    args = ["--disk-bytes", "0", "--redis-url", redis.url] + (
        ["--redis-cluster"] if kind == "cluster" else []
    )
    server = ServerProcess(args=args).start()
    try:
        tier = RemoteTier(target=server.target)
        segs = [segment(i) for i in range(20, 24)]
        assert all([await tier.put(s.key, s) for s in segs])
        await asyncio.sleep(0.5)  # the write-behind queue reaches Redis
        server.restart()  # the cpu tier is empty again; Redis still holds everything
        await check_round_trip(tier, segs, "redis")
        assert await tier.delete(segs[0].key)  # from every tier, Redis included
        server.restart()
        assert await tier.contains([s.key for s in segs]) == [False, True, True, True]
        await tier.close()
    finally:
        server.stop(kill=True)


async def test_redis_killed_mid_run_gives_misses_then_recovers(redis_proc: RedisProcess) -> None:
    server = ServerProcess(
        args=["--disk-bytes", "0", "--redis-url", redis_proc.url, "--redis-timeout-s", "0.3"]
    ).start()
    tier = RemoteTier(target=server.target)
    try:
        a, b = segment(30), segment(31)
        assert await tier.put(a.key, a)
        await asyncio.sleep(0.3)
        server.restart()  # now a lives in Redis only
        redis_proc.stop(kill=True)
        assert await tier.get(a.key) is None and await tier.contains([a.key]) == [False]
        assert [c async for c in tier.get_layers(a.key)] == []
        assert await tier.put(b.key, b)  # the cpu tier still works
        assert torch.equal((await tier.get(b.key)).payload, b.payload)
        redis_proc.start()  # back, empty
        c = segment(32)
        assert await tier.put(c.key, c)
        for _ in range(100):  # the tier's backoff ends and the queued write lands
            if await asyncio.to_thread(_redis_has, redis_proc.port, c.key):
                break
            await asyncio.sleep(0.1)
            await tier.put(c.key, c)
        assert await asyncio.to_thread(_redis_has, redis_proc.port, c.key)
        st = await tier.server_stats()
        assert {t.name for t in st.tiers} == {"cpu", "redis"} and [
            t for t in st.tiers if t.name == "redis"
        ][0].errors >= 1
    finally:
        await tier.close()
        server.stop(kill=True)


def _redis_has(port: int, key: bytes) -> bool:
    import redis

    return bool(redis.Redis(port=port).exists(f"tierkv:default:{key.hex()}"))


def test_health_reflection_metrics_and_stats_cli(capsys) -> None:
    mport = free_port()
    server = ServerProcess(args=["--metrics-port", str(mport)]).start()
    try:
        with grpc.insecure_channel(server.target) as ch:
            h = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="tierkv.v1.TierKV")
            )
            assert h.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            [resp] = list(
                refl.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
            )
            names = {s.name for s in resp.list_services_response.service}
            assert {"tierkv.v1.TierKV", "grpc.health.v1.Health"} <= names
            s = segment(40)
            assert pb_grpc.TierKVStub(ch).Put(put_frames(s.key, s)).stored
            list(pb_grpc.TierKVStub(ch).Get(pb.GetRequest(key=s.key)))
        import time

        time.sleep(1.5)  # tier stats are snapshotted once a second
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
        )
        for name in (
            "tierkv_rpc_seconds_bucket{",
            'tierkv_rpc_total{code="OK",method="Put"}',
            'tierkv_tier_hits_total{tier="cpu"}',
            'tierkv_tier_misses_total{tier="disk"}',
            'tierkv_tier_evictions_total{tier="cpu"}',
            'tierkv_tier_errors_total{tier="cpu"}',
            'tierkv_tier_bytes_in{tier="cpu"}',
            'tierkv_tier_used_bytes{tier="cpu"}',
        ):
            assert name in text, name
        assert (
            cli.main(["health", "--target", server.target]) == 0
            and "SERVING" in capsys.readouterr().out
        )
        assert (
            cli.main(["stats", "--target", server.target]) == 0
        )  # in-process: no second torch import
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("namespace default: 0 lookups, 1 puts, 1 gets")
        assert lines[1].split()[:4] == ["tier", "segments", "used", "capacity"]
        assert (
            lines[2].split()[:2] == ["cpu", "1"]
            and "100.0%" in lines[2]
            and lines[3].startswith("disk")
        )
        assert cli.main(["stats", "--target", f"127.0.0.1:{free_port()}", "--timeout", "1"]) == 1
        assert "no answer" in capsys.readouterr().err
        assert cli.main(["health", "--target", f"127.0.0.1:{free_port()}", "--timeout", "1"]) == 1
    finally:
        server.stop(kill=True)
