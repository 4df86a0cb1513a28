"""tierkv-fleet with real processes: two `tierkv-engine serve` replicas behind a real vllm-router
over one tierkv-server, and two nodes (a server each) over a real Redis Cluster whose master
fails over. Every answer is checked against the engine's own cold run (fp32, greedy)."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.serve_helpers import tiny_checkpoint
from tierkv.cacheserver.fleet import Fleet, FleetConfig, healthy
from tierkv.engine import LLM, SamplingParams

SYSTEM = list(range(10, 74))  # a shared 64-token prefix: 4 chunks of 16
QUESTIONS = [[200 + i, 201 + i, 202 + i] for i in range(4)]
# prompts with nothing in common: each is a first sighting for a replica that has not seen it
ALONE = [random.Random(k).sample(range(4, 250), 67) for k in range(6)]
NEW = 8
RUN: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 10}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("fleet-model"))


@pytest.fixture(scope="module")
def cold(ckpt: Path) -> dict[tuple[int, ...], str]:
    """The engine's own greedy answers, no cache anywhere."""
    llm = LLM(str(ckpt), dtype="fp32", kv_cache_bytes=1 << 22, enable_prefix_caching=False)
    prompts = [SYSTEM + q for q in QUESTIONS] + ALONE
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {tuple(p): o.text for p, o in zip(prompts, outs)}


def config(ckpt: Path, log_dir: Path, **kw: Any) -> FleetConfig:
    knobs: dict[str, Any] = {"dtype": "fp32", "chunk_size": 16, "replica_cpu": "8MiB"}
    return FleetConfig(model=str(ckpt), server_cpu="64MiB", log_dir=log_dir, **(knobs | kw))


def complete(url: str, prompt: list[int], stream: bool = False) -> tuple[str, dict[str, Any]]:
    """(text, usage) of a greedy completion of token ids at url (a router or a replica)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0}
    body |= {"ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        if not stream:
            out = json.loads(r.read())
            return out["choices"][0]["text"], out["usage"]
        text, usage, finished = "", {}, None
        for line in r:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
                finished = next(
                    (c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")),
                    finished,
                )
                usage = chunk.get("usage") or usage
        if finished is None:  # the stream was cut (a replica died behind the router)
            raise ConnectionError(f"stream ended without a finish_reason after {text!r}")
        return text, usage


@pytest.fixture(scope="module")
def fleet(ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    f = Fleet(config(ckpt, tmp_path_factory.mktemp("fleet-logs"), policy="round_robin"))
    f.start()
    yield f
    f.stop()


def test_router_answers_equal_cold_and_the_prefix_loads_on_every_replica(
    fleet: Fleet, cold: dict[tuple[int, ...], str]
) -> None:
    """Round robin sends the questions to both replicas: every answer, streamed or not, is the
    cold one, and after the first request each replica finds the shared prefix cached (its own
    blocks, or the server that the other replica saved it to)."""
    loaded = []
    for i, q in enumerate(QUESTIONS):
        prompt = SYSTEM + q
        text, usage = complete(fleet.url, prompt, stream=bool(i % 2))
        assert text == cold[tuple(prompt)]
        if i:
            loaded.append(usage["prompt_tokens_details"]["cached_tokens"])
        else:  # the replica's saves reach the server write-behind, after its answer left
            time.sleep(2.0)
    assert all(n >= len(SYSTEM) for n in loaded), loaded
    assert all(healthy(r.url) for r in fleet.replicas)


def test_a_replica_killed_mid_stream_gets_an_error_or_the_cold_answer(
    fleet: Fleet, cold: dict[tuple[int, ...], str]
) -> None:
    """Streams in flight while replica 1 is killed: each ends (no hang) with the cold answer or
    an error; afterwards the router sends everything to the live replica, with cold answers."""
    prompt = SYSTEM + QUESTIONS[0]
    results: list[str | Exception] = []

    def ask() -> None:
        try:
            results.append(complete(fleet.url, prompt, stream=True)[0])
        except Exception as e:  # the killed replica's stream: an error, not wrong tokens
            results.append(e)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    fleet.replicas[1].stop(kill=True)
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads) and len(results) == 4
    assert all(r == cold[tuple(prompt)] for r in results if isinstance(r, str)), results
    deadline = time.monotonic() + 60
    answers = []
    while len(answers) < 4 and time.monotonic() < deadline:
        try:
            answers.append(complete(fleet.url, prompt)[0])
        except Exception:
            time.sleep(1)  # the router's health check has not yet taken replica 1 out
    assert answers == [cold[tuple(prompt)]] * 4


def test_two_nodes_share_kv_through_a_redis_cluster_that_fails_over(
    ckpt: Path, cold: dict[tuple[int, ...], str], tmp_path: Path
) -> None:
    """Node A's replica stores prompts (through its server into the cluster); a cluster master is
    killed; node B's replica answers them from the cluster through its own server."""
    f = Fleet(config(ckpt, tmp_path, nodes=2, replica_cpu="0", policy="round_robin"))
    f.start()
    try:
        a, b = f.replicas
        assert f.servers[0].port != f.servers[1].port
        prompts = ALONE
        for p in prompts:
            assert complete(a.url, p)[0] == cold[tuple(p)]
        from tierkv.cacheserver.launch_cluster import RedisCluster

        assert isinstance(f.redis, RedisCluster)
        # A's server writes behind its answers: wait until the cluster holds every chunk of
        # every prompt (4 a prompt), then until each master's replica has acknowledged them.
        deadline = time.monotonic() + 60
        while (stored := redis_count(f.servers[0].port)) < 4 * len(prompts):
            assert time.monotonic() < deadline, f"A's server stored {stored} chunks"
            time.sleep(0.5)
        while not all(replicated(n.port) for n in f.redis.nodes[: f.redis.masters]):
            assert time.monotonic() < deadline, "the replicas did not catch up"
            time.sleep(0.2)
        f.redis.nodes[0].stop(kill=True)  # a master (redis-cli makes the first nodes masters)
        # Failed over once B's server counts every chunk again: its cluster client then has the
        # new topology (a count before that is a fault: a pause of the tier, then a retry).
        deadline = time.monotonic() + 90
        while (seen := redis_count(f.servers[1].port)) < stored:
            assert time.monotonic() < deadline, f"B's server sees {seen} of {stored} chunks"
            time.sleep(1)
        # Node B has never seen these prompts: their prefixes come through B's server from the
        # cluster; every answer is the cold one.
        sources = []
        for p in prompts:
            text, usage = complete(b.url, p)
            assert text == cold[tuple(p)]
            sources.append(usage["cached_tokens_by_source"])
        assert all(s.get("remote", 0) >= len(SYSTEM) for s in sources), sources
    finally:
        f.stop()


