"""Cache server throughput and latency: `python -m bench.server [--quick]`.

One run measures put and get of 1, 4 and 32 MiB segments by 1 and 4 concurrent clients, and
of 256 KiB segments by 64, for tierkv-server's cpu tier over gRPC, over its same-host
shared-memory data plane and over its TCP data port (puts over the same path), tierkv-server's
redis tier, raw redis-py SET/GET of the same bytes, a raw loopback TCP transfer (the ceiling
of a socket) and a memcpy of the same bytes (the ceiling of shared memory), plus Lookup
latency for 64 keys. The STREAM rows are the connector's load: one client asks for all the
keys (as many as the other rows' clients) in one layer-major STREAM; they have no put.
Servers are real processes on loopback; clients share this process' event loop.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import statistics
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import torch
from tqdm import tqdm

from bench.common import goal, parser, print_table, write_results
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.launch import RedisProcess, ServerProcess
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.sizes import MiB

HDR = struct.Struct("<cQ")  # op (b"G" or b"P"), length


def make_segment(mib: float, seed: int) -> KVSegment:
    """Bench-model layout (8 layers, 2 KV heads, head_dim 64, bf16): 4 KiB per token."""
    tokens = int(mib * MiB) // 4096
    kv = torch.randn(8, 2, tokens, 2, 64, generator=torch.Generator().manual_seed(seed)).to(
        torch.bfloat16
    )
    return KVSegment.from_tensor(
        kv,
        key=seed.to_bytes(16, "little"),
        tokens=torch.arange(tokens) % 32000,
        fingerprint=b"bench",
    )


def tcp_server(nbytes: int) -> tuple[multiprocessing.Process, int]:
    """Loopback server process (as the other servers are): 'G' sends n bytes, 'P' reads n, acks."""
    srv = socket.create_server(("127.0.0.1", 0))
    proc = multiprocessing.get_context("fork").Process(
        target=_tcp_serve, args=(srv, nbytes), daemon=True
    )
    proc.start()
    port = srv.getsockname()[1]
    srv.close()  # the child holds its own copy
    return proc, port


def _tcp_serve(srv: socket.socket, nbytes: int) -> None:
    payload = memoryview(bytearray(nbytes))

    def serve(conn: socket.socket) -> None:
        sink = memoryview(bytearray(nbytes))
        with conn:
            while head := conn.recv(HDR.size, socket.MSG_WAITALL):
                op, n = HDR.unpack(head)
                if op == b"G":
                    conn.sendall(payload[:n])
                else:
                    _recv_into(conn, sink[:n])
                    conn.sendall(b"k")

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _recv_into(conn: socket.socket, mv: memoryview) -> None:
    got = 0
    while got < len(mv):
        n = conn.recv_into(mv[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


async def rounds(fn: Callable[[int, int], Awaitable[None]], clients: int, repeat: int) -> float:
    """Median seconds of one round: `clients` concurrent fn(client, round) calls."""
    await asyncio.gather(*(fn(c, -1) for c in range(clients)))  # warm-up
    times = []
    for r in range(repeat):
        t0 = time.perf_counter()
        await asyncio.gather(*(fn(c, r) for c in range(clients)))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def bench_tierkv(
    target: str, segs: dict[int, KVSegment], clients: int, repeat: int, path: str = "grpc"
) -> tuple[float, float]:
    """path: "grpc" (Get streams), "shm" (shared memory) or "tcp" (the TCP data port)."""
    tiers = [
        RemoteTier(target=target)
        if path == "grpc"
        else DataTier(target=target, shared_memory=path == "shm")
        for _ in range(clients)
    ]
    seg = next(iter(segs.values()))
    keys = {
        (c, r): (c * 1000 + r + 7).to_bytes(16, "little")
        for c in range(clients)
        for r in range(-1, repeat)
    }

    async def put(c: int, r: int) -> None:
        s = KVSegment.from_tensor(
            seg.payload, key=keys[(c, r)], tokens=seg.tokens, fingerprint=seg.header.fingerprint
        )
        s.header.checksums = seg.compute_checksums()  # same payload: skip recomputing
        assert await tiers[c].put(s.key, s)

    outs = [
        torch.empty_like(seg.payload) for _ in range(clients)
    ]  # reused, as a connector's staging buffer

    async def get(c: int, r: int) -> None:
        assert await tiers[c].get(keys[(c, r)], out=outs[c]) is not None

    t_put = await rounds(put, clients, repeat)
    t_get = await rounds(get, clients, repeat)
    if path != "grpc" and any(t.stats().errors or not t.session_open for t in tiers):
        raise RuntimeError(f"the {path} data plane was not used; the benchmark is broken")
    for t in tiers:
        for r in range(-1, repeat):
            await t.delete(keys[(tiers.index(t), r)])
        await t.close()
    return t_put, t_get


@dataclass(slots=True)
class Staging:
    """A connector-like sink: each key's layers land in its own reused buffer."""

    bufs: list[torch.Tensor]
    layer_bytes: int

    def open(self, i: int, h: SegmentHeader) -> bool:
        return True

    def into(self, i: int, layer: int) -> memoryview:
        n = self.layer_bytes
        return self.bufs[i].view(-1).view(torch.uint8).numpy().data[layer * n : (layer + 1) * n]

    def drop(self, i: int, why: str) -> None:
        raise RuntimeError(f"streamed key {i} dropped: {why}")

    async def ready(self, layer: int) -> None:
        pass


