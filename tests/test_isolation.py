"""Tenants and transport security. tests/test_server_auth.py already shows every RPC is
UNAUTHENTICATED without a valid token and one put/get pair per namespace; here two tenants
run random op sequences on the same keys through every tier (cpu, disk, redis) and a
restart, the connector shares nothing across tokens, TLS refuses plaintext and foreign
CAs, and the Redis tier works over rediss:// against a TLS-only redis-server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_connector import CHUNK, GREEDY, HIT, PROMPT, engine
from tests.test_server_auth import self_signed
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.launch import RedisProcess, ServerProcess
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.proto import tierkv_pb2 as pb
from tierkv.proto import tierkv_pb2_grpc as pb_grpc
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.redis_tier import RedisTier, RedisTierConfig
from tierkv.storage_backends.segment import KVSegment

TOKENS = {"a": "token-tenant-a-01", "b": "token-tenant-b-02"}
NS = {"a": "tenant-a", "b": "tenant-b"}


@dataclass
class TlsRedisProcess(RedisProcess):
    """A redis-server that speaks TLS only (its plaintext port is off), with the given PEM
    certificate and key (tests make a self-signed pair); `url` is rediss:// with the CA."""

    cert: Path | None = None
    key: Path | None = None

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"

    def start(self) -> TlsRedisProcess:
        self.extra = [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.cert),
            "--tls-key-file",
            str(self.key),
            "--tls-ca-cert-file",
            str(self.cert),
            "--tls-auth-clients",
            "no",
        ]
        RedisProcess.start(self)
        return self


def segment(seed: int, tenant: str) -> KVSegment:
    """The same key for both tenants, different KV."""
    kv = torch.full((2, 2, 8, 2, 8), float(seed) + (0.5 if tenant == "b" else 0.0)).half()
    return KVSegment.from_tensor(
        kv, key=seed.to_bytes(16, "little"), tokens=range(8), fingerprint=b"iso"
    )


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    r = RedisProcess().start()
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    tokens = ",".join(f"{TOKENS[t]}={NS[t]}" for t in TOKENS)
    s = ServerProcess(
        args=[
            "--tokens",
            tokens,
            "--redis-url",
            r.url,
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--cpu-bytes",
            "1MiB",
        ]
    ).start()  # a small cpu tier: entries move to disk
    s.cert, s.redis = cert, r
    yield s
    s.stop(kill=True)
    r.stop(kill=True)


def client(server, tenant: str) -> RemoteTier:
    return RemoteTier(
        target=server.target, token=TOKENS[tenant], tls_ca=str(server.cert), retries=3, timeout_s=10
    )


ops = st.lists(
    st.tuples(
        st.sampled_from("ab"),
        st.sampled_from(["put", "get", "delete", "lookup"]),
        st.integers(0, 5),
    ),
    min_size=5,
    max_size=25,
)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(seq=ops)
async def test_two_tenants_same_keys_never_cross(auth_server, seq) -> None:
    """A model of what each tenant stored; the server must agree after every op, and a
    tenant's counts (Stats) never include the other's entries."""
    tiers = {t: client(auth_server, t) for t in "ab"}
    model: dict[str, set[int]] = {"a": set(), "b": set()}
    try:
        for t in "ab":  # a clean slate for this example
            for k in range(6):
                await tiers[t].delete(k.to_bytes(16, "little"))
        for tenant, op, k in seq:
            tier, key = tiers[tenant], k.to_bytes(16, "little")
            if op == "put":
                assert await tier.put(key, segment(k, tenant))
                model[tenant].add(k)
            elif op == "delete":
                assert await tier.delete(key) == (k in model[tenant])
                model[tenant].discard(k)
            elif op == "lookup":
                assert await tier.contains([key]) == [k in model[tenant]]
            else:
                got = await tier.get(key)
                assert (got is not None) == (k in model[tenant])
                if got is not None:
                    assert torch.equal(got.payload, segment(k, tenant).payload)  # never the other's
        for t in "ab":
            st_ = await tiers[t].server_stats()
            assert st_.namespace == NS[t]
            # Counts lag while entries move between tiers, but never include the other's.
            assert all(x.count <= len(model[t]) for x in st_.tiers), (st_.tiers, model)
    finally:
        for t in tiers.values():
            await t.close()


async def test_namespaces_survive_restart_and_redis(auth_server) -> None:
    a, b = client(auth_server, "a"), client(auth_server, "b")
    try:
        segs = [segment(100 + i, "a") for i in range(4)]
        for s in segs:
            assert await a.put(s.key, s)
        auth_server.restart()  # SIGTERM drains to disk and redis; the cpu tier starts empty
        assert await b.contains([s.key for s in segs]) == [False] * 4
        assert all([await b.get(s.key) is None for s in segs]) and not any(
            [await b.delete(s.key) for s in segs]
        )
        r = redis.Redis(port=auth_server.redis.port)
        for s in segs:
            assert r.exists(f"tierkv:{NS['a']}:{s.key.hex()}") and not r.exists(
                f"tierkv:{NS['b']}:{s.key.hex()}"
            )
        for s in segs:  # a still has every one, from disk
            assert torch.equal((await a.get(s.key)).payload, s.payload)
    finally:
        await a.close()
        await b.close()


