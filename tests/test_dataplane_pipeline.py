"""Pipelined GETs on one data plane session, against a real tierkv-server process over TCP and
shared memory: many concurrent gets of keys of different sizes (misses among them) overlap on
the one session and each returns its own key's bytes; an exchange cancelled midway breaks only
its session, whose waiting exchanges raise at once, and the tier's later gets are right (over
gRPC, then over a fresh session)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from tests.test_server_auth import self_signed
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.dataplane.client_session import Want
from tierkv.cacheserver.dataplane.protocol import GET, pack
from tierkv.cacheserver.launch import ServerProcess
from tierkv.storage_backends.segment import KVSegment

PATHS = pytest.mark.parametrize("shared_memory", [False, True], ids=["tcp", "shm"])


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(args=["--cpu-bytes", "256MiB", "--disk-bytes", "0"]).start()
    yield s
    s.stop(kill=True)


def segment(k: int, tokens: int) -> KVSegment:
    """Key k's own content, tokens x 1 KiB (4 layers)."""
    g = torch.Generator().manual_seed(k)
    kv = torch.randn(4, 2, tokens, 2, 32, generator=g).to(torch.bfloat16)
    return KVSegment.from_tensor(kv, key=key(k), tokens=list(range(tokens)), fingerprint=b"p")


def key(k: int) -> bytes:
    return k.to_bytes(2, "little") * 8


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


async def stored(t: DataTier, n: int) -> dict[bytes, KVSegment]:
    segs = [segment(k, [16, 256, 1024, 4096][k % 4]) for k in range(n)]  # 16 KiB to 4 MiB
    for s in segs:
        assert await t.put(s.key, s)
    return {s.key: s for s in segs}


async def readers(t: DataTier, segs: dict[bytes, KVSegment], rounds: int = 3) -> int:
    """Concurrent readers, each of its own keys and misses, arriving at different times (reader
    i yields i loop turns between gets): GETs go out while others are in flight. Every answer
    is its own key's bytes or, for a key never stored, a miss; the number of gets."""
    keys = list(segs) + [key(1000 + i) for i in range(6)]  # never stored: misses

    async def reader(i: int) -> int:
        mine = keys[i::8]
        for _ in range(rounds):
            for k in mine:
                got = await t.get(k, out=None if i % 2 else torch.empty(4 << 20, dtype=torch.uint8))
                if k not in segs:
                    assert got is None
                    continue
                assert got is not None and got.key == k
                assert raw(got.payload) == raw(segs[k].payload), "another key's bytes"
                for _ in range(i):
                    await asyncio.sleep(0)
        return rounds * len(mine)

    return sum(await asyncio.gather(*(reader(i) for i in range(8))))


@PATHS
def test_concurrent_gets_overlap_on_one_session(server: ServerProcess, shared_memory) -> None:
    async def run() -> None:
        t = DataTier(target=server.target, shared_memory=shared_memory)
        segs = await stored(t, 24)
        s = t._session
        assert s is not None and (s.region is not None) == shared_memory
        assert await readers(t, segs) == 3 * 30
        assert t._session is s and t.stats().errors == 0  # one session, never dropped
        assert s.max_in_flight >= 2  # a GET went out before the reply to another was read
        await t.close()

    asyncio.run(run())


def test_gets_and_puts_pipeline_over_tls(tmp_path) -> None:
    """Over TLS one task's request is encrypted and sent while another's reply is decrypted:
    records never interleave, and every get and put lands whole."""
    cert, tls_key = self_signed(tmp_path)
    args = ["--tls-cert", str(cert), "--tls-key", str(tls_key), "--cpu-bytes", "256MiB"]
    server = ServerProcess(args=args).start()

    async def run() -> None:
        t = DataTier(target=server.target, tls_ca=str(cert), shared_memory=False)
        segs = await stored(t, 12)
        late = [segment(k, 1024) for k in range(100, 106)]
        s = t._session
        assert s is not None and s.conn.tls is not None
        n, saved = await asyncio.gather(
            readers(t, segs, rounds=2), asyncio.gather(*(t.put(x.key, x) for x in late))
        )
        assert n == 36 and all(saved)
        for x in late:
            got = await t.get(x.key)
            assert got is not None and raw(got.payload) == raw(x.payload)
        assert t._session is s and t.stats().errors == 0 and s.max_in_flight >= 2
        await t.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(kill=True)


