"""Prefill/decode disaggregation through a real vllm-router (`--vllm-pd-disaggregation`) in front
of two real vLLM OpenAI servers (prefill `kv_producer`, decode `kv_consumer`) that move the
prompt's KV through a real tierkv-server. fp32, a tiny random Llama, greedy: every answer equals
the decode instance's cold answer (an aggregated run: it computed the whole prompt itself)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.api_server import ApiServer, completion, start_router, stop_all
from tests.vllm.conftest import prompt
from tierkv.cacheserver.launch import ServerProcess

CHUNK = 64
P1, P3, P4 = prompt(300, 31), prompt(200, 33), prompt(260, 34)
EXTRA = {"chunk_size": CHUNK, "token": "tok-pd-123456", "load_timeout_s": 3.0}


@pytest.fixture(scope="module")
def fleet(tiny: Path) -> Iterator[dict]:
    server = ServerProcess(args=["--tokens", "tok-pd-123456=team-pd"]).start()
    extra = {**EXTRA, "remote": f"grpc://{server.target}"}
    prefill = ApiServer(tiny, extra, "kv_producer", "0")
    decode = ApiServer(tiny, extra, "kv_consumer", "1")
    procs: list = [prefill, decode]
    try:
        prefill.wait(), decode.wait()
        # cold answers, computed whole by the decode instance, which never saves
        answers = [completion(decode.url, p)["choices"][0]["token_ids"] for p in (P1, P3, P4)]
        cold = dict(zip(map(tuple, (P1, P3, P4)), answers))
        decode.reset()
        log = Path(f"/tmp/tierkv-vllm-router-{os.getpid()}-pd.log")
        args = ["--vllm-pd-disaggregation", "--policy", "round_robin"]
        router, port = start_router(args + ["--prefill", prefill.url, "--decode", decode.url], log)
        procs.append(router)
        yield {"prefill": prefill, "decode": decode, "cold": cold, "router": port, "log": log}
    finally:
        stop_all(procs)
        server.stop(kill=True)


def cold(fleet: dict, p: list[int]) -> list[int]:
    return fleet["cold"][tuple(p)]


def grown(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_router_pd(fleet: dict) -> None:
    decode, prefill = fleet["decode"], fleet["prefill"]
    d0, p0 = decode.metrics(), prefill.metrics()
    out = completion(f"http://127.0.0.1:{fleet['router']}", P1)
    assert out["choices"][0]["token_ids"] == cold(fleet, P1)
    d1, p1 = decode.metrics(), prefill.metrics()
    assert grown(p0, p1, "vllm:tierkv_pd_handoffs_total") == 1
    # the decode instance loaded the whole prompt but its last token (vLLM computes that one)
    assert grown(d0, d1, "vllm:external_prefix_cache_hits_total") == len(P1) - 1
    assert grown(d0, d1, "vllm:tierkv_loaded_tokens_total") == len(P1) - 1
    # one lookup found every chunk: they were on the server before the prefill's answer left
    assert grown(d0, d1, "vllm:tierkv_lookups_total") == 1
    assert grown(d0, d1, "vllm:tierkv_pd_timeouts_total") == 0
    # vLLM reports the prefill instance's hits as the decode's cached tokens ("In a remote
    # prefill scenario, report cached tokens as cache hit rate on the remote P worker.")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def handoff(fleet: dict, p: list[int]) -> dict:
    """The router's first leg, by hand: the prefill instance's answer to a remote-decode
    request."""
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    return completion(fleet["prefill"].url, p, 1, params)


def test_prefill_params(fleet: dict) -> None:
    before = fleet["prefill"].metrics()
    params = handoff(fleet, P1)["kv_transfer_params"]  # again: vLLM's own prefix cache hit
    # kv_producer: saves, never looks up or loads
    assert grown(before, fleet["prefill"].metrics(), "vllm:tierkv_lookups_total") == 0
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    body = params["tierkv"]
    assert body["tokens"] == len(P1) and body["chunks"] == -(-len(P1) // CHUNK)
    assert len(bytes.fromhex(body["salt"])) == 16
    assert "team-pd" not in str(params) and "tok-pd" not in str(params)


@pytest.mark.parametrize(
    "claim,counter",
    [
        ({"tokens": 200, "chunks": 4, "salt": "00" * 16}, "vllm:tierkv_pd_refused_total"),
        ("not an object", "vllm:tierkv_pd_refused_total"),
        ({"tokens": 200, "chunks": 9, "salt": None}, "vllm:tierkv_pd_refused_total"),
        (None, "vllm:tierkv_pd_timeouts_total"),  # this salt, a prompt never prefilled
    ],
)
def test_foreign_params(fleet: dict, claim: object, counter: str) -> None:
    """A claim of another salt, a malformed one, or one of chunks that were never stored:
    nothing loads, the prompt is computed, the right tokens."""
    decode = fleet["decode"]
    if claim is None:
        salt = handoff(fleet, P1)["kv_transfer_params"]["tierkv"]["salt"]
        claim = {"tokens": len(P3), "chunks": -(-len(P3) // CHUNK), "salt": salt}
    decode.reset()
    before = decode.metrics()
    out = completion(decode.url, P3, params={"do_remote_prefill": True, "tierkv": claim})
    assert out["choices"][0]["token_ids"] == cold(fleet, P3)
    after = decode.metrics()
    assert grown(before, after, counter) == 1
    assert grown(before, after, "vllm:external_prefix_cache_hits_total") == 0


def test_prefill_killed_after_its_answer(fleet: dict) -> None:
    """The prefill instance crashes once it answered: the decode loads the prompt from the
    server."""
    params = handoff(fleet, P4)["kv_transfer_params"]
    fleet["prefill"].kill()
    decode = fleet["decode"]
    before = decode.metrics()
    out = completion(decode.url, P4, params=params)
    assert out["choices"][0]["token_ids"] == cold(fleet, P4)
    after = decode.metrics()
    assert grown(before, after, "vllm:external_prefix_cache_hits_total") == len(P4) - 1
    assert grown(before, after, "vllm:tierkv_lookups_total") == 1
    assert grown(before, after, "vllm:tierkv_pd_timeouts_total") == 0
