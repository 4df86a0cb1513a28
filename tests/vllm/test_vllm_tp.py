"""tierkv.vllm under tensor parallelism, end to end against a real tierkv-server (disk tier only,
so a test can reach each stored part): TP=2 process A saves and TP=2 process B loads; partial
hits; one rank's part of a chunk deleted (a miss at lookup) or refused by the server at load
(one rank fails, the other loads) is recomputed, with no hang and no wrong token; TP=1 saves
and TP=2 loads, and the reverse. Each engine's tokens equal its own cold run (fp32, greedy)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from tests.vllm.conftest import prompt
from tests.vllm.harness import Engine, parts
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.launch import ServerProcess
from tierkv.storage_backends.keys import head_key
from tierkv.storage_backends.segment import KVSegment

CHUNK, HEADS = 64, 2  # the tiny model: 4 query heads, 2 KV heads (one per TP=2 rank)
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank
P1, P2 = prompt(300, 1), prompt(200, 2)
Q, R = P1[:150] + prompt(100, 3), P2[:100]  # two full chunks of P1; one of P2, then stops
S1, S2 = prompt(230, 6), prompt(180, 7)  # saved by TP=1 / by TP=2, loaded by the other


def extra(server: ServerProcess) -> dict:
    return {
        "remote": f"grpc://{server.target}",
        "chunk_size": CHUNK,
        "cpu_bytes": 0,
        "load_timeout_s": 20.0,
    }


def delta(e: Engine, before: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per rank, what each counter of before (one dict per rank) grew by."""
    return [{k: v - b.get(k, 0.0) for k, v in e.metrics(r).items()} for r, b in enumerate(before)]


def ranks(e: Engine, n: int = 2) -> list[dict[str, float]]:
    return [e.metrics(r) for r in range(n)]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(args=["--cpu-bytes", "0"]).start()
    yield s
    s.stop(kill=True)


@pytest.fixture(scope="module")
def t1(server: ServerProcess, tiny: Path) -> Iterator[Engine]:
    e = Engine(tiny, extra(server)).start()
    yield e
    e.close()


@pytest.fixture(scope="module")
def t1_cold(t1: Engine) -> list[list[int]]:
    """TP=1 computes S1 and saves it: one part per KV head of each of its 4 chunks."""
    out = t1.generate([S1], cold=True)
    t1.wait_saved(HEADS * 4)
    return out


@pytest.fixture(scope="module")
def a_cold(server: ServerProcess, tiny: Path, t1_cold) -> list[list[int]]:
    """TP=2 process A's answers to P1, P2 and S2 (it computes them); A then exits, its saves
    drained to the server."""
    a = Engine(tiny, extra(server), knobs=dict(TP2), env=BIND).start()
    try:
        return a.generate([P1, P2, S2])
    finally:
        a.close()


def test_tp1_loads_what_tp2_saved(t1: Engine, a_cold) -> None:
    m = t1.metrics()
    got = t1.generate([S2])
    d = delta(t1, [m])[0]
    assert d["loaded_tokens"] == len(S2) - 1, d
    assert d["load_misses"] == d["load_rejected"] == d["recomputed_tokens"] == 0
    t1.reset()
    assert t1.generate([S2], cold=True) == got


@pytest.fixture(scope="module")
def b(server: ServerProcess, tiny: Path, t1: Engine, a_cold) -> Iterator[Engine]:
    t1.close()  # one engine at a time from here on
    e = Engine(tiny, extra(server), knobs=dict(TP2), env=BIND).start()
    yield e
    e.close()


def test_tp2_process_b_loads_what_process_a_saved(b: Engine, a_cold) -> None:
    m = ranks(b)
    loaded = b.generate([P1, P2])
    assert loaded == a_cold[:2]
    for d in delta(b, m):  # each rank loaded its heads of every chunk
        assert d["loaded_tokens"] == (len(P1) - 1) + (len(P2) - 1), d
        assert d["load_misses"] == d["load_rejected"] == d["recomputed_tokens"] == 0
    b.reset()
    assert b.generate([P1, P2], cold=True) == loaded


def test_tp2_loads_what_tp1_saved(b: Engine, t1_cold) -> None:
    b.reset()
    m = ranks(b)
    loaded = b.generate([S1])
    assert [d["loaded_tokens"] for d in delta(b, m)] == [len(S1) - 1] * 2
    b.reset()
    assert b.generate([S1], cold=True) == loaded


def test_tp2_partial_hits(b: Engine) -> None:
    b.reset()
    m = ranks(b)
    loaded = b.generate([Q, R])
    assert [d["loaded_tokens"] for d in delta(b, m)] == [3 * CHUNK] * 2
    b.reset()
    assert b.generate([Q, R], cold=True) == loaded


async def delete(server: ServerProcess, key: bytes) -> None:
    tier = RemoteTier(target=server.target)
    try:
        assert await tier.delete(key)
    finally:
        await tier.close()


def rank1_part_of_chunk1(server: ServerProcess, s: list[int]) -> tuple[bytes, Path]:
    """Once every chunk of s is stored: the key and file of KV head 1's part of chunk 1 (rank
    1's), found from the chain: its parts' parent is chunk 0's key K0, its key H(K0 || tokens)."""
    for a in range(0, len(s), CHUNK):
        parts(server, s[a : a + CHUNK], HEADS)
    found = parts(server, s[CHUNK : 2 * CHUNK], HEADS)
    parent = KVSegment.decode(next(iter(found.values())).read_bytes()).header.parent
    tokens = np.asarray(s[CHUNK : 2 * CHUNK], "<i4").tobytes()
    key = head_key(xxhash.xxh3_128_digest(parent + tokens), 1)
    assert key in found
    return key, found[key]


def test_one_rank_part_deleted_is_a_miss(b: Engine, server: ServerProcess) -> None:
    s = prompt(200, 4)
    cold = b.generate([s], cold=True)  # B computes s and saves its 4 chunks
    key, _ = rank1_part_of_chunk1(server, s)
    asyncio.run(delete(server, key))
    b.reset()
    m = ranks(b)
    assert b.generate([s]) == cold
    for d in delta(b, m):  # the lookup needs every rank's part: chunk 0 only, on both ranks
        assert d["loaded_tokens"] == CHUNK and d["recomputed_tokens"] == 0, d


def test_one_rank_part_refused_at_load_is_recomputed(b: Engine, server: ServerProcess) -> None:
    s = prompt(200, 5)
    cold = b.generate([s], cold=True)
    _, f = rank1_part_of_chunk1(server, s)
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x40  # in the payload's last layer: present at lookup, refused by the stream
    f.write_bytes(bytes(data))
    b.reset()
    m = ranks(b)
    t0 = time.monotonic()
    assert b.generate([s]) == cold
    assert time.monotonic() - t0 < 20  # no hang: both ranks reported the request
    r0, r1 = delta(b, m)
    assert r0["recomputed_tokens"] == 0 and r0["loaded_tokens"] == len(s) - 1, r0
    assert r1["load_misses"] + r1["load_rejected"] >= 1, r1
    assert r1["loaded_tokens"] == CHUNK and r1["recomputed_tokens"] == len(s) - 1 - CHUNK, r1