@PATHS
def test_a_cancelled_exchange_breaks_only_its_session(server: ServerProcess, shared_memory) -> None:
    async def run() -> None:
        t = DataTier(target=server.target, shared_memory=shared_memory, retry_s=0.3)
        other = DataTier(target=server.target, shared_memory=shared_memory)
        segs = await stored(t, 12)
        big = [k for k, s in segs.items() if s.payload.numel() >= 1 << 19]  # 1 and 4 MiB
        assert await other.get(big[0]) is not None
        s = t._session
        assert s is not None
        # The test's own exchange holds the turn (its reply unread), so the GETs sent behind
        # it wait for theirs: the first of them is cancelled with its request out.
        async with s.pipe.exchange(lambda: [pack(GET, 1, key(999))]):
            cancelled = asyncio.create_task(s.get([Want(big[0], None)]))
            behind = [asyncio.create_task(s.get([Want(k, None)])) for k in big[1:4]]
            await asyncio.sleep(0)  # a send to an idle socket does not wait: all are out
            assert s.pipe.in_flight == 5 and s.max_in_flight == 5
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert s.broken
            for r in await asyncio.gather(*behind, return_exceptions=True):
                assert isinstance(r, ConnectionError), r  # at once: none read a byte
        with pytest.raises(ConnectionError):  # and so does any later exchange on it
            await s.get([Want(big[0], None)])
        # the tier drops s at its next get and loads over gRPC meanwhile: right bytes
        assert await readers(t, segs, rounds=1) == 18
        assert t._session is None or t._session is not s
        await asyncio.sleep(0.4)  # retry_s: a fresh session
        assert await readers(t, segs, rounds=1) == 18
        assert t._session is not None and t._session is not s and not t._session.broken
        o = other._session  # another tier's session never noticed
        assert await other.get(big[1]) is not None and other._session is o
        assert other.stats().errors == 0
        await t.close()
        await other.close()

    asyncio.run(run())


def test_a_stream_cancelled_midway_leaves_concurrent_gets_right(server: ServerProcess) -> None:
    """A STREAM task cancelled midway (the caller gave up) on the session the gets share."""

    class Slow:  # a sink whose first ready() waits: the stream is cancelled there
        def __init__(self) -> None:
            self.bufs: dict[int, bytearray] = {}

        def open(self, i: int, h) -> bool:
            self.bufs[i] = bytearray(h.payload_raw_nbytes)
            self.n = h.layer_raw_nbytes
            return True

        def into(self, i: int, layer: int) -> memoryview:
            return memoryview(self.bufs[i])[layer * self.n : (layer + 1) * self.n]

        def drop(self, i: int, why: str) -> None:
            pass

        async def ready(self, layer: int) -> None:
            await asyncio.sleep(10)

    async def run() -> None:
        t = DataTier(target=server.target, shared_memory=False, retry_s=0.2)
        segs = await stored(t, 12)
        s = t._session
        assert s is not None
        task = asyncio.create_task(t.stream(list(segs)[:4], "default", Slow()))
        gets = asyncio.create_task(readers(t, segs, rounds=2))
        await asyncio.sleep(0.2)  # the stream is in its first ready(), GETs queued behind it
        assert s.pipe.in_flight >= 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert s.broken and t._session is not s
        assert await gets == 36
        await asyncio.sleep(0.3)
        assert await readers(t, segs, rounds=1) == 18 and t._session is not None
        await t.close()

    asyncio.run(run())
