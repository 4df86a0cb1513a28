"""tierkv serve through real clients: the openai package (streaming and not), raw HTTP for the
error cases, 32 concurrent streaming clients, client disconnects and overload."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.serve_helpers import ThreadServer, tiny_checkpoint, words
from tierkv.engine import LLM, SamplingParams

CHAT = [
    {"role": "system", "content": words(list(range(40, 70)))},
    {"role": "user", "content": "w20 w21 w22"},
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM(
        tiny_checkpoint(tmp_path_factory.mktemp("serve")), dtype="fp32", kv_cache_bytes=1 << 22
    )


PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def want(llm: LLM) -> list[int]:
    """The engine's own greedy tokens, run before the server's thread owns the engine."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids


@pytest.fixture(scope="module")
def other_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """For servers of their own: one engine thread per LLM."""
    return LLM(
        tiny_checkpoint(tmp_path_factory.mktemp("serve2")), dtype="fp32", kv_cache_bytes=1 << 22
    )


@pytest.fixture(scope="module")
def server(llm: LLM, want: list[int]):
    with ThreadServer(llm) as s:
        yield s


@pytest.fixture
def client(server: ThreadServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completion_matches_the_engine(client: openai.OpenAI, want: list[int]) -> None:
    prompt = PROMPT
    r = client.completions.create(
        model="tiny",
        prompt=words(prompt),
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    assert r.object == "text_completion" and c.text == words(want)
    assert c.finish_reason == "length" and len(c.logprobs.tokens) == 6
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs) and c.logprobs.text_offset[0] == 0
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6
    assert r.usage.total_tokens == 11 and r.usage.prompt_tokens_details.cached_tokens >= 0
    # token-id prompts and a batch of prompts: one choice per prompt
    r = client.completions.create(
        model="tiny",
        prompt=[prompt, prompt[:3]],
        max_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == words(want[:2])


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="tiny", messages=CHAT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and len(text.split()) == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # the second identical request hits the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16
    assert chunks[-1].usage.model_extra["cached_tokens_by_source"]["prefix_cache"] >= 16


def test_sampling_n_seed_stop_and_logprobs(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        messages=CHAT,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        n=3,
        extra_body={"ignore_eos": True},
    )
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert len(texts) == 3 and texts == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 18
    greedy = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    out = greedy.choices[0].message.content.split()
    lp = greedy.choices[0].logprobs.content
    assert [t.token for t in lp] == out and all(len(t.top_logprobs) == 3 for t in lp)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in lp)  # greedy: the top token
    cut = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        stop=[out[2]],
        extra_body={"ignore_eos": True},
    )
    want = " ".join(out[: out.index(out[2])])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content.strip() == want


def test_cache_salt_isolates_the_prefix_cache(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": words(list(range(100, 140)))}]
    kw: dict[str, Any] = dict(model="tiny", messages=msgs, max_tokens=1, temperature=0)
    client.chat.completions.create(**kw)
    cached = lambda r: r.usage.prompt_tokens_details.cached_tokens
    assert cached(client.chat.completions.create(**kw)) >= 32
    salted = dict(kw, extra_body={"cache_salt": "tenant-a"})
    assert cached(client.chat.completions.create(**salted)) == 0
    assert cached(client.chat.completions.create(**salted)) >= 32
    other = dict(kw, extra_body={"cache_salt": "tenant-b"})
    assert cached(client.chat.completions.create(**other)) == 0


@pytest.mark.parametrize(
    "body,param",
    [
        (b"{not json", None),
        ({"prompt": "w1", "temperature": 5}, "temperature"),
        ({"prompt": "w1", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "w1", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "w1", "n": 0}, "n"),
        ({"prompt": "w1", "top_p": 0}, "top_p"),
        ({"prompt": "w1", "logprobs": 99}, "logprobs"),
        ({"prompt": "w1", "stop": [1, 2]}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 999]}, "prompt"),
        ({"prompt": "w1", "presence_penalty": 1}, "presence_penalty"),
        ({"prompt": "w1", "blend_rule": "cacheblend+query_late"}, "blend_rule"),
        ({"prompt": "w1", "blend_rule": "nope"}, "blend_rule"),
        ({"prompt": "w1", "blend_rule": 3}, "blend_rule"),
        ({"prompt": "w1", "blend_ratio": 1.5}, "blend_ratio"),
        ({"prompt": " ".join(["w1"] * 600)}, None),  # longer than max_model_len
        ([1, 2], None),
    ],
)
def test_bad_completions_get_400(server: ThreadServer, body: Any, param: str | None) -> None:
    status, got = post(server.url + "/v1/completions", body)
    assert status == 400 and got["error"]["message"] and got["error"]["param"] == param


def test_other_client_errors(server: ThreadServer) -> None:
    url = server.url + "/v1/chat/completions"
    for body, code in [
        ({"messages": []}, 400),
        ({"messages": [{"role": "x", "content": "w1"}]}, 400),
        ({"messages": CHAT, "model": "gpt-9"}, 404),
        ({"messages": CHAT, "top_logprobs": 2}, 400),
        ({"messages": CHAT, "documents": [3]}, 400),
    ]:
        status, got = post(url, body)
        assert status == code and got["error"]["message"], body
    status, got = post(server.url + "/v1/nowhere", {})
    assert status == 404 and got["error"]["message"]


