"""`tierkv-engine serve` as prefill and decode instances behind a real `vllm-router
--vllm-pd-disaggregation` process, sharing a real tierkv-server (fp32, greedy, the tiny test
model); kv_transfer_params checked field by field; the KV events a serve replica publishes,
read by a ZMQ subscriber."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from tests.serve_helpers import tiny_checkpoint, words
from tierkv.cacheserver.launch import ServeProcess, ServerProcess, free_port, wait_port
from tierkv.connector.event_blocks import chunk_blocks
from tierkv.engine import LLM, SamplingParams
from tierkv.engine.serve.kv_events import KVEventBatch

PROMPTS = [words([40 + (i * 7 + k) % 200 for i in range(60)]) for k in range(4)]
MAX = 6


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": "Bearer x"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        m = re.search(rf"^{name}_total (\S+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def cold(ckpt: Path, prompt: str) -> str:
    llm = LLM(ckpt, dtype="fp32", kv_cache_bytes=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    return words(llm.generate([llm.encode(prompt)], params, use_tqdm=False)[0].token_ids)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    """A tierkv-server with two namespaces (two tokens); prefill P and decode D in
    namespace a, F in namespace b; P publishes KV events; vllm-router in front of P and D."""
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("pd"))
    server = ServerProcess(args=["--tokens", "token-aaa=a,token-bbb=b"]).start()
    common = ["--model", str(ckpt), "--dtype", "fp32", "--cache-server", server.target]
    common += ["--chunk-size", "16", "--cpu-cache", "1MiB"]
    events, replay = free_port(), free_port()
    p = ServeProcess(
        *common, "--token", "token-aaa", "--kv-cache-bytes", str(1 << 17),
        "--kv-events-endpoint", f"tcp://*:{events}", "--kv-events-topic", "kv",
        "--kv-events-replay-endpoint", f"tcp://*:{replay}",
    )  # fmt: skip
    d = ServeProcess(*common, "--token", "token-aaa", "--kv-cache-bytes", str(4 << 20))
    f = ServeProcess(*common, "--token", "token-bbb", "--kv-cache-bytes", str(4 << 20))
    router = None
    try:
        for s in (p, d, f):
            s.wait(120)
        port = free_port()
        exe = shutil.which("vllm-router")
        assert exe is not None, "vllm-router is in the test extra: run `make setup`"
        log = open(p.log.parent / "router.log", "w")
        router = subprocess.Popen(
            [exe, "--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url]
            + ["--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
            + ["--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_port(port, 60)
        yield {
            "ckpt": ckpt,
            "p": p.url,
            "d": d.url,
            "f": f.url,
            "router": f"http://127.0.0.1:{port}",
            "events": events,
            "replay": replay,
            "server": server.target,
        }
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        for s in (p, d, f):
            s.stop()
        server.stop()


def test_pd_through_the_router(fleet: dict[str, Any]) -> None:
    """The router sends P the prompt (max_tokens=1, do_remote_decode), then D the request with
    P's kv_transfer_params: D loads all but the prompt's last token from the server and answers
    with the aggregated run's tokens."""
    import openai

    before = metric(fleet["d"], "tierkv_serve_pd_decodes")
    hits = metric(fleet["d"], "tierkv_serve_connector_hit_tokens")
    client = openai.OpenAI(base_url=fleet["router"] + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=MAX, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].text == cold(fleet["ckpt"], PROMPTS[0])
    u = r.usage
    by_source = u.model_extra["cached_tokens_by_source"]
    print(
        f"\ndecode usage through the router: {u.prompt_tokens} prompt tokens, {by_source}; "
        f"cached_tokens as the router rewrites it: {u.prompt_tokens_details.cached_tokens}"
    )
    # loaded from the server, not computed (the router rewrites cached_tokens in P/D mode; the
    # decode's own split passes through, and its counters say the same)
    assert by_source["remote"] == u.prompt_tokens - 1
    assert metric(fleet["d"], "tierkv_serve_connector_hit_tokens") == hits + u.prompt_tokens - 1
    assert metric(fleet["p"], "tierkv_serve_pd_prefills") >= 1
    assert metric(fleet["d"], "tierkv_serve_pd_decodes") == before + 1
    assert metric(fleet["d"], "tierkv_serve_pd_refused") == 0


