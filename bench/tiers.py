"""Tier throughput: put/get of 1, 4 and 32 MiB segments in the gpu, cpu and disk tiers, next to a
plain memcpy into a preallocated buffer and a plain file read of the same bytes, in one run; and
the cpu tier's memory (its used bytes and the process RSS) under a long sequence of puts.

    python -m bench.tiers [--quick]
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from tqdm import tqdm

from bench.common import goal, parser, print_table, write_results
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.disk_tier import DiskTier, DiskTierConfig
from tierkv.storage_backends.gpu_tier import GpuTier, GpuTierConfig
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.sizes import MiB

L, H, D = 8, 2, 64  # the bench model's KV shape: 8 layers, 2 KV heads, head_dim 64, bf16
TOKEN_BYTES = L * 2 * H * D * 2


def segment(payload: torch.Tensor, i: int) -> KVSegment:
    T = payload.numel() // (L * 2 * H * D)
    return KVSegment.from_tensor(
        payload.view(L, 2, T, H, D),
        key=i.to_bytes(16, "little"),
        tokens=np.arange(T),
        fingerprint=b"bench",
    )


def uncache(path: Path) -> None:
    """Drop one (fsynced) file from the page cache, so the next read goes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


async def paired(fa, fb, repeat: int, setup=None) -> tuple[float, float]:
    """Median seconds of `await fa(i)` and of `await fb(i)`, run alternately (after a warmup) so
    that both see the same moments of this shared, noisy machine; setup() runs untimed before
    each."""
    await fa(-1)
    await fb(-1)
    ta: list[float] = []
    tb: list[float] = []
    for i in range(repeat):
        for f, ts in ((fa, ta), (fb, tb)):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            await f(i)
            ts.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


