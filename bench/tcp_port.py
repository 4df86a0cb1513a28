"""tierkv-server's data paths against raw loopback TCP, LMCache's lm:// server and Redis
moving the same bytes: `python -m bench.tcp_port [--quick]`.

Put and get of 1, 4 and 32 MiB segments (the bench model's KV layout) by one client, a STREAM
of each (the connector's load; the baselines repeat their gets there), and one STREAM of 64
keys of 256 KiB against 64 gets, in alternating rounds (12, or 3 with --quick, after one
warm-up round): each round times raw TCP, LMCache 0.5.6's `lmcache_server` (driven by
bench/lmcache_driver.py with its own protocol, in `.venv-lmcache`, made by `make
setup-lmcache` when missing), redis-py against Redis, and tierkv-server over gRPC, shared
memory and its TCP data port, 3 transfers each. Every client keeps one connection for the
whole run, as a connector keeps its session, and checks the bytes it gets back once per size.
A put's time is a batch of 3 over 3 (LMCache's PUT has no reply); a get's is the median of 3.
The table gives GB/s as the median over rounds, and ratios taken within each round. Every
server is a real process on loopback. `--stripes N` (default 2; 1: off) adds a column of the
TCP port with N connections per session (DataTier's `stripes`) for the 32 MiB get and the
STREAM of 64 keys, the loads striping splits.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import goal, parser, print_table, write_results
from bench.server import make_segment
from bench.wire_clients import Raw, Redis, Tierkv
from tierkv.cacheserver.launch import RedisProcess, ServerProcess, free_port, wait_port
from tierkv.storage_backends.segment import KVSegment

SIZES = [1, 4, 32]  # MiB
MANY = "64 x 0.25"  # one STREAM of 64 keys of 256 KiB (a request's chunks); 64 gets elsewhere
PATHS = (("tierkv gRPC", "grpc"), ("tierkv shared memory", "shm"), ("tierkv TCP port", "tcp"))
BASELINES = ("raw TCP", "LMCache lm://", "Redis")
COLUMNS = {  # the table's GB/s columns
    "raw TCP": "raw_tcp_gbps",
    "LMCache lm://": "lmcache_gbps",
    "Redis": "redis_gbps",
    "tierkv gRPC": "grpc_gbps",
    "tierkv shared memory": "shared_memory_gbps",
    "tierkv TCP port": "tcp_port_gbps",
}
STRIPED = "tierkv TCP port, striped"  # DataTier(stripes=--stripes): 32 MiB gets, MANY
ROOT = Path(__file__).resolve().parent.parent
LMC = ROOT / ".venv-lmcache" / "bin"


class LMCache:
    """LMCache's lm:// server and a driver process speaking its protocol."""

    def __init__(self) -> None:
        if not (LMC / "lmcache_server").exists():
            subprocess.run(["make", "-C", str(ROOT), "setup-lmcache"], check=True)
        port = free_port()
        cmd = [str(LMC / "lmcache_server"), "127.0.0.1", str(port), "cpu"]
        self.server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(port, 60)
        driver = [
            str(LMC / "python"),
            str(ROOT / "bench" / "lmcache_driver.py"),
            "127.0.0.1",
            str(port),
        ]
        self.driver = subprocess.Popen(
            driver,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def round(self, seg: KVSegment, reps: int) -> tuple[float, float]:
        """(seconds per put, median seconds per get) of `reps` values of seg's size."""
        nbytes = seg.nbytes
        assert self.driver.stdin is not None and self.driver.stdout is not None
        self.driver.stdin.write(f"ROUND {nbytes} {reps}\n")
        self.driver.stdin.flush()
        line = self.driver.stdout.readline()
        if not line:
            raise RuntimeError("the LMCache driver ended (see bench/lmcache_driver.py)")
        r = json.loads(line)
        return r["put_s"], r["get_s"]

    def close(self) -> None:
        for p in (self.driver, self.server):
            p.kill()
            p.wait(10)


async def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--stripes", type=int, default=2, help="connections of the striped column")
    args = p.parse_args()
    rounds = 3 if args.quick else 12
    server = ServerProcess(args=["--cpu-bytes", "1GiB", "--disk-bytes", "0"]).start()
    redis = RedisProcess().start()
    segs = {mib: make_segment(mib, seed=mib) for mib in SIZES}
    small = make_segment(0.25, seed=99)
    lmc = LMCache()
    raw = Raw([*(s.nbytes for s in segs.values()), small.nbytes])
    tierkv = {name: Tierkv(server.target, how) for name, how in PATHS}
    striped = Tierkv(server.target, "tcp", args.stripes) if args.stripes > 1 else None
    clients: dict[str, Any] = {
        "raw TCP": raw,
        "LMCache lm://": lmc,
        "Redis": Redis(redis.url),
        **tierkv,
    }
    got: dict[tuple[str, str, float | str], list[float]] = {}
    try:
        for r in tqdm(range(rounds + 1), desc="rounds (the first a warm-up)", unit="round"):

            def add(name: str, op: str, mib: float | str, gbps: float) -> None:
                if r:  # round 0 warms every connection up
                    got.setdefault((name, op, mib), []).append(gbps)

            for mib in SIZES:
                n = segs[mib].nbytes
                for name, c in clients.items():
                    put_s, get_s = await _maybe(c.round(segs[mib], 3))
                    add(name, "put", mib, n / put_s / 1e9)
                    add(name, "get", mib, n / get_s / 1e9)
                    if name in BASELINES:  # their "stream" of one key is a get
                        add(name, "stream", mib, n / get_s / 1e9)
                for name, c in tierkv.items():  # the connector's load: one STREAM of the key
                    add(name, "stream", mib, n / await c.stream(segs[mib], 1, 3) / 1e9)
                if striped is not None and mib == SIZES[-1]:
                    add(STRIPED, "get", mib, n / (await striped.round(segs[mib], 3))[1] / 1e9)
            m = small.nbytes
            for name in BASELINES:  # 64 gets of 256 KiB against one STREAM of 64 keys
                get_s = (await _maybe(clients[name].round(small, 64)))[1]
                add(name, "stream", MANY, m / get_s / 1e9)
            for name, c in tierkv.items():
                add(name, "stream", MANY, 64 * m / await c.stream(small, 64, 3) / 1e9)
            if striped is not None:
                add(STRIPED, "stream", MANY, 64 * m / await striped.stream(small, 64, 3) / 1e9)
    finally:
        for c in [*clients.values(), *([striped] if striped else [])]:
            await _maybe(c.close())
        server.stop(kill=True)
        redis.stop()
    rows: list[dict[str, Any]] = []

    def ratio(a: list[float], b: list[float]) -> float:
        return round(statistics.median(x / y for x, y in zip(a, b)), 3)

    for op, sizes in (("get", SIZES), ("put", SIZES), ("stream", [*SIZES, MANY])):
        for mib in sizes:
            row: dict[str, Any] = {"op": op, "mib": mib}
            for name, col in COLUMNS.items():
                row[col] = round(statistics.median(got[(name, op, mib)]), 3)
            tcp, shm = got[("tierkv TCP port", op, mib)], got[("tierkv shared memory", op, mib)]
            row["tcp_port_vs_raw"] = ratio(tcp, got[("raw TCP", op, mib)])
            row["tcp_port_vs_lmcache"] = ratio(tcp, got[("LMCache lm://", op, mib)])
            row["shared_memory_vs_lmcache"] = ratio(shm, got[("LMCache lm://", op, mib)])
            striped_got = got.get((STRIPED, op, mib))  # N connections against one, per round
            row["tcp_port_striped_gbps"] = (
                round(statistics.median(striped_got), 3) if striped_got else None
            )
            row["striped_vs_one"] = ratio(striped_got, tcp) if striped_got else None
            rows.append(row)
    print_table(rows)
    goals = []
    for r in rows:
        at = f"{r['op']}, {r['mib']} MiB"
        if r["op"] == "get":
            goals.append(goal(f"TCP port / raw TCP, {at}", r["tcp_port_vs_raw"], ">=", 0.7, "x"))
            goals.append(
                goal(
                    f"shared memory / LMCache, {at}", r["shared_memory_vs_lmcache"], ">=", 1.2, "x"
                )
            )
        if r["op"] != "stream":
            goals.append(
                goal(f"TCP port / LMCache lm://, {at}", r["tcp_port_vs_lmcache"], ">=", 1.0, "x")
            )
    many = rows[-1]
    goals.append(
        goal("64 x 256 KiB, one STREAM, TCP port", many["tcp_port_gbps"], ">=", 1.5, "GB/s")
    )
    goals.append(
        goal(
            "64 x 256 KiB, one STREAM, shared memory", many["shared_memory_gbps"], ">=", 2.0, "GB/s"
        )
    )

    def plot(ax: Any) -> None:
        for op, style in (("get", "-o"), ("put", "--s")):
            for col, label in (
                ("raw_tcp_gbps", "raw TCP"),
                ("lmcache_gbps", "LMCache lm://"),
                ("redis_gbps", "Redis"),
                ("shared_memory_gbps", "shared memory"),
                ("tcp_port_gbps", "TCP port"),
            ):
                pts = [(r["mib"], r[col]) for r in rows if r["op"] == op and r["mib"] != MANY]
                ax.plot(*zip(*pts), style, label=f"{label} {op}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("segment MiB")
        ax.set_ylabel("GB/s (median over rounds)")
        ax.legend(fontsize=7)

    config = {
        "rounds": rounds,
        "transfers_per_round": 3,
        "sizes_mib": SIZES,
        "clients": 1,
        "connections": "one per client for the whole run (a connector's session)",
        "put_seconds": "a batch of 3 puts over 3 (LMCache's PUT has no reply)",
        "lmcache": "lmcache==0.5.6, lmcache_server (lm://), cpu",
        "stripes": args.stripes,
        "striped": "tcp_port_striped_gbps: DataTier(stripes=stripes), 32 MiB gets and MANY",
    }
    write_results("tcp_port", config, rows, goals, plot)


async def _maybe(x: Any) -> Any:
    """x, awaited when it is awaitable (LMCache's driver and the raw sockets are blocking)."""
    return await x if inspect.isawaitable(x) else x


if __name__ == "__main__":
    asyncio.run(main())
