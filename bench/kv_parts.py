"""What storing a chunk as one segment per KV head costs (tierkv.vllm's cross-TP format) against
one segment per chunk: bytes stored, the lookup of every part, the put, and the layer-major
stream of a prompt's chunks from a tierkv-server over shared memory (the load path a second
vLLM process takes). Random bf16 KV in the shapes of SmolLM2-135M (30 layers, 3 KV heads of
64) and of the bench model (8 layers, 2 KV heads of 64); chunks of 256 tokens.

    python -m bench.kv_parts [--quick]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bench.common import goal, parser, print_table, write_results
from tierkv.cacheserver.launch import ServerProcess
from tierkv.connector.config import server_tier
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.segment import KVSegment

CHUNK = 256
SHAPES = {"smollm2": (30, 3, 64), "bench": (8, 2, 64)}  # layers, KV heads, head size


@dataclass(slots=True, eq=False)
class Sink:
    """Takes every layer into buffers kept between runs (as the connector's staging pool)."""

    bufs: dict[int, bytearray] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    got: int = 0

    def open(self, i: int, header: SegmentHeader) -> bool:
        self.sizes[i] = header.layer_raw_nbytes
        if len(self.bufs.get(i, b"")) != header.payload_raw_nbytes:
            self.bufs[i] = bytearray(header.payload_raw_nbytes)
        return True

    def into(self, i: int, layer: int) -> memoryview:
        n = self.sizes[i]
        return memoryview(self.bufs[i])[layer * n : (layer + 1) * n]

    def drop(self, i: int, why: str) -> None:
        raise RuntimeError(f"part {i} dropped: {why}")

    async def ready(self, layer: int) -> None:
        self.got = layer + 1


async def timed(make: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await make()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def measure(target: str, model: str, tokens: int, parts: int, repeat: int) -> dict:
    layers, heads, dim = SHAPES[model]
    tier = server_tier(f"grpc://{target}")
    chunks, per = tokens // CHUNK, heads // parts
    segs = []
    for _ in range(chunks * parts):
        kv = torch.randn(layers, 2, CHUNK, per, dim).to(torch.bfloat16)
        tokens = np.arange(CHUNK, dtype=np.int32)
        segs.append(
            KVSegment.from_tensor(kv, key=os.urandom(16), tokens=tokens, fingerprint=bytes(16))
        )
    keys = [s.key for s in segs]
    t0 = time.perf_counter()
    for s in segs:
        assert await tier.put(s.key, s, "default")
    put_s = time.perf_counter() - t0
    lookup = await timed(lambda: tier.contains(keys, "default"), repeat)
    sink = Sink()
    stream = await timed(lambda: tier.stream(keys, "default", sink), repeat)
    assert sink.got == layers
    await tier.close()
    nbytes = sum(s.nbytes for s in segs)
    return {
        "model": model,
        "tokens": chunks * CHUNK,
        "segments_per_chunk": parts,
        "segments": len(segs),
        "stored_MiB": round(nbytes / 2**20, 2),
        "header_bytes_per_chunk": sum(s.header.header_nbytes for s in segs) // chunks,
        "put_s": round(put_s, 3),
        "lookup_ms": round(lookup * 1e3, 2),
        "stream_s": round(stream, 4),
        "stream_GBps": round(nbytes / stream / 1e9, 2),
    }


def plot(rows: list[dict[str, Any]]) -> Any:
    """Stream time of a chunk's layers: whole chunks against one segment per KV head."""

    def draw(ax: Any) -> None:
        labels = [f"{r['model']}, {r['segments_per_chunk']}/chunk" for r in rows]
        ax.bar(labels, [r["stream_s"] * 1e3 for r in rows], color="tab:blue")
        ax.set_ylabel(f"stream of {rows[0]['tokens']} tokens, ms (median)")
        ax.tick_params(axis="x", labelsize=8)

    return draw


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    tokens, repeat = (2048, 3) if args.quick else (8192, 5)
    srv = ServerProcess(args=["--cpu-bytes", "2GiB"]).start()
    rows = []
    try:
        for model, (_, heads, _) in SHAPES.items():
            for parts in (1, heads):
                rows.append(asyncio.run(measure(srv.target, model, tokens, parts, repeat)))
    finally:
        srv.stop()
    print_table(rows)
    goals = []
    for model in SHAPES:
        one, each = (r for r in rows if r["model"] == model)
        goals.append(
            goal(
                f"{model}: stream time, one segment per KV head / one per chunk",
                round(each["stream_s"] / one["stream_s"], 3),
                "<=",
                1.25,
                "x",
            )
        )
    config = {"tokens": tokens, "chunk": CHUNK, "repeat": repeat}
    write_results("kv_parts", config, rows, goals, plot(rows))


if __name__ == "__main__":
    main()
