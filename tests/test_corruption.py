"""Corruption placed directly where the data lives: disk files of a running (and of a
restarted) cache server, Redis values behind it, and foreign-but-valid segments under the
connector's own keys. Detected by checksum, header or token check, counted, removed, and
never injected. (Tier-level single cases are in tests/test_tiers.py and
tests/test_redis_tier.py; these go through the server's wire and the engine.)"""

from __future__ import annotations

import pytest
import redis
import torch

from tests.test_connector import CHUNK, GREEDY, PROMPT, engine
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.launch import RedisProcess, ServerProcess
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.header import PREFIX, checksum
from tierkv.storage_backends.segment import KVSegment


def segment(seed: int) -> KVSegment:
    kv = torch.randn(3, 2, 32, 2, 16, generator=torch.Generator().manual_seed(seed)).half()
    return KVSegment.from_tensor(
        kv, key=seed.to_bytes(16, "little"), tokens=range(32), fingerprint=b"corrupt"
    )


def flip(b: bytes, at: int) -> bytes:
    out = bytearray(b)
    out[at] ^= 0x40
    return bytes(out)


def with_version(value: bytes, version: int) -> bytes:
    """The same segment claiming another format version (header checksum recomputed, so only
    the version check can refuse it)."""
    magic, _, flags, hn, _ = PREFIX.unpack_from(value)
    return (
        PREFIX.pack(magic, version, flags, hn, checksum(value[PREFIX.size : hn]))
        + value[PREFIX.size :]
    )


HN = segment(0).header.header_nbytes
CORRUPTIONS = {  # what is placed instead of a good value
    "payload flip": lambda v: flip(v, len(v) - 7),
    "header flip": lambda v: flip(v, 100),
    "truncated": lambda v: v[: len(v) // 2],
    "garbage": lambda v: b"\x00not a segment" * 40,
    "other key": lambda v: bytes(segment(777).encode()),
    "format v2": lambda v: with_version(v, 2),
}


async def check_all_refused(tier: RemoteTier, segs: list[KVSegment]) -> None:
    for s in segs:
        assert await tier.get(s.key) is None  # a miss, never the corrupt bytes
    assert await tier.contains([s.key for s in segs]) == [False] * len(segs)  # and removed


@pytest.mark.parametrize("where", ["disk", "redis"])
async def test_corrupt_values_behind_a_running_server(where: str, redis_proc: RedisProcess) -> None:
    args = ["--cpu-bytes", "0"] + (
        ["--disk-bytes", "0", "--redis-url", redis_proc.url] if where == "redis" else []
    )
    server = ServerProcess(args=args).start()
    tier = RemoteTier(target=server.target, retries=0)
    r = redis.Redis(port=redis_proc.port)
    try:
        segs = [segment(i) for i in range(1, len(CORRUPTIONS) + 1)]
        assert all([await tier.put(s.key, s) for s in segs])
        for s, bad in zip(segs, CORRUPTIONS.values()):
            good = bytes(s.encode())
            if where == "disk":
                (server.cache_dir / "disk" / "default" / f"{s.key.hex()}.tkv").write_bytes(
                    bad(good)
                )
            else:
                r.set(f"tierkv:default:{s.key.hex()}", bad(good))
        streamed = [
            c.layer async for c in tier.get_layers(segs[0].key)
        ]  # the payload flip is in the last layer
        assert streamed == [0, 1]
        await check_all_refused(tier, segs[1:])
        st = await tier.server_stats()
        assert [t.errors for t in st.tiers if t.name == where][0] == len(segs)
        if where == "disk":
            assert not list((server.cache_dir / "disk").rglob("*.tkv"))
        else:
            assert not r.keys("tierkv:*")
    finally:
        await tier.close()
        server.stop(kill=True)


async def test_corrupt_files_are_dropped_when_the_server_restarts() -> None:
    server = ServerProcess(args=["--cpu-bytes", "0"]).start()
    tier = RemoteTier(target=server.target, retries=3)
    try:
        segs = [segment(i) for i in range(10, 10 + len(CORRUPTIONS) + 1)]
        assert all([await tier.put(s.key, s) for s in segs])
        server.stop()
        d = server.cache_dir / "disk" / "default"
        for s, bad in zip(segs, CORRUPTIONS.values()):
            (d / f"{s.key.hex()}.tkv").write_bytes(bad(bytes(s.encode())))
        (d / "notes.txt").write_text("not ours: left alone")
        server.start()
        await check_all_refused(tier, segs[:-1])
        got = await tier.get(segs[-1].key)  # the untouched one is served
        assert got is not None and torch.equal(got.payload, segs[-1].payload)
        assert sorted(p.name for p in d.iterdir()) == sorted(
            [f"{segs[-1].key.hex()}.tkv", "notes.txt"]
        )
    finally:
        await tier.close()
        server.stop(kill=True)


def foreign(value: bytes, how: str) -> bytes:
    """A valid segment under the same key, parent and tokens, but not ours to inject."""
    seg = KVSegment.decode(value)
    s, kv = seg.header, seg.payload.clone()
    kw = dict(key=s.key, parent=s.parent, tokens=s.tokens, base_position=s.base_position)
    if how == "other model":
        return bytes(
            KVSegment.from_tensor(kv, fingerprint=b"another-model-fingerprint", **kw).encode()
        )
    if how == "other dtype":
        return bytes(
            KVSegment.from_tensor(kv.to(torch.bfloat16), fingerprint=s.fingerprint, **kw).encode()
        )
    if how == "other layout":  # the same bytes seen as 4 heads of half the size
        L, _, T, H, D = kv.shape
        return bytes(
            KVSegment.from_tensor(
                kv.reshape(L, 2, T, 2 * H, D // 2), fingerprint=s.fingerprint, **kw
            ).encode()
        )
    if how == "other tokens":
        return bytes(
            KVSegment.from_tensor(
                kv, fingerprint=s.fingerprint, **{**kw, "tokens": s.tokens + 1}
            ).encode()
        )
    return with_version(value, 2)


@pytest.mark.parametrize(
    "how", ["other model", "other dtype", "other layout", "other tokens", "format v2"]
)
def test_foreign_segments_under_our_keys_are_never_injected(
    redis_proc: RedisProcess, how: str
) -> None:
    cold = engine().generate([PROMPT], GREEDY, use_tqdm=False)[0].token_ids
    cfg = ConnectorConfig(chunk_size=CHUNK, tiers=TiersConfig(cpu_bytes=0), remote=redis_proc.url)
    writer = TierKVConnector(cfg)
    r = redis.Redis(port=redis_proc.port)
    try:
        engine(writer).generate([PROMPT], GREEDY, use_tqdm=False)
        writer.flush()
        names = r.keys("tierkv:default:*")
        assert len(names) == 6  # 5 full chunks and the tail
        for n in names:
            r.set(n, foreign(r.get(n), how))
        reader = TierKVConnector(cfg)
        out = engine(reader).generate([PROMPT], GREEDY, use_tqdm=False)[0]
        reader.flush()
        assert out.token_ids == cold and out.metrics.connector["loaded_tokens"] == {}
        assert out.metrics.connector["recomputed_tokens"] == len(PROMPT) - 1
        st = reader.stats
        if how == "format v2":  # refused by the tier's decode: a miss, counted, removed
            assert st.load_rejected == 0 and reader.store.stats().errors >= 1
        else:  # a valid segment of the wrong kind: the connector's header check refuses it
            assert st.load_rejected >= 1
        reader.close()
    finally:
        writer.close()
