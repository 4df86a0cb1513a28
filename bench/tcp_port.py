"""tierkv-server's TCP data port (the path of every cross-host load) against raw loopback TCP
moving the same bytes: `python -m bench.tcp_port [--quick]`.

Get and put of 1, 4 and 32 MiB segments (the bench model's KV layout) by one client, in
alternating rounds (12, or 3 with --quick): each round times raw TCP, then tierkv's TCP port,
then its shared-memory path, each the median of 3 transfers; the table gives GB/s as the
median over rounds and the ratio to raw TCP of the same round. The servers are real
processes on loopback.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from tqdm import tqdm

from bench.common import goal, parser, print_table, write_results
from bench.server import bench_tcp, bench_tierkv, make_segment, tcp_server
from tierkv.cacheserver.launch import ServerProcess

SIZES = [1, 4, 32]  # MiB


async def main() -> None:
    args = parser(__doc__ or "").parse_args()
    rounds = 3 if args.quick else 12
    server = ServerProcess(args=["--cpu-bytes", "1GiB", "--disk-bytes", "0"]).start()
    segs = {mib: make_segment(mib, seed=mib) for mib in SIZES}
    raw = {mib: tcp_server(segs[mib].nbytes) for mib in SIZES}
    got: dict[tuple[str, str, int], list[float]] = {}
    try:
        for _ in tqdm(range(rounds), desc="rounds", unit="round"):
            for mib in SIZES:
                n = segs[mib].nbytes
                t = {"raw TCP": bench_tcp(raw[mib][1], n, 1, 3)}
                t["tierkv TCP port"] = await bench_tierkv(
                    server.target, {0: segs[mib]}, 1, 3, "tcp"
                )
                t["tierkv shared memory"] = await bench_tierkv(
                    server.target, {0: segs[mib]}, 1, 3, "shm"
                )
                for path, (put_s, get_s) in t.items():
                    got.setdefault((path, "put", mib), []).append(n / put_s / 1e9)
                    got.setdefault((path, "get", mib), []).append(n / get_s / 1e9)
    finally:
        server.stop(kill=True)
        for proc, _ in raw.values():
            proc.kill()
    rows: list[dict[str, Any]] = []
    for op in ("get", "put"):
        for mib in SIZES:
            base = got[("raw TCP", op, mib)]
            tcp, shm = got[("tierkv TCP port", op, mib)], got[("tierkv shared memory", op, mib)]
            rows.append(
                {
                    "op": op,
                    "mib": mib,
                    "raw_tcp_gbps": round(statistics.median(base), 3),
                    "tcp_port_gbps": round(statistics.median(tcp), 3),
                    "tcp_port_vs_raw": round(
                        statistics.median(a / b for a, b in zip(tcp, base)), 3
                    ),
                    "shared_memory_gbps": round(statistics.median(shm), 3),
                }
            )
    print_table(rows)
    goals = [
        goal(f"TCP port get / raw TCP, {r['mib']} MiB", r["tcp_port_vs_raw"], ">=", 0.7, "x")
        for r in rows
        if r["op"] == "get"
    ]

    def plot(ax: Any) -> None:
        for op, style in (("get", "-o"), ("put", "--s")):
            for col, label in (("raw_tcp_gbps", "raw TCP"), ("tcp_port_gbps", "TCP port")):
                pts = [(r["mib"], r[col]) for r in rows if r["op"] == op]
                ax.plot(*zip(*pts), style, label=f"{label} {op}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("segment MiB")
        ax.set_ylabel("GB/s (median over rounds)")
        ax.legend(fontsize=7)

    config = {"rounds": rounds, "transfers_per_round": 3, "sizes_mib": SIZES, "clients": 1}
    write_results("tcp_port", config, rows, goals, plot)


if __name__ == "__main__":
    asyncio.run(main())