async def throughput(size: int, repeat: int, root: Path) -> list[dict]:
    src = torch.randn(size // 2, generator=torch.Generator().manual_seed(size)).to(torch.bfloat16)
    dst = torch.empty_like(src)
    src_mv, dst_mv = (
        memoryview(src.view(torch.uint8).numpy()),
        memoryview(dst.view(torch.uint8).numpy()),
    )
    plain = root / f"plain-{size}.bin"
    rows = []

    async def memcpy(_):
        dst_mv[:] = src_mv

    async def file_write(_):
        with open(plain, "wb") as f:
            f.write(src_mv)
            os.fsync(f.fileno())

    async def file_read(_):
        with open(plain, "rb") as f:
            f.readinto(dst_mv)

    # capacity for 2 segments and a bit: puts evict in steady state, as in service
    tiers = [
        GpuTier(GpuTierConfig(capacity_bytes=3 * size)),
        CpuTier(CpuTierConfig(capacity_bytes=3 * size)),
        CpuTier(CpuTierConfig(capacity_bytes=3 * size, verify_gets=True)),
        DiskTier(DiskTierConfig(root=root / f"disk-{size}", capacity_bytes=3 * size)),
    ]
    segs = [segment(src, i + 1) for i in range(-1, repeat)]
    await file_write(0)
    for tier in tiers:
        name = tier.name + (" verified" if getattr(tier.config, "verify_gets", False) else "")
        on_disk = isinstance(tier, DiskTier)

        async def put(i):
            assert await tier.put(segs[i + 1].key, segs[i + 1])

        async def get(i):
            assert await tier.get(segs[-1].key, out=dst) is not None

        cases = [
            (
                "put",
                put,
                file_write if on_disk else memcpy,
                "file write+fsync" if on_disk else "memcpy",
                None,
            ),
            (
                "get",
                get,
                file_read if on_disk else memcpy,
                "file read" if on_disk else "memcpy",
                None,
            ),
        ]
        if on_disk:
            file = root / f"disk-{size}" / "default" / f"{segs[-1].key.hex()}.tkv"
            cases.append(
                (
                    "get cold",
                    get,
                    file_read,
                    "file read cold",
                    lambda: (uncache(file), uncache(plain)),
                )
            )
        for op, fn, base_fn, base, setup in cases:
            t, tb = await paired(fn, base_fn, repeat, setup)
            rows.append(
                {
                    "tier": name,
                    "op": op,
                    "size_mib": size // MiB,
                    "ms": t * 1e3,
                    "gbps": size / t / 1e9,
                    "baseline": base,
                    "baseline_gbps": size / tb / 1e9,
                    "vs_baseline": tb / t,
                }
            )
            if op.startswith("get"):
                assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
        await tier.close()
    return rows


async def memory(capacity: int, num_puts: int) -> dict:
    """RSS growth and used bytes of a cpu tier under num_puts puts of 1-8 MiB segments."""
    rng = random.Random(0)
    src = torch.randn(8 * MiB // 2).to(torch.bfloat16)
    proc = psutil.Process()
    tier = CpuTier(CpuTierConfig(capacity_bytes=capacity))
    rss0, max_used, max_growth = proc.memory_info().rss, 0, 0
    for i in tqdm(range(num_puts), desc="cpu tier memory", leave=False):
        tokens = rng.randrange(1, 8 * MiB // TOKEN_BYTES + 1)
        await tier.put(i.to_bytes(16, "little"), segment(src[: tokens * TOKEN_BYTES // 2], i))
        max_used = max(max_used, tier.used_bytes)
        max_growth = max(max_growth, proc.memory_info().rss - rss0)
    tier.check_integrity()
    return {
        "capacity_mib": capacity / MiB,
        "puts": num_puts,
        "max_used_mib": max_used / MiB,
        "max_rss_growth_mib": max_growth / MiB,
        "evictions": tier.stats().evictions,
    }


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    repeat = 9 if args.quick else 25
    sizes = [1 * MiB, 4 * MiB, 32 * MiB]
    capacity, num_puts = (64 * MiB, 200) if args.quick else (256 * MiB, 1000)
    rows: list[dict] = []

    async def run() -> dict:
        with tempfile.TemporaryDirectory(
            prefix="tierkv-bench-", dir=os.environ.get("TIERKV_BENCH_DIR")
        ) as tmp:
            for size in tqdm(sizes, desc="tier throughput"):
                rows.extend(await throughput(size, repeat, Path(tmp)))
        return await memory(capacity, num_puts)

    mem = asyncio.run(run())

    def ratio(tier: str, op: str, size: int) -> float:
        return next(
            r["vs_baseline"]
            for r in rows
            if (r["tier"], r["op"], r["size_mib"]) == (tier, op, size // MiB)
        )

    print_table(
        rows, ["tier", "op", "size_mib", "ms", "gbps", "baseline", "baseline_gbps", "vs_baseline"]
    )
    print_table([mem])
    goals = [
        goal(f"cpu get {s // MiB} MiB / memcpy", ratio("cpu", "get", s), ">=", 0.5)
        for s in sizes[1:]
    ]
    for op in ("get", "get cold"):
        goals += [
            goal(f"disk {op} {s // MiB} MiB / file read{op[3:]}", ratio("disk", op, s), ">=", 0.5)
            for s in sizes
        ]
    overhead = 16  # MiB: interpreter, allocator slack and one segment's header, beyond the buffer
    goals.append(goal("cpu tier used bytes", mem["max_used_mib"], "<=", mem["capacity_mib"], "MiB"))
    goals.append(
        goal(
            "cpu tier RSS growth",
            mem["max_rss_growth_mib"],
            "<=",
            mem["capacity_mib"] + overhead,
            "MiB",
        )
    )

    def plot(ax) -> None:
        labels = [f"{r['tier']} {r['op']}" for r in rows if r["size_mib"] == 1]
        for k, s in enumerate(sizes):
            vals = [r["vs_baseline"] for r in rows if r["size_mib"] == s // MiB]
            ax.bar(np.arange(len(vals)) + k * 0.27, vals, width=0.27, label=f"{s // MiB} MiB")
        ax.axhline(0.5, color="k", lw=0.8, ls="--")
        ax.set_xticks(np.arange(len(labels)) + 0.27, labels, rotation=30, ha="right")
        ax.set_ylabel("throughput / baseline of the same run (memcpy, file write, file read)")
        ax.legend()

    write_results(
        "tiers",
        {
            "sizes_mib": [s // MiB for s in sizes],
            "repeat": repeat,
            "shape": [L, 2, "T", H, D],
            "dtype": "bfloat16",
            "memory": mem,
        },
        rows,
        goals,
        plot,
    )


if __name__ == "__main__":
    main()