def test_pd_streams_through_the_router(fleet: dict[str, Any]) -> None:
    """A streamed request: the router's prefill is not streamed, the decode streams its tokens
    (the aggregated run's) after loading the prompt from the server."""
    import openai

    before = metric(fleet["d"], "tierkv_serve_pd_decodes")
    client = openai.OpenAI(base_url=fleet["router"] + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=MAX, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    parts = [c.choices[0].text for c in stream if c.choices]
    assert len(parts) >= 2 and "".join(parts) == cold(fleet["ckpt"], PROMPTS[2])
    assert metric(fleet["d"], "tierkv_serve_pd_decodes") == before + 1


def test_prefill_parameters(fleet: dict[str, Any]) -> None:
    """P's answer names the extent and the salt, durable on the server, and no bytes."""
    code, out = post(
        fleet["p"],
        {"prompt": PROMPTS[1], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert code == 200
    t = out["kv_transfer_params"]
    s = t["tierkv"]
    n = out["usage"]["prompt_tokens"]
    assert t["do_remote_prefill"] is True and s["tokens"] == n
    assert s["chunks"] == -(-n // 16) == s["durable"]  # every chunk, the partial last one too
    assert set(s) == {"version", "fingerprint", "model", "tokens", "chunks", "durable", "key"}


@pytest.mark.parametrize(
    "params,field",
    [
        ([1], "kv_transfer_params"),
        ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
        (
            {"do_remote_prefill": True, "tierkv": {"version": 1}},
            "kv_transfer_params.tierkv.fingerprint",
        ),
        ({"do_remote_prefill": True, "tierkv": 7}, "kv_transfer_params.tierkv"),
    ],
)
def test_malformed_params_get_a_400(fleet: dict[str, Any], params: Any, field: str) -> None:
    before = metric(fleet["d"], "tierkv_serve_requests")
    code, out = post(
        fleet["d"], {"prompt": PROMPTS[2], "max_tokens": 2, "kv_transfer_params": params}
    )
    assert code == 400 and out["error"]["param"] == field
    assert metric(fleet["d"], "tierkv_serve_requests") == before  # nothing admitted


def test_foreign_params_load_nothing(fleet: dict[str, Any]) -> None:
    """F (namespace b) prefills a prompt; D (namespace a) given F's parameters loads none of b's
    KV and recomputes; parameters of another model are refused and counted."""
    want = cold(fleet["ckpt"], PROMPTS[3])
    code, out = post(
        fleet["f"],
        {"prompt": PROMPTS[3], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert code == 200 and out["kv_transfer_params"]["tierkv"]["durable"] > 0
    params = out["kv_transfer_params"]
    refused = metric(fleet["d"], "tierkv_serve_pd_refused")
    body = {"prompt": PROMPTS[3], "max_tokens": MAX, "temperature": 0, "ignore_eos": True}
    code, got = post(fleet["d"], {**body, "kv_transfer_params": params})
    assert code == 200 and got["choices"][0]["text"] == want
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing of b's KV
    other = {**params, "tierkv": {**params["tierkv"], "fingerprint": "0" * 32}}
    code, got = post(fleet["d"], {**body, "cache_salt": "t2", "kv_transfer_params": other})
    assert code == 200 and got["choices"][0]["text"] == want
    assert metric(fleet["d"], "tierkv_serve_pd_refused") == refused + 1


def put_and_delete(target: str) -> bytes:
    """Another client of namespace a stores a one-block chunk on the server, then deletes it."""
    import asyncio

    import torch

    from tierkv.cacheserver.client import RemoteTier
    from tierkv.storage_backends.segment import KVSegment

    key = b"shared-by-other1"
    seg = KVSegment.from_tensor(
        torch.zeros(2, 2, 16, 1, 8), key=key, tokens=list(range(1000, 1016)), fingerprint=b"t"
    )

    async def go() -> None:
        t = RemoteTier(target=target, token="token-aaa")
        try:
            assert await t.put(key, seg)
            await asyncio.sleep(0.5)
            assert await t.delete(key)
        finally:
            await t.close()

    asyncio.run(go())
    return key


def test_events_decoded_by_a_subscriber(fleet: dict[str, Any]) -> None:
    """P's events, replayed from seq 0 and read live: its prefix-cache blocks (GPU), its cpu
    tier and the server (ownership SERVER), and removals from the prefix cache as it evicts;
    what another client stores on the server and deletes there reaches P's events too."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{fleet['events']}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    for k in range(6):  # 16 blocks of KV cache: later prompts evict earlier prompts' blocks
        prompt = words([30 + (i * 11 + k) % 150 for i in range(64)])
        assert post(fleet["p"], {"prompt": prompt, "max_tokens": 1})[0] == 200
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    assert sub.poll(10_000), "no live batch on the PUB socket"
    topic, _, payload = sub.recv_multipart()
    assert topic == b"kv" and decode(payload).events
    sub.close(linger=0)
    other = put_and_delete(fleet["server"])
    time.sleep(0.5)  # the last batches out
    replay = ctx.socket(zmq.DEALER)  # vLLM's replay protocol: a ROUTER answers many frames
    replay.connect(f"tcp://127.0.0.1:{fleet['replay']}")
    replay.send_multipart((b"", (0).to_bytes(8, "big")))
    seen: list[Any] = []
    while True:
        assert replay.poll(10_000), "the replay socket did not answer"
        _, topic, seq, payload = replay.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        assert topic == b"kv"
        seen += decode(payload).events
    replay.close(linger=0)
    stored = {(type(e).__name__, e.medium, e.ownership) for e in seen}
    print(f"\n{len(seen)} events: {sorted(stored, key=str)}")
    assert ("BlockStored", "GPU", None) in stored
    assert ("BlockStored", "CPU", None) in stored
    assert ("BlockStored", None, "SERVER") in stored
    assert ("BlockRemoved", "GPU", None) in stored
    gpu = [e for e in seen if type(e).__name__ == "BlockStored" and e.medium == "GPU"]
    assert all(len(e.token_ids) == 16 * len(e.block_hashes) for e in gpu)
    on_server = [e for e in seen if e.ownership == "SERVER"]
    block = chunk_blocks(other, 1)[0]
    told = [e for e in on_server if block in e.block_hashes]
    assert [type(e).__name__ for e in told] == ["BlockStored", "BlockRemoved"], told
    assert told[0].token_ids == list(range(1000, 1016)) and told[0].locality == "REMOTE"
