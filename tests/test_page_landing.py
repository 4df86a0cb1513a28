"""PUTs received straight into the cpu tier's pages (storage_backends.page_landing): landings
interleaved with puts, deletes and evictions keep the allocator and the budget exact
(hypothesis), and a real server's data plane stores only whole, checked segments, frees the
pages of a corrupt, cut or unplaceable PUT, and keeps serving."""

from __future__ import annotations

import asyncio
import socket

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.cacheserver.cli import build_store
from tierkv.cacheserver.config import ServerConfig
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.dataplane.protocol import BAD_REQUEST, HEAD, HELLO, OK, PUT, pack
from tierkv.cacheserver.server import Server
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.names import DEFAULT_NAMESPACE as NS
from tierkv.storage_backends.segment import KVSegment, SegmentHeader

PAGE = 4096


def segment(key: bytes, tokens: int, seed: int = 0) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, tokens, 2, 16, generator=g).to(torch.bfloat16)
    return KVSegment.from_tensor(kv, key=key, tokens=list(range(tokens)), fingerprint=b"f" * 16)


def receive(tier: CpuTier, seg: KVSegment, stop: int, flip: int | None) -> bool:
    """Land seg's encoded bytes [0, stop) as a socket would deliver them, a layer at a time;
    commit when whole and checked. Whether the tier holds the key after."""
    raw = bytearray(seg.encode())
    if flip is not None:
        raw[flip % len(raw)] ^= 0x55
    h = SegmentHeader.decode(raw)
    landing = tier.land(seg.key, NS, h)
    if landing is None:
        return False
    try:
        parts = [(0, h.header_nbytes), *h.layers]
        for i, (off, n) in enumerate(parts):
            if off + n > stop or not landing.grow(off + n):
                return False
            at = off
            for v in landing.views(off, off + n):
                v[:] = raw[at : at + len(v)]
                at += len(v)
            if i and not landing.checked(i - 1):
                return False
        return landing.commit()
    finally:
        landing.abort()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["land", "cut", "corrupt", "put", "delete", "lease"]),
            st.integers(0, 5),  # key
            st.integers(1, 40),  # tokens: 1 to 11 pages
            st.integers(0, 1 << 20),  # where a cut or a flip falls
        ),
        max_size=40,
    )
)
def test_landings_keep_pages_and_budget_exact(ops) -> None:
    async def run() -> None:
        tier = CpuTier(CpuTierConfig(capacity_bytes=16 * PAGE, page_bytes=PAGE))
        held = []
        for op, k, tokens, at in ops:
            key = bytes([k]) * 16
            seg = segment(key, tokens, seed=k)
            if op == "land":
                if receive(tier, seg, seg.nbytes, None):
                    got = await tier.get(key)
                    assert got is not None and torch.equal(got.payload, seg.payload)
            elif op == "cut":
                before = (await tier.contains([key]))[0]
                receive(tier, seg, at % seg.nbytes, None)
                assert (await tier.contains([key]))[0] == before
            elif op == "corrupt":
                flip = seg.header.header_nbytes + at % (seg.nbytes - seg.header.header_nbytes)
                before = (await tier.contains([key]))[0]
                assert receive(tier, seg, seg.nbytes, flip) is False
                assert (await tier.contains([key]))[0] == before
            elif op == "put":
                await tier.put(key, seg)
            elif op == "delete":
                await tier.delete(key)
            else:
                held.append(tier.lease(key))
            tier.check_integrity()
            assert tier.landing == [] and tier.reserved_bytes == 0
        for h in held:
            h.release()

    asyncio.run(run())


def raw_session(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), 10)
    sock.sendall(pack(HELLO, 0, b""))
    code, _, n = HEAD.unpack(sock.recv(HEAD.size, socket.MSG_WAITALL))
    assert code == OK and len(sock.recv(n, socket.MSG_WAITALL)) == n
    return sock


def test_data_plane_puts_land_whole_or_free_their_pages(tmp_path) -> None:
    async def run() -> None:
        tiers = TiersConfig(cpu_bytes="1MiB", disk_bytes=0)
        config = ServerConfig(port=0, cache_dir=str(tmp_path), tiers=tiers)
        server = await Server.start(config, build_store(config))
        cpu = server.store.tiers[0]
        assert isinstance(cpu, CpuTier)
        assert server.data is not None
        port = server.data.tcp_port
        loop = asyncio.get_running_loop()

        async def settled() -> None:
            for _ in range(200):
                if not cpu.landing:
                    break
                await asyncio.sleep(0.01)
            cpu.check_integrity()
            assert cpu.landing == [] and cpu.reserved_bytes == 0

        def send(seg: KVSegment, data: bytes, cut: int | None) -> int:
            with raw_session(port) as sock:
                sock.sendall(pack(PUT, 1, seg.key + len(data).to_bytes(8, "little")))
                sock.sendall(data[:cut])
                if cut is not None:
                    return -1  # the client goes away midway
                return int(HEAD.unpack(sock.recv(HEAD.size, socket.MSG_WAITALL))[0])

        try:
            tier = DataTier(target=f"127.0.0.1:{server.port}", shared_memory=False)
            good = segment(b"g" * 16, 256, seed=1)  # one 256 KiB page of the 4
            assert await tier.put(good.key, good)
            got = await tier.get(good.key)
            assert got is not None and torch.equal(got.payload, good.payload)
            await settled()

            bad = segment(b"b" * 16, 256, seed=2)
            flipped = bytearray(bad.encode())
            flipped[-7] ^= 1  # the last layer's checksum fails after every page was taken
            assert await loop.run_in_executor(None, send, bad, bytes(flipped), None) == BAD_REQUEST
            await loop.run_in_executor(None, send, bad, bytes(bad.encode()), bad.nbytes // 2)
            await settled()
            assert (await cpu.contains([bad.key])) == [False]

            # Every page leased: the PUT is read to its end and answered "not stored".
            holds = [cpu.lease(k) for (_, k) in list(cpu.index)]
            big = segment(b"B" * 16, 3500, seed=3)  # 4 pages: its second layer finds no room
            assert await tier.put(big.key, big) is False
            assert (await cpu.contains([big.key])) == [False]
            for h in holds:
                h.release()
            await settled()
            assert await tier.get(good.key) is not None and tier.stats().errors == 0
            assert tier.session_open
            await tier.close()
        finally:
            await server.stop()

    asyncio.run(run())
