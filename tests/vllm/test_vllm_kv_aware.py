"""vllm-router's kv_aware policy fed by tierkv.vllm's KV events: a real `vllm-router --policy
kv_aware` in front of two real vLLM OpenAI servers (kv_both) sharing a real tierkv-server, each
publishing its KV events (vLLM's GPU blocks and tierkv's tiers, both at vLLM's block size) to
the router. Prompts are token ids: vllm-router 0.1.17 does not tokenize text for HTTP workers
(its kv_aware then finds no tokens to match). fp32, a tiny random Llama, greedy: the serving
replica's answer equals the prompt's first, cold one."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.api_server import ApiServer, completion, post, start_router, stop_all
from tests.vllm.conftest import prompt
from tierkv.cacheserver.launch import ServerProcess, free_port

CHUNK, BLOCK = 256, 128  # BLOCK: vLLM's CPU block size, the router's --kv-event-block-size


@pytest.fixture(scope="module")
def fleet(tiny: Path) -> Iterator[dict[str, Any]]:
    server = ServerProcess().start()
    extra = {"remote": f"grpc://{server.target}", "chunk_size": CHUNK, "cpu_bytes": "8MiB"}
    ports = [free_port(), free_port()]
    replicas = [
        ApiServer(tiny, extra, "kv_both", str(i), events=f"tcp://*:{p}")
        for i, p in enumerate(ports)
    ]
    procs: list[Any] = list(replicas)
    try:
        for r in replicas:
            r.wait()
        log = Path(f"/tmp/tierkv-vllm-kv-aware-router-{os.getpid()}.log")
        args = ["--host", "127.0.0.1", "--worker-urls", *(r.url for r in replicas)]
        args += ["--policy", "kv_aware", "--log-level", "debug"]
        for r, p in zip(replicas, ports):
            args += ["--kv-event-source", f"{r.url}=tcp://127.0.0.1:{p}"]
        args += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", str(tiny)]
        router, port = start_router(args, log)
        procs.append(router)
        yield {"replicas": replicas, "url": f"http://127.0.0.1:{port}"}
    finally:
        stop_all(procs)
        server.stop(kill=True)


def served(fleet: dict[str, Any]) -> list[float]:
    """Each replica's requests served so far."""
    return [r.metrics().get("vllm:request_success_total", 0.0) for r in fleet["replicas"]]


def ask(url: str, p: list[int]) -> list[int]:
    """The greedy answer's token ids to prompt p at a replica."""
    return completion(url, p, max_tokens=4)["choices"][0]["token_ids"]


def route(router: str, p: list[int]) -> dict[str, Any]:
    """Prompt p through the router, greedy. Without vLLM's `return_token_ids`: vllm-router
    0.1.17 credits no cached prefix to a request that carries it (credited_prefix_tokens=0
    in its debug log), so the answer's tokens are checked at the replica that served it."""
    body = {"prompt": p, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    return post(f"{router}/v1/completions", body)


def test_kv_aware_follows_gpu_and_tier_blocks(fleet: dict[str, Any]) -> None:
    replicas, router = fleet["replicas"], fleet["url"]
    # each prompt computed cold on one replica, told to the router by that replica's events;
    # replica 1 first, where a policy blind to the events (least loaded, first listed) would
    # pick replica 0
    for home, seed in ((1, 1), (0, 2)):
        p = prompt(300, seed)  # one chunk (two blocks) and a partial one
        cold = ask(replicas[home].url, p)
        time.sleep(1.0)  # the stored events reach the router
        # (a) asked again: the replica whose prefix cache holds it, each time
        first = served(fleet)
        for _ in range(3):
            assert route(router, p)["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK
        again = served(fleet)
        assert (again[home] - first[home], again[1 - home] - first[1 - home]) == (3, 0)
        assert ask(replicas[home].url, p) == cold  # its cached answer is the cold one
        # (b) its prefix cache reset (vLLM tells the router all its GPU blocks are gone):
        # tierkv's tiers there still hold the prompt's blocks, and the router still sends it
        hits = replicas[home].metrics().get("vllm:tierkv_hit_tokens_total", 0.0)
        replicas[home].reset()
        time.sleep(1.0)
        before = served(fleet)
        route(router, p)
        last = served(fleet)
        assert (last[home] - before[home], last[1 - home] - before[1 - home]) == (1, 0)
        loaded = replicas[home].metrics().get("vllm:tierkv_hit_tokens_total", 0.0) - hits
        assert loaded >= CHUNK  # from its tiers, not recomputed
        assert ask(replicas[home].url, p) == cold
