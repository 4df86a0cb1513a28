"""Two `tierkv-engine serve` replicas sharing one tierkv-server (real subprocesses): a
conversation started on replica A and continued on replica B loads A's KV from the server and
answers with the tokens of a cold run (fp32, greedy)."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.serve_helpers import tiny_checkpoint, words
from tierkv.cacheserver.launch import ServeProcess, ServerProcess
from tierkv.engine import LLM, SamplingParams

SYSTEM = words([40 + i % 200 for i in range(300)])  # a long shared history to carry over
TURNS = [words([10 + t, 11, 12, 13, 14]) for t in range(3)]
REPLY = 8


def saved_chunks(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        m = re.search(r"^tierkv_connector_saved_chunks_total (\S+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def settle(url: str, timeout: float = 15.0) -> None:
    """Wait until a replica's background saves stop (its stored-chunk count holds still)."""
    last, since, deadline = -1.0, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = saved_chunks(url)
        if now != last:
            last, since = now, time.monotonic()
        elif now > 0 and time.monotonic() - since > 0.5:
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("replicas"))


def test_conversation_moves_to_the_other_replica(ckpt: Path) -> None:
    server = ServerProcess().start()
    flags = [
        "--dtype",
        "fp32",
        "--cache-server",
        f"grpc://{server.target}",
        "--chunk-size",
        "16",
        "--cpu-cache",
        "16MiB",
        "--kv-cache-bytes",
        str(8 << 20),
    ]
    flags = ["--model", str(ckpt), *flags]
    a, b = ServeProcess(*flags), ServeProcess(*flags)
    try:
        a.wait(), b.wait()
        ca, cb = (openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0) for r in (a, b))
        history = [{"role": "system", "content": SYSTEM}]
        usages = []
        for turn, client in zip(TURNS, (ca, ca, cb)):
            history.append({"role": "user", "content": turn})
            r = client.chat.completions.create(
                model="tiny",
                messages=history,
                max_tokens=REPLY,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            history.append({"role": "assistant", "content": r.choices[0].message.content})
            usages.append(r.usage)
            if client is ca:
                settle(a.url)
        last = usages[-1]
        by_source = last.model_extra["cached_tokens_by_source"]
        # the history: the third prompt up to its new user message ("w2 ... w5 w4")
        carried = last.prompt_tokens - (len(TURNS[2].split()) + 3)
        remote = by_source.get("remote", 0)
        print(
            f"\nturn 3 on replica B: {last.prompt_tokens} prompt tokens, history {carried}, "
            f"{remote} from the shared server ({remote / carried:.1%}); {by_source}"
        )
        assert remote >= 0.9 * carried and by_source["prefix_cache"] == 0
        assert last.prompt_tokens_details.cached_tokens == remote
    finally:
        for p in (a, b):
            p.stop()
        server.stop()
    # the same answer as a cold engine on the same prompt
    cold = LLM(ckpt, dtype="fp32", kv_cache_bytes=1 << 22)
    prompt = cold.chat_prompt(history[:-1])
    assert len(prompt) == last.prompt_tokens
    want = cold.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=REPLY, ignore_eos=True), use_tqdm=False
    )[0]
    assert history[-1]["content"] == words(want.token_ids)
