"""tierkv.vllm with a hybrid model, end to end against a real tierkv-server (disk tier only, so
a test can read each stored part): a random Gemma-3 whose layers 0-2 attend through a 64-token
sliding window and layer 3 to everything, so vLLM (its hybrid KV cache manager kept, the
connector declaring SupportsHMA) runs four KV cache groups with their own block tables.

Process A computes and saves under 64-token steps (chunked prefill: a window's early blocks are
freed and reused before a 256-token chunk is complete); process B loads, whole and partly,
with the tokens of A and of its own cold run; a part refused at load is recomputed by request
(vLLM takes no block-level failures with several groups). fp32, greedy."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.conftest import prompt
from tests.vllm.harness import Engine, parts, tiny_gemma3
from tierkv.cacheserver.launch import ServerProcess
from tierkv.storage_backends.segment import KVSegment

CHUNK, WINDOW, BLOCK, HEADS = 256, 64, 128, 2  # BLOCK: vLLM's CPU block size
P1, P2 = prompt(600, 1), prompt(520, 2)
Q = P1[:300] + prompt(120, 3)  # P1's first chunk, then other tokens
KNOBS = {"max_model_len": 2048}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), WINDOW)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(args=["--cpu-bytes", "0"]).start()
    yield s
    s.stop(kill=True)


def extra(server: ServerProcess) -> dict:
    return {
        "remote": f"grpc://{server.target}",
        "chunk_size": CHUNK,
        "cpu_bytes": 0,
        "load_timeout_s": 20.0,
    }


@pytest.fixture(scope="module")
def a_cold(server: ServerProcess, gemma3: Path) -> list[list[int]]:
    """Process A's answers to P1 and P2, computed 64 tokens a step and saved; A then exits, its
    saves drained to the server."""
    a = Engine(gemma3, extra(server), knobs={**KNOBS, "max_num_batched_tokens": 64}).start()
    try:
        return a.generate([P1, P2], max_tokens=12)
    finally:
        a.close()


@pytest.fixture(scope="module")
def b(server: ServerProcess, gemma3: Path, a_cold) -> Iterator[Engine]:
    e = Engine(gemma3, extra(server), knobs=dict(KNOBS)).start()
    yield e
    e.close()


def test_cold_answers_depend_on_tokens_beyond_the_window(b: Engine) -> None:
    """The model is a fair judge: changing only tokens no window reaches changes the answer."""
    other = prompt(200, 9) + P1[200:]
    one, two = b.generate([P1, other], max_tokens=12, cold=True)
    assert one != two and len(set(one)) > 3


def test_a_window_stores_what_vllm_kept(server: ServerProcess, a_cold) -> None:
    """P1's first chunk was complete in A's fourth step (192 tokens computed before it): vLLM
    had freed the windowed layers' block of tokens [0, 128) by then, so those are stored as
    zeros; the full-attention layer keeps every token."""
    for f in parts(server, P1[:CHUNK], HEADS).values():
        kv = KVSegment.decode(f.read_bytes()).tensor()  # [layers, 2, tokens, 1, D]
        for layer in range(3):
            assert kv[layer, :, :BLOCK].abs().sum() == 0
            assert (kv[layer, :, BLOCK:].abs().sum(dim=(0, 2, 3)) > 0).all()
        assert (kv[3].abs().sum(dim=(0, 2, 3)) > 0).all()


def test_process_b_loads_what_process_a_saved(b: Engine, a_cold) -> None:
    b.reset()  # vLLM's own prefix cache holds P1 from the cold run above
    m = b.metrics()
    loaded = b.generate([P1, P2], max_tokens=12)
    d = {k: v - m.get(k, 0.0) for k, v in b.metrics().items()}
    assert d["loaded_tokens"] == len(P1) - 1 + len(P2) - 1, d
    assert d["load_misses"] == d["load_rejected"] == d["recomputed_tokens"] == 0, d
    assert loaded == a_cold
    b.reset()
    assert b.generate([P1, P2], max_tokens=12, cold=True) == loaded


def test_partial_hit_loads_the_shared_chunk(b: Engine, a_cold) -> None:
    """Q shares P1's first chunk: its windowed layers load the block A kept ([128, 256))."""
    b.reset()
    m = b.metrics()
    loaded = b.generate([Q], max_tokens=12)
    assert b.metrics()["loaded_tokens"] - m["loaded_tokens"] == CHUNK
    b.reset()
    assert b.generate([Q], max_tokens=12, cold=True) == loaded


def test_a_part_refused_at_load_recomputes_the_request(b: Engine, server: ServerProcess) -> None:
    s = prompt(560, 5)
    cold = b.generate([s], max_tokens=12, cold=True)  # B computes s and saves its 3 chunks
    for a in range(0, len(s), CHUNK):
        parts(server, s[a : a + CHUNK], HEADS)
    f = next(iter(parts(server, s[CHUNK : 2 * CHUNK], HEADS).values()))
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x40  # in the payload's last layer: present at lookup, refused by the stream
    f.write_bytes(bytes(data))
    b.reset()
    m = b.metrics()
    t0 = time.monotonic()
    assert b.generate([s], max_tokens=12) == cold
    assert time.monotonic() - t0 < 30  # reported failed, not left waiting
    d = {k: v - m.get(k, 0.0) for k, v in b.metrics().items()}
    assert d["load_misses"] + d["load_rejected"] >= 1, d
    assert d["recomputed_tokens"] == len(s) - 1 - CHUNK, d
