"""The clients bench.tcp_port compares, each holding one connection for the whole run (as a
connector holds its session): raw loopback TCP, Redis, and tierkv-server over gRPC, shared
memory and its TCP data port. Each `round(seg, reps)` puts `reps` fresh copies of the segment's
bytes and gets each back: (seconds per put, the whole batch over reps; median seconds per get).
Every client compares the first value it gets back with what it put, once per size."""

from __future__ import annotations

import socket
import statistics
import time

import redis.asyncio as aioredis
import torch

from bench.server import HDR, Staging, _recv_into, tcp_server
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.storage_backends.segment import KVSegment


class Raw:
    """One socket per size to a loopback server that sends or swallows n bytes."""

    def __init__(self, sizes: list[int]) -> None:
        self.servers = {n: tcp_server(n) for n in sizes}
        self.conns = {
            n: socket.create_connection(("127.0.0.1", port))
            for n, (_, port) in self.servers.items()
        }
        for c in self.conns.values():
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def round(self, seg: KVSegment, reps: int) -> tuple[float, float]:
        n = seg.nbytes
        conn, buf = self.conns[n], memoryview(bytearray(n))
        t0 = time.perf_counter()
        for _ in range(reps):
            conn.sendall(HDR.pack(b"P", n))
            conn.sendall(buf)
            conn.recv(1)
        put_s = (time.perf_counter() - t0) / reps
        gets = []
        for _ in range(reps):
            t0 = time.perf_counter()
            conn.sendall(HDR.pack(b"G", n))
            _recv_into(conn, buf)
            gets.append(time.perf_counter() - t0)
        return put_s, statistics.median(gets)

    def close(self) -> None:
        for c in self.conns.values():
            c.close()
        for proc, _ in self.servers.values():
            proc.kill()


class Redis:
    """redis-py's asyncio client: SET and GET of the encoded segment."""

    def __init__(self, url: str) -> None:
        self.r = aioredis.Redis.from_url(url)
        self.serial = 0
        self.checked: set[int] = set()

    async def round(self, seg: KVSegment, reps: int) -> tuple[float, float]:
        value = seg.encode()
        keys = [f"bench:{self.serial + i}" for i in range(reps)]
        self.serial += reps
        t0 = time.perf_counter()
        for k in keys:
            await self.r.set(k, memoryview(value))
        put_s = (time.perf_counter() - t0) / reps
        gets = []
        for k in keys:
            t0 = time.perf_counter()
            got = await self.r.get(k)
            gets.append(time.perf_counter() - t0)
            if len(value) not in self.checked:
                if got != bytes(value):
                    raise RuntimeError("Redis returned other bytes than were put")
                self.checked.add(len(value))
        await self.r.delete(*keys)
        return put_s, statistics.median(gets)

    async def close(self) -> None:
        await self.r.aclose()


class Tierkv:
    """One tierkv client: "grpc" (RemoteTier), "shm" or "tcp" (DataTier, over `stripes`
    connections)."""

    def __init__(self, target: str, path: str, stripes: int = 1) -> None:
        self.path = path
        self.tier = (
            RemoteTier(target=target)
            if path == "grpc"
            else DataTier(target=target, shared_memory=path == "shm", stripes=stripes)
        )
        self.serial = 0
        self.checked: set[int] = set()

    def _copies(self, seg: KVSegment, n: int) -> list[KVSegment]:
        out = []
        for _ in range(n):
            self.serial += 1
            key = (self.serial + (1 << 40)).to_bytes(16, "little")
            s = KVSegment.from_tensor(
                seg.payload, key=key, tokens=seg.tokens, fingerprint=seg.header.fingerprint
            )
            s.header.checksums = seg.compute_checksums()  # the same payload: not recomputed
            out.append(s)
        return out

    async def round(self, seg: KVSegment, reps: int) -> tuple[float, float]:
        segs = self._copies(seg, reps)
        t0 = time.perf_counter()
        for s in segs:
            if not await self.tier.put(s.key, s):
                raise RuntimeError(f"tierkv {self.path} did not store a put")
        put_s = (time.perf_counter() - t0) / reps
        out = torch.empty_like(seg.payload)  # reused, as a connector's staging buffer
        gets = []
        for s in segs:
            t0 = time.perf_counter()
            got = await self.tier.get(s.key, out=out)
            gets.append(time.perf_counter() - t0)
            if got is None:
                raise RuntimeError(f"tierkv {self.path} missed a key it stored")
            if seg.nbytes not in self.checked:
                if not torch.equal(got.payload, seg.payload):
                    raise RuntimeError(f"tierkv {self.path} returned other bytes than were put")
                self.checked.add(seg.nbytes)
        self._check_path()
        for s in segs:
            await self.tier.delete(s.key)
        return put_s, statistics.median(gets)

    async def stream(self, seg: KVSegment, n: int, reps: int) -> float:
        """Median seconds of one STREAM of n keys of seg's size (a request's chunks; over gRPC,
        a Get stream per key)."""
        segs = self._copies(seg, n)
        for s in segs:
            assert await self.tier.put(s.key, s)
        sink = Staging([torch.empty_like(seg.payload) for _ in segs], seg.layer(0).nbytes)
        keys = [s.key for s in segs]
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            await self.tier.stream(keys, "default", sink)
            times.append(time.perf_counter() - t0)
        if not all(torch.equal(b, seg.payload) for b in sink.bufs):
            raise RuntimeError(f"tierkv {self.path} streamed other bytes than were put")
        self._check_path()
        for k in keys:
            await self.tier.delete(k)
        return statistics.median(times)

    def _check_path(self) -> None:
        t = self.tier
        if t.stats().errors or (isinstance(t, DataTier) and not t.session_open):
            raise RuntimeError(f"the {self.path} path failed over; the benchmark is broken")

    async def close(self) -> None:
        await self.tier.close()