async def bench_stream(target: str, seg: KVSegment, n: int, repeat: int, path: str) -> float:
    """Median seconds of one STREAM of n keys by one client (a request's chunks)."""
    t = DataTier(target=target, shared_memory=path == "shm")
    keys = [(i + 90000).to_bytes(16, "little") for i in range(n)]
    for k in keys:
        s = KVSegment.from_tensor(
            seg.payload, key=k, tokens=seg.tokens, fingerprint=seg.header.fingerprint
        )
        assert await t.put(k, s)
    sink = Staging([torch.empty_like(seg.payload) for _ in keys], seg.layer(0).nbytes)
    times = []
    for r in range(repeat + 1):
        t0 = time.perf_counter()
        await t.stream(keys, "default", sink)
        if r:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    if t.stats().errors or not t.session_open:
        raise RuntimeError(f"the {path} data plane was not used; the benchmark is broken")
    for k in keys:
        await t.delete(k)
    await t.close()
    return statistics.median(times)


def bench_memcpy(nbytes: int, clients: int, repeat: int) -> tuple[float, float]:
    """One copy of the bytes per client (what a shared-memory get cannot beat)."""
    src = [torch.empty(nbytes, dtype=torch.uint8).fill_(1) for _ in range(clients)]
    dst = [torch.empty_like(x) for x in src]
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        for a, b in zip(dst, src):
            a.copy_(b)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times[1:])
    return t, t


async def bench_redis(url: str, value: bytearray, clients: int, repeat: int) -> tuple[float, float]:
    r = aioredis.Redis.from_url(url, max_connections=clients)
    view = memoryview(value)

    async def put(c: int, i: int) -> None:
        await r.set(f"raw:{c}:{i}", view)

    async def get(c: int, i: int) -> None:
        assert len(await r.get(f"raw:{c}:{i}")) == len(value)

    t_put = await rounds(put, clients, repeat)
    t_get = await rounds(get, clients, repeat)
    await r.flushall()
    await r.aclose()
    return t_put, t_get


def bench_tcp(port: int, nbytes: int, clients: int, repeat: int) -> tuple[float, float]:
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(clients)]
    bufs = [bytearray(nbytes) for _ in range(clients)]

    def one(op: bytes, c: int) -> None:
        conns[c].sendall(HDR.pack(op, nbytes))
        if op == b"G":
            _recv_into(conns[c], memoryview(bufs[c]))
        else:
            conns[c].sendall(bufs[c])
            conns[c].recv(1)

    def timed(op: bytes) -> float:
        times = []
        for _ in range(repeat + 1):
            ts = [threading.Thread(target=one, args=(op, c)) for c in range(clients)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    out = timed(b"P"), timed(b"G")
    for c in conns:
        c.close()
    return out


async def bench_lookup(target: str, n: int) -> tuple[float, float]:
    tier = RemoteTier(target=target)
    keys = [i.to_bytes(16, "little") for i in range(64)]
    await tier.lookup(keys)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await tier.lookup(keys)
        lat.append(time.perf_counter() - t0)
    await tier.close()
    lat.sort()
    return lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]


