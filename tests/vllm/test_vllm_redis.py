"""tierkv.vllm with Redis as the shared tier (no tierkv-server): process A saves, process B
loads under chunked prefill (64-token steps) and a KV space so small that requests are
preempted, with the tokens of B's own cold run. fp32, a tiny random Llama."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.conftest import prompt
from tests.vllm.harness import Engine
from tierkv.cacheserver.launch import RedisProcess

PROMPTS = [prompt(200 + 24 * i, 10 + i) for i in range(4)]
SMALL = {  # 64-token prefill steps; 20 blocks of 32 tokens for four ~250-token requests
    "block_size": 32,
    "num_gpu_blocks_override": 20,
    "max_num_batched_tokens": 64,
    "max_model_len": 512,
    "max_num_seqs": 4,
}


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    r = RedisProcess().start()
    yield r.url
    r.stop(kill=True)


def extra(url: str) -> dict:
    return {"remote": url, "chunk_size": 64, "cpu_bytes": "8MiB"}


def test_redis_cross_process_under_chunked_prefill_and_preemption(redis_url, tiny: Path) -> None:
    a = Engine(tiny, extra(redis_url)).start()
    try:
        saved = a.generate(PROMPTS[:2], max_tokens=16)
        a.wait_saved(2 * 8)  # 2 KV head parts of 3 full chunks + 1 partial each
    finally:
        a.close()
    b = Engine(tiny, extra(redis_url), knobs=dict(SMALL)).start()
    try:
        loaded = b.generate(PROMPTS, max_tokens=48)
        m = b.metrics()
        assert m["loaded_tokens"] >= sum(len(p) - 1 for p in PROMPTS[:2])
        assert m["load_rejected"] == m["load_errors"] == 0
        assert b.send({"op": "counters"}).get("vllm:num_preemptions", 0) >= 1
        b.reset()
        cold = b.generate(PROMPTS, max_tokens=48, cold=True)
        assert loaded == cold
        assert [t[:16] for t in loaded[:2]] == saved  # and A's tokens (no chunking there)
    finally:
        b.close()
