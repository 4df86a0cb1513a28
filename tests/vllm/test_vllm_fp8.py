"""fp8 KV end to end: vLLM engines with kv_cache_dtype fp8 (model dtype fp32, a tiny random
Llama) and a real tierkv-server (disk tier only, so the test reads what is stored). Process A
(fp8) saves; an auto (fp32-cache) process C misses A's KV and saves its own; process B
(fp8_e4m3, the same bytes as fp8) loads A's KV with the tokens of its own cold run and misses
C's. One engine runs at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.vllm.conftest import needs_fp8_kv, prompt
from tests.vllm.harness import Engine
from tierkv.cacheserver.launch import ServerProcess
from tierkv.storage_backends.segment import KVSegment

pytestmark = needs_fp8_kv

P1, P2, P3 = prompt(300, 11), prompt(200, 12), prompt(150, 13)
CHUNK = 64


def chunks(p: list[int]) -> int:
    return -(-len(p) // CHUNK)


def extra(server: ServerProcess) -> dict:
    return {
        "remote": f"grpc://{server.target}",
        "chunk_size": CHUNK,
        "cpu_bytes": 0,
        "load_timeout_s": 20.0,
    }


def fp8(tiny: Path, server: ServerProcess, variant: str) -> Engine:
    return Engine(tiny, extra(server), knobs={"kv_cache_dtype": variant})


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(args=["--cpu-bytes", "0"]).start()
    yield s
    s.stop(kill=True)


@pytest.fixture(scope="module")
def cold_a(server: ServerProcess, tiny: Path) -> list[list[int]]:
    """fp8 process A's answers to P1 and P2 (nothing stored yet); its saves drained."""
    a = fp8(tiny, server, "fp8").start()
    try:
        out = a.generate([P1, P2])
        a.wait_saved(2 * (chunks(P1) + chunks(P2)))  # 2 KV head parts a chunk
        assert a.metrics()["loaded_tokens"] == 0
    finally:
        a.close()
    return out


@pytest.fixture(scope="module")
def auto_c(server: ServerProcess, tiny: Path, cold_a) -> dict[str, float]:
    """Auto process C asks for P1 and P2 (A stored them as fp8) and computes P3; its saves
    drained. Its counters."""
    c = Engine(tiny, extra(server)).start()
    try:
        got = c.generate([P1, P2, P3])
        c.wait_saved(2 * (chunks(P1) + chunks(P2) + chunks(P3)))
        c.reset()
        assert c.generate([P1, P2, P3], cold=True) == got
        return c.metrics()
    finally:
        c.close()


@pytest.fixture(scope="module")
def b(server: ServerProcess, tiny: Path, auto_c) -> Iterator[Engine]:
    e = fp8(tiny, server, "fp8_e4m3").start()
    yield e
    e.close()


def segments(server: ServerProcess, tokens: list[int]) -> list[KVSegment]:
    found = [KVSegment.decode(f.read_bytes()) for f in sorted(server.cache_dir.rglob("*.tkv"))]
    return [s for s in found if s.tokens.tolist() == tokens]


def test_an_auto_engine_misses_fp8_kv(auto_c: dict[str, float]) -> None:
    # A's fp8 chunks are under keys of another KV format: a miss at lookup, nothing refused
    assert auto_c["loaded_tokens"] == auto_c["load_rejected"] == auto_c["load_misses"] == 0
    assert auto_c["saved_chunks"] == 2 * (chunks(P1) + chunks(P2) + chunks(P3))


def test_fp8_parts_hold_float8_bytes_and_the_layers_scales(server: ServerProcess, auto_c) -> None:
    parts = segments(server, P1[:CHUNK])  # A's 2 fp8 parts and C's 2 fp32 parts
    by_dtype = {d: [s for s in parts if s.header.dtype == d] for d in ("float8_e4m3fn", "float32")}
    assert [len(v) for v in by_dtype.values()] == [2, 2] and len(parts) == 4
    for s in by_dtype["float8_e4m3fn"]:
        h = s.header
        assert (h.quant, h.num_layers, h.num_kv_heads, h.head_dim) == ("fp8_e4m3", 2, 1, 64)
        assert s.payload.numel() == s.nbytes - h.header_nbytes == 2 * 2 * CHUNK * 64  # 1 B each
        # no checkpoint scales: vLLM's are 1.0 for every layer's K and V
        assert np.array_equal(h.scales, np.ones((2, 2, 1), np.float32))
    fingerprints = {d: {s.header.fingerprint for s in v} for d, v in by_dtype.items()}
    assert fingerprints["float8_e4m3fn"].isdisjoint(fingerprints["float32"])


def test_a_second_fp8_process_loads_what_the_first_saved(b: Engine, cold_a) -> None:
    m = b.metrics()
    loaded = b.generate([P1, P2])
    now = b.metrics()
    d = {k: now[k] - m.get(k, 0.0) for k in now}
    assert loaded == cold_a
    assert d["loaded_tokens"] == (len(P1) - 1) + (len(P2) - 1)  # all but each last token
    assert d["load_misses"] == d["load_rejected"] == d["recomputed_tokens"] == 0
    b.reset()
    assert b.generate([P1, P2], cold=True) == loaded  # B's own cold fp8 run


def test_an_fp8_engine_misses_auto_kv(b: Engine) -> None:
    b.reset()
    m = b.metrics()
    got = b.generate([P3])  # only C (auto) stored P3
    now = b.metrics()
    assert now["loaded_tokens"] == m["loaded_tokens"]
    assert now["load_rejected"] == m["load_rejected"]
    b.reset()
    assert b.generate([P3], cold=True) == got