def replicated(port: int) -> bool:
    """Whether the Redis master at port has a replica that acknowledged all it wrote."""
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "replication"], **RUN).stdout
    info = dict(line.split(":", 1) for line in out.split() if ":" in line)
    replicas = [
        dict(kv.split("=") for kv in v.split(","))
        for k, v in info.items()
        if k.startswith("slave") and k[5:].isdigit()
    ]
    return any(int(r["offset"]) >= int(info["master_repl_offset"]) for r in replicas)


def redis_count(port: int) -> int:
    """The redis tier's count of the default namespace on the tierkv-server at port (a SCAN of
    every master; its last count where the cluster did not answer)."""
    from tierkv.cacheserver.client import RemoteTier

    async def ask() -> int:
        tier = RemoteTier(target=f"127.0.0.1:{port}", timeout_s=10)
        try:
            st = await tier.server_stats()
        finally:
            await tier.close()
        assert st is not None
        return next(t.count for t in st.tiers if t.name == "redis")

    return asyncio.run(ask())


def test_fleet_command_line_parses() -> None:
    from tierkv.cacheserver.fleet_cli import parser

    args = parser().parse_args(["--model", "m", "--pd", "--nodes", "2", "--policy", "kv_aware"])
    assert (args.pd, args.nodes, args.policy, args.replicas) == (True, 2, "kv_aware", None)
    with pytest.raises(SystemExit):
        parser().parse_args(["--model", "m", "--policy", "nearest"])


def test_kv_aware_routes_by_the_replicas_events(
    ckpt: Path, cold: dict[tuple[int, ...], str], tmp_path: Path
) -> None:
    """vllm-router's kv_aware policy fed by serve's KV events (prefix-cache blocks as GPU,
    connector tiers as CPU / SERVER): a prompt first computed on replica 1 (where a router blind
    to the events, falling back to the least loaded, would pick replica 0) is sent there, its
    own prefix cache answering, each time."""
    f = Fleet(config(ckpt, tmp_path, policy="kv_aware"))
    f.start()
    try:
        assert len(f.events) == 2  # every replica publishes, the router subscribes to each
        home = f.replicas[1].url
        for p in ALONE[:3]:
            first = complete(home, p)
            assert first[0] == cold[tuple(p)]
            time.sleep(1.0)  # the stored events reach the router
            again = [complete(f.url, p) for _ in range(3)]
            assert all(text == cold[tuple(p)] for text, _ in again)
            local = [u["cached_tokens_by_source"].get("prefix_cache", 0) for _, u in again]
            assert all(n >= 64 for n in local), local  # replica 1's own blocks each time
    finally:
        f.stop()
