"""tierkv-server's TCP data port (the path of every cross-host load) against raw loopback TCP
and LMCache's lm:// server moving the same bytes: `python -m bench.tcp_port [--quick]`.

Get and put of 1, 4 and 32 MiB segments (the bench model's KV layout) by one client, a STREAM
of each (the connector's load; the raw TCP and LMCache columns there repeat their gets), and
one STREAM of 64 keys of 256 KiB against 64 LMCache gets, in alternating rounds (12, or 3 with
--quick): each round times raw TCP, LMCache 0.5.6's `lmcache_server` (driven by
bench/lmcache_driver.py with its own protocol, in `.venv-lmcache`, made by `make
setup-lmcache` when missing), tierkv's TCP port and its shared-memory path, each the median of
3 transfers; the table gives GB/s as the median over rounds and ratios taken within each round.
Every server is a real process on loopback.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import goal, parser, print_table, write_results
from bench.server import bench_stream, bench_tcp, bench_tierkv, make_segment, tcp_server
from tierkv.cacheserver.launch import ServerProcess, free_port, wait_port

SIZES = [1, 4, 32]  # MiB
MANY = "64 x 0.25"  # one STREAM of 64 keys of 256 KiB (a request's chunks); 64 gets elsewhere
PATHS = (("tierkv TCP port", "tcp"), ("tierkv shared memory", "shm"))
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

    def round(self, nbytes: int, reps: int) -> tuple[float, float]:
        """(seconds per put, median seconds per get) of `reps` values of nbytes."""
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
    args = parser(__doc__ or "").parse_args()
    rounds = 3 if args.quick else 12
    server = ServerProcess(args=["--cpu-bytes", "1GiB", "--disk-bytes", "0"]).start()
    segs = {mib: make_segment(mib, seed=mib) for mib in SIZES}
    raw = {mib: tcp_server(segs[mib].nbytes) for mib in SIZES}
    small = make_segment(0.25, seed=99)
    raw_small = tcp_server(small.nbytes)
    lmc = LMCache()
    got: dict[tuple[str, str, int], list[float]] = {}
    try:
        for _ in tqdm(range(rounds), desc="rounds", unit="round"):
            for mib in SIZES:
                n = segs[mib].nbytes
                t = {"raw TCP": bench_tcp(raw[mib][1], n, 1, 3)}
                t["LMCache lm://"] = lmc.round(n, 3)
                t["tierkv TCP port"] = await bench_tierkv(
                    server.target, {0: segs[mib]}, 1, 3, "tcp"
                )
                t["tierkv shared memory"] = await bench_tierkv(
                    server.target, {0: segs[mib]}, 1, 3, "shm"
                )
                for path, (put_s, get_s) in t.items():
                    got.setdefault((path, "put", mib), []).append(n / put_s / 1e9)
                    got.setdefault((path, "get", mib), []).append(n / get_s / 1e9)
                # the connector's load: one STREAM of the key, against the same round's gets
                for path, how in PATHS:
                    secs = await bench_stream(server.target, segs[mib], 1, 3, how)
                    got.setdefault((path, "stream", mib), []).append(n / secs / 1e9)
                for path in ("raw TCP", "LMCache lm://"):
                    got.setdefault((path, "stream", mib), []).append(got[(path, "get", mib)][-1])
            m = small.nbytes
            one = {
                "raw TCP": bench_tcp(raw_small[1], m, 1, 3)[1],
                "LMCache lm://": lmc.round(m, 64)[1],
            }
            for path, secs in one.items():
                got.setdefault((path, "stream", MANY), []).append(m / secs / 1e9)
            for path, how in PATHS:
                secs = await bench_stream(server.target, small, 64, 3, how)
                got.setdefault((path, "stream", MANY), []).append(64 * m / secs / 1e9)
    finally:
        server.stop(kill=True)
        lmc.close()
        for proc, _ in [*raw.values(), raw_small]:
            proc.kill()
    rows: list[dict[str, Any]] = []

    def ratio(a: list[float], b: list[float]) -> float:
        return round(statistics.median(x / y for x, y in zip(a, b)), 3)

    for op, sizes in (("get", SIZES), ("put", SIZES), ("stream", [*SIZES, MANY])):
        for mib in sizes:
            base, lm = got[("raw TCP", op, mib)], got[("LMCache lm://", op, mib)]
            tcp, shm = got[("tierkv TCP port", op, mib)], got[("tierkv shared memory", op, mib)]
            rows.append(
                {
                    "op": op,
                    "mib": mib,
                    "raw_tcp_gbps": round(statistics.median(base), 3),
                    "lmcache_gbps": round(statistics.median(lm), 3),
                    "tcp_port_gbps": round(statistics.median(tcp), 3),
                    "shared_memory_gbps": round(statistics.median(shm), 3),
                    "tcp_port_vs_raw": ratio(tcp, base),
                    "tcp_port_vs_lmcache": ratio(tcp, lm),
                    "shared_memory_vs_lmcache": ratio(shm, lm),
                }
            )
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
        "lmcache": "lmcache==0.5.6, lmcache_server (lm://), cpu",
    }
    write_results("tcp_port", config, rows, goals, plot)


if __name__ == "__main__":
    asyncio.run(main())
