"""The same-host data plane: loads over shared memory from a real tierkv-server process,
the region allocator, authentication, namespace isolation, refusals and killed clients."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.dataplane.protocol import (
    BAD_REQUEST,
    GET,
    HEAD,
    HELLO,
    OK,
    RELEASE,
    UNAUTHENTICATED,
    pack,
)
from tierkv.cacheserver.dataplane.region import ALIGN, RangeAllocator
from tierkv.cacheserver.launch import ServerProcess
from tierkv.storage_backends.segment import KVSegment

TOKENS = "alpha-token=tenant-a,beta-token=tenant-b"


def segment(key: bytes | int, seed: int, layers: int = 4) -> KVSegment:
    key = key.to_bytes(16, "little") if isinstance(key, int) else key
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, 64, 2, 64, generator=g).to(torch.bfloat16)
    return KVSegment.from_tensor(kv, key=key, tokens=list(range(64)), fingerprint=b"f" * 16)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(args=["--tokens", TOKENS, "--shm-region-bytes", "8MiB"]).start()
    yield s
    s.stop(kill=True)


def sessions(pid: int) -> int:
    """Data plane regions the server process holds open."""
    n = 0
    for f in Path(f"/proc/{pid}/fd").iterdir():
        try:
            n += "tierkv-session" in os.readlink(f)
        except FileNotFoundError:  # closed since the listing: not a session any more
            pass
    return n


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), max_size=60))
def test_range_allocator_tiles_the_region(ops) -> None:
    a, live = RangeAllocator(16 * ALIGN), []
    for alloc, n in ops:
        if alloc or not live:
            off = a.alloc(n)
            if off is not None:
                assert off % ALIGN == 0 and off + n <= a.size
                assert all(off + n <= o or o + m <= off for o, m in live)  # no overlap
                live.append((off, n))
        else:
            a.release(live.pop(len(live) // 2)[0])
        a.check_integrity()
    for off, _ in live:
        a.release(off)
    a.check_integrity()
    assert a.free == [(0, a.size)] and a.alloc(a.size) == 0
    with pytest.raises(ValueError):
        a.release(ALIGN)  # never allocated


def test_loads_over_shared_memory_equal_the_segment(server) -> None:
    async def run() -> None:
        grpc_tier = RemoteTier(target=server.target, token="alpha-token")
        shm = DataTier(target=server.target, token="alpha-token")
        segs = [segment(bytes([i]) * 16, i) for i in range(8)]
        for s in segs:
            assert await grpc_tier.put(s.key, s)
        for _ in range(3):  # ranges are released and reused: 8 x 3 gets in an 8 MiB region
            for s in segs:
                got = await shm.get(s.key)
                assert got is not None and torch.equal(got.payload, s.payload)
                assert got.tokens.tolist() == s.tokens.tolist()
        assert await shm.get(b"\x77" * 16) is None
        assert shm._session is not None and shm.stats().errors == 0
        assert sessions(server.proc.pid) == 1
        await shm.close()
        await grpc_tier.close()

    asyncio.run(run())


def test_concurrent_loads_batch_and_a_full_region_falls_back_to_grpc(server) -> None:
    """A request's chunks load concurrently: they go out as one GET. 80 segments of 128 KiB
    overflow the 8 MiB region; the ones that do not fit load over gRPC. Every one is right."""

    async def run() -> None:
        shm = DataTier(target=server.target, token="alpha-token")
        segs = [segment(1000 + i, 1000 + i) for i in range(80)]
        for s in segs:  # one by one: 80 concurrent Puts would pass max_streams
            assert await shm.put(s.key, s)
        for _ in range(2):
            got = await asyncio.gather(*(shm.get(s.key) for s in segs))
            assert all(
                g is not None and torch.equal(g.payload, s.payload) for g, s in zip(got, segs)
            )
        assert shm.stats().errors == 0 and shm._session is not None
        await shm.close()

    asyncio.run(run())


def test_a_tenants_region_never_holds_another_namespaces_bytes(server) -> None:
    """b maps its region and scans it: its own payload is there, a's never, even for a's key."""

    async def run() -> None:
        a = RemoteTier(target=server.target, token="alpha-token")
        b = DataTier(target=server.target, token="beta-token")
        secret, mine = segment(b"s" * 16, 1), segment(b"m" * 16, 2)
        assert await a.put(secret.key, secret)
        assert await b.put(mine.key, mine)
        assert await b.get(secret.key) is None  # a's key, b's namespace: a miss
        assert await b.get(mine.key) is not None
        assert b._session is not None
        region = bytes(b._session.region.map)
        probe = lambda s: s.payload[0, 0, 0].contiguous().view(torch.uint8).numpy().tobytes()
        assert probe(mine) in region  # the scan finds what is there
        assert probe(secret) not in region
        await a.close()
        await b.close()

    asyncio.run(run())


def raw_session(server, token: str) -> tuple[socket.socket, int, bytes]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    path = next(Path(server.cache_dir).glob("data-*.sock"))
    sock.connect(str(path))
    sock.sendall(pack(HELLO, 0, token.encode()))
    msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    code, _, n = HEAD.unpack_from(msg)
    for fd in fds:
        os.close(fd)
    return sock, code, msg[HEAD.size : HEAD.size + n]


def reply(sock: socket.socket) -> tuple[int, bytes]:
    head = b""
    while len(head) < HEAD.size:
        more = sock.recv(HEAD.size - len(head))
        if not more:
            return -1, b""
        head += more
    code, _, n = HEAD.unpack(head)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return code, body


def test_bad_tokens_and_malformed_requests_are_refused(server) -> None:
    sock, code, why = raw_session(server, "wrong-token")
    assert code == UNAUTHENTICATED and b"token" in why
    sock.close()
    cases = [
        pack(99, 0),  # unknown op
        pack(GET, 2, b"k" * 16),  # count and body disagree
        pack(GET, 0),  # no keys
        pack(RELEASE, 1, (12345).to_bytes(8, "little")),  # a range never handed out
        HEAD.pack(GET, 1, 1 << 40),  # a body far past the limit
    ]
    for msg in cases:
        sock, code, _ = raw_session(server, "alpha-token")
        assert code == OK
        sock.sendall(msg)
        code, why = reply(sock)
        assert code == BAD_REQUEST and why, msg[:16]
        assert sock.recv(1) == b""  # and the session is closed
        sock.close()

    async def still_serves() -> bool:
        t = DataTier(target=server.target, token="alpha-token")
        s = segment(b"v" * 16, 5)
        ok = await t.put(s.key, s) and await t.get(s.key) is not None
        await t.close()
        return bool(ok)

    assert asyncio.run(still_serves())
    deadline = time.monotonic() + 5
    while sessions(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sessions(server.proc.pid) == 0


CLIENT = """
import asyncio, sys, torch
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.storage_backends.segment import KVSegment
async def main():
    t = DataTier(target=sys.argv[1], token="alpha-token")
    kv = torch.ones(2, 2, 64, 2, 64, dtype=torch.bfloat16)
    s = KVSegment.from_tensor(kv, key=b"q" * 16, tokens=list(range(64)), fingerprint=b"f" * 16)
    assert await t.put(s.key, s) and await t.get(s.key) is not None
    print("ready", flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


def test_a_killed_client_leaks_no_region(server) -> None:
    before = sessions(server.proc.pid)
    p = subprocess.Popen(
        [sys.executable, "-c", CLIENT, server.target], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        assert sessions(server.proc.pid) == before + 1
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 10
        while sessions(server.proc.pid) > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sessions(server.proc.pid) == before
    finally:
        p.kill()


def test_data_plane_off_loads_over_grpc(tmp_path) -> None:
    s = ServerProcess(args=["--data-socket", "", "--data-port", "-1"]).start()
    try:

        async def run() -> None:
            t = DataTier(target=s.target)
            seg = segment(b"g" * 16, 3)
            assert await t.put(seg.key, seg)
            got = await t.get(seg.key)
            assert got is not None and torch.equal(got.payload, seg.payload)
            assert t._session is None and t.stats().errors == 0
            await t.close()

        asyncio.run(run())
        assert not list(Path(s.cache_dir).glob("data-*.sock"))
    finally:
        s.stop(kill=True)