def test_api_key(other_llm: LLM) -> None:
    with ThreadServer(other_llm, api_key="sekrit") as s:
        body = {"prompt": "w1 w2", "max_tokens": 1}
        for headers in [{}, {"Authorization": "Bearer nope"}, {"Authorization": "sekrit"}]:
            status, got = post(s.url + "/v1/completions", body, headers)
            assert status == 401 and "API key" in got["error"]["message"]
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="w1 w2", max_tokens=1).choices
        with urllib.request.urlopen(s.url + "/health", timeout=10) as r:
            assert r.status == 200  # probes need no key


def _stream_words(server: ThreadServer, max_tokens: int, results: list[Any]) -> None:
    async def one(i: int, c: openai.AsyncOpenAI) -> int:
        stream = await c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": words([30 + i, 31, 32])}],
            max_tokens=max_tokens - i % 5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        return len(text.split())

    async def main() -> None:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        results.extend(
            await asyncio.gather(*(one(i, c) for i in range(32)), return_exceptions=True)
        )

    asyncio.run(main())


def test_32_concurrent_streaming_clients(server: ThreadServer, llm: LLM) -> None:
    steps, results = llm.stats.steps, []
    _stream_words(server, 40, results)
    assert results == [40 - i % 5 for i in range(32)]
    # one batch for all: far fewer engine steps than tokens produced
    assert llm.stats.steps - steps < sum(results) / 4
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for name in (
        "tierkv_serve_ttft_seconds_count",
        "tierkv_serve_tpot_seconds_bucket",
        "tierkv_serve_waiting",
        "tierkv_serve_kv_usage",
        "tierkv_serve_prefix_cache_hit_tokens_total",
    ):
        assert name in text
    with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == "tiny"


def _idle(llm: LLM, server: ThreadServer, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.server.engine.jobs and not llm.scheduler.has_work():
            return llm.blocks.num_available() == llm.blocks.num_blocks
        time.sleep(0.05)
    return False


def test_disconnect_aborts_and_frees_blocks(server: ThreadServer, llm: LLM) -> None:
    body = {
        "model": "tiny",
        "prompt": "w3 w4 w5",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    before = server.server.metrics.aborted._value.get()
    req = urllib.request.Request(
        server.url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    r = urllib.request.urlopen(req, timeout=30)
    assert r.readline().startswith(b"data: ")
    r.close()  # the client goes away mid-stream
    assert _idle(llm, server), "the aborted request still holds blocks"
    assert server.server.metrics.aborted._value.get() == before + 1
    # non-streaming: a client that times out (here while the engine is held) is aborted too
    with gated(llm) as gate:
        with pytest.raises(openai.APITimeoutError):
            openai.OpenAI(
                base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=0.5
            ).completions.create(model="tiny", prompt="w3", max_tokens=100)
        gate.set()
        assert _idle(llm, server)
    assert server.server.metrics.aborted._value.get() == before + 2


@contextlib.contextmanager
def gated(llm: LLM) -> Iterator[threading.Event]:
    """Hold the engine's steps until the event is set: requests stay pending meanwhile."""
    gate, step = threading.Event(), llm.step
    llm.step = lambda: (gate.wait(30), step())[1]  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        gate.set()
        del llm.step


def test_overload_gets_429(other_llm: LLM) -> None:
    with ThreadServer(other_llm, max_pending=2) as s, gated(other_llm) as gate:
        body = {"prompt": "w3 w4", "max_tokens": 4}
        held = [
            threading.Thread(target=post, args=(s.url + "/v1/completions", body)) for _ in range(2)
        ]
        for t in held:
            t.start()
        while s.server.engine.inflight < 2:
            time.sleep(0.01)
        t0 = time.monotonic()
        status, got = post(s.url + "/v1/completions", {"prompt": "w1", "max_tokens": 1})
        assert status == 429 and "retry" in got["error"]["message"] and time.monotonic() - t0 < 5
        gate.set()
        for t in held:
            t.join(30)
        status, _ = post(s.url + "/v1/completions", {"prompt": "w1", "max_tokens": 1})
        assert status == 200


def test_cli_serve_parses(tmp_path: Path) -> None:
    from tierkv.engine.cli import build_parser
    from tierkv.engine.serve.cli import config_of

    args = build_parser().parse_args(["serve", "--model", "m", "--api-key", "k", "--port", "9"])
    cfg = config_of(args)
    assert (cfg.host, cfg.port, cfg.api_key, cfg.model_name) == ("127.0.0.1", 9, "k", "m")


def test_compose_runs_two_replicas_on_the_server() -> None:
    import yaml

    from tierkv.engine.cli import build_parser

    root = Path(__file__).resolve().parent.parent
    services = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]
    port = services["tierkv-server"]["environment"]["TIERKV_PORT"]
    published = set()
    for name in ("serve-a", "serve-b"):
        svc = services[name]
        args = build_parser().parse_args(svc["command"])
        assert svc["entrypoint"] == ["tierkv-engine"] and args.cmd == "serve"
        assert args.cache_server == f"grpc://tierkv-server:{port}" and args.host == "0.0.0.0"
        assert all(p.startswith("127.0.0.1:") for p in svc["ports"])
        published |= set(svc["ports"])
    assert len(published) == 2


def test_compose_router_fronts_the_two_replicas() -> None:
    """The compose file's router command parses with vllm-router's own parser and names the
    two serve replicas as its workers."""
    import yaml
    from vllm_router.launch_router import parse_router_args

    root = Path(__file__).resolve().parent.parent
    services = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]
    router = services["router"]
    args = parse_router_args(router["command"])
    assert router["entrypoint"] == ["vllm-router"] and args.policy == "cache_aware"
    assert args.worker_urls == ["http://serve-a:8000", "http://serve-b:8000"]
    assert router["ports"] == ["127.0.0.1:8000:8000"]