async def main() -> None:
    args = parser("tierkv-server put/get throughput and Lookup latency").parse_args()
    sizes, conc = [1, 4, 32], [1, 4]
    repeat = 3 if args.quick else 7
    redis = RedisProcess(extra=["--maxmemory", "4gb"]).start()
    cpu_srv = ServerProcess(
        args=["--cpu-bytes", "2GiB", "--disk-bytes", "0"]
    ).start()  # holds every round
    redis_srv = ServerProcess(
        args=[
            "--cpu-bytes",
            "0",
            "--disk-bytes",
            "0",
            "--redis-url",
            redis.url,
            "--redis-timeout-s",
            "10",
        ]
    ).start()
    rows = []
    cases: list[tuple[float, int]] = [(mib, c) for mib in sizes for c in conc] + [(0.25, 64)]
    bar = tqdm(total=len(cases) * 8, desc="bench.server", unit="case")
    try:
        for mib, c in cases:
            seg = make_segment(mib, seed=int(mib * 4))
            value = seg.encode()  # the very bytes tierkv moves, for redis-py and TCP
            tcp, port = tcp_server(len(value))
            results = {}
            results["tierkv-server (cpu tier)"] = await bench_tierkv(
                cpu_srv.target, {0: seg}, c, repeat
            )
            bar.update()
            results["tierkv-server (shared memory)"] = await bench_tierkv(
                cpu_srv.target, {0: seg}, c, repeat, path="shm"
            )
            bar.update()
            results["tierkv-server (TCP data plane)"] = await bench_tierkv(
                cpu_srv.target, {0: seg}, c, repeat, path="tcp"
            )
            bar.update()
            for path, name in (("shm", "shared memory"), ("tcp", "TCP data plane")):
                t_stream = await bench_stream(cpu_srv.target, seg, c, repeat, path)
                results[f"tierkv-server STREAM ({name})"] = (None, t_stream)
            bar.update()
            results["tierkv-server (redis tier)"] = await bench_tierkv(
                redis_srv.target, {0: seg}, c, repeat
            )
            bar.update()
            results["redis-py SET/GET"] = await bench_redis(redis.url, value, c, repeat)
            bar.update()
            results["loopback TCP"] = await asyncio.to_thread(
                bench_tcp, port, len(value), c, 3 * repeat
            )
            bar.update()
            results["memcpy"] = bench_memcpy(len(value), c, 3 * repeat)
            bar.update()
            tcp.kill()
            for system, (tp, tg) in results.items():
                gb = c * len(value) / 1e9
                rows.append(
                    {
                        "system": system,
                        "size_mib": mib,
                        "clients": c,
                        "put_gbps": None if tp is None else gb / tp,
                        "get_gbps": gb / tg,
                        "put_ms": None if tp is None else tp * 1e3,
                        "get_ms": tg * 1e3,
                    }
                )
        bar.close()
        p50, p99 = await bench_lookup(cpu_srv.target, 200 if args.quick else 1000)
        rows.append(
            {
                "system": "tierkv-server Lookup 64 keys",
                "size_mib": 0,
                "clients": 1,
                "lookup_p50_ms": p50 * 1e3,
                "lookup_p99_ms": p99 * 1e3,
            }
        )
    finally:
        cpu_srv.stop(kill=True)
        redis_srv.stop(kill=True)
        redis.stop(kill=True)
    print_table(
        rows,
        [
            "system",
            "size_mib",
            "clients",
            "put_gbps",
            "get_gbps",
            "put_ms",
            "get_ms",
            "lookup_p50_ms",
            "lookup_p99_ms",
        ],
    )

    def at(system: str, mib: float, c: int) -> dict:
        return next(
            r for r in rows if r["system"] == system and r["size_mib"] == mib and r["clients"] == c
        )

    grpc_get = at("tierkv-server (cpu tier)", 32, 1)["get_gbps"]
    ratio = lambda a, b, m, c: at(a, m, c)["get_gbps"] / at(b, m, c)["get_gbps"]
    # (what, its system, the baseline, the goal as a share of the baseline), at every size
    shares = [
        (
            "TCP data-plane get / loopback TCP get",
            "tierkv-server (TCP data plane)",
            "loopback TCP",
            0.7,
        ),
        (
            "cpu-tier get via gRPC / loopback TCP get",
            "tierkv-server (cpu tier)",
            "loopback TCP",
            0.7,
        ),
        ("shared-memory get / memcpy", "tierkv-server (shared memory)", "memcpy", 0.5),
        (
            "TCP data-plane STREAM / loopback TCP get",
            "tierkv-server STREAM (TCP data plane)",
            "loopback TCP",
            0.7,
        ),
        ("shared-memory STREAM / memcpy", "tierkv-server STREAM (shared memory)", "memcpy", 0.5),
    ]
    goals = [
        goal(f"{what}, {m} MiB, 1 client", ratio(system, base, m, 1), ">=", x, "ratio")
        for what, system, base, x in shares
        for m in sizes
    ]
    goals += [
        goal(
            "64 x 256 KiB gets (concurrent, or one STREAM), best tierkv path",
            max(
                at(s, 0.25, 64)["get_gbps"]
                for s in (
                    "tierkv-server (cpu tier)",
                    "tierkv-server (shared memory)",
                    "tierkv-server (TCP data plane)",
                    "tierkv-server STREAM (shared memory)",
                    "tierkv-server STREAM (TCP data plane)",
                )
            ),
            ">=",
            1.5,
            "GB/s",
        ),
        goal(
            "cpu-tier get via gRPC / redis-py GET, 32 MiB, 1 client",
            grpc_get / at("redis-py SET/GET", 32, 1)["get_gbps"],
            ">=",
            1.0,
            "ratio",
        ),
        goal("Lookup of 64 keys, p50", rows[-1]["lookup_p50_ms"], "<=", 1.0, "ms"),
    ]

    def plot(ax) -> None:
        systems = [s for s in dict.fromkeys(r["system"] for r in rows) if "Lookup" not in s]
        labels = [f"{m}MiB x{c}" for m, c in cases]
        w = 0.8 / len(systems)
        for i, s in enumerate(systems):
            ax.bar(
                [j + i * w for j in range(len(cases))],
                [at(s, m, c)["get_gbps"] for m, c in cases],
                w,
                label=s,
            )
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cases))], labels)
        ax.set_ylabel("get throughput (GB/s)")
        ax.legend(fontsize=8)

    write_results(
        "server",
        {"quick": args.quick, "repeat": repeat, "sizes_mib": sizes, "clients": conc},
        rows,
        goals,
        plot,
    )


if __name__ == "__main__":
    asyncio.run(main())