def test_connector_tenants_share_nothing(auth_server) -> None:
    cfg = dict(
        chunk_size=CHUNK,
        tiers=TiersConfig(cpu_bytes=0),
        remote=f"grpcs://{auth_server.target}",
        tls_ca=str(auth_server.cert),
    )
    a = TierKVConnector(ConnectorConfig(token=TOKENS["a"], namespace=NS["a"], **cfg))
    b = TierKVConnector(ConnectorConfig(token=TOKENS["b"], namespace=NS["b"], **cfg))
    b_as_a = TierKVConnector(
        ConnectorConfig(token=TOKENS["b"], namespace=NS["a"], **cfg)
    )  # a's salt, b's token
    try:
        for conn in (a, b):
            engine(conn).generate([PROMPT], GREEDY, use_tqdm=False)
            conn.flush()
        assert a.stats.saved_chunks == b.stats.saved_chunks == 6  # two independent copies
        out = engine(b_as_a).generate([PROMPT], GREEDY, use_tqdm=False)[0]
        assert out.metrics.external_tokens == 0  # the token decides the namespace, not the salt
        assert (
            engine(a).generate([PROMPT], GREEDY, use_tqdm=False)[0].metrics.external_tokens == HIT
        )
    finally:
        for c in (a, b, b_as_a):
            c.close()


def test_tls_refuses_plaintext_and_foreign_ca(auth_server, tmp_path) -> None:
    req = pb.LookupRequest(keys=[b"\xff" * 16])  # a key no test stores
    md = (("authorization", f"Bearer {TOKENS['a']}"),)
    with grpc.insecure_channel(auth_server.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.TierKVStub(ch).Lookup(req, metadata=md, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    other_ca, _ = self_signed(tmp_path)  # a valid certificate, but not the server's
    with grpc.secure_channel(
        auth_server.target, grpc.ssl_channel_credentials(other_ca.read_bytes())
    ) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.TierKVStub(ch).Lookup(req, metadata=md, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(
        auth_server.target, grpc.ssl_channel_credentials(auth_server.cert.read_bytes())
    ) as ch:
        assert list(pb_grpc.TierKVStub(ch).Lookup(req, metadata=md, timeout=5).present) == [False]


async def test_redis_tier_over_tls(tmp_path) -> None:
    cert, key = self_signed(tmp_path)
    r = TlsRedisProcess(cert=cert, key=key).start()
    try:
        tier = RedisTier(RedisTierConfig(url=r.url))
        s = segment(7, "a")
        assert await tier.put(s.key, s) and torch.equal((await tier.get(s.key)).payload, s.payload)
        assert [c.layer async for c in tier.get_layers(s.key)] == [0, 1]
        await tier.close()
        plain = RedisTier(RedisTierConfig(url=f"redis://127.0.0.1:{r.port}/0", timeout_s=0.5))
        assert (
            await plain.get(s.key) is None and plain.stats().errors >= 1
        )  # plaintext: a miss, no exception
        await plain.close()
        server = ServerProcess(args=["--redis-url", r.url, "--disk-bytes", "0"]).start()
        try:
            remote = RemoteTier(target=server.target)
            got = await remote.get(s.key)  # the server's redis tier reads it over TLS
            assert got is not None and torch.equal(got.payload, s.payload)
            assert list((await remote.lookup([s.key])).tier) == ["cpu"]  # promoted from redis
            await remote.close()
        finally:
            server.stop(kill=True)
    finally:
        r.stop(kill=True)


async def test_a_delete_is_final_even_with_background_writes_queued(tmp_path) -> None:
    """Found by the tenant test above: a segment deleted while its demotion (or write-through)
    was still queued came back once the job ran. A tenant's Delete must stick."""
    from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
    from tierkv.storage_backends.disk_tier import DiskTier, DiskTierConfig
    from tierkv.storage_backends.store import TieredStore

    cpu = CpuTier(CpuTierConfig(capacity_bytes=8192, page_bytes=4096))  # room for one segment
    store = TieredStore([cpu, DiskTier(DiskTierConfig(root=tmp_path, fsync=False))])
    segs = [segment(i, "a") for i in range(6)]
    for s in segs:  # each put evicts the one before: demotions and write-throughs queued
        assert await store.put(s.key, s)
    for s in segs:
        assert await store.delete(s.key)
    await store.drain()
    assert await store.contains([s.key for s in segs]) == [False] * 6
    assert all([await store.get(s.key) is None for s in segs]) and not list(tmp_path.rglob("*.tkv"))
    await store.close()
