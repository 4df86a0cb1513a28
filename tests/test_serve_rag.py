"""RAG documents as reusable segments in chat requests (CacheBlend), and cache_salt in the
connector's keys, through tierkv serve with a TierKVConnector."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.serve_helpers import ThreadServer, tiny_checkpoint, words
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM
from tierkv.storage_backends.build import TiersConfig

DOCS = [words(list(range(100, 148))), words(list(range(150, 198)))]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    conn = TierKVConnector(ConnectorConfig(chunk_size=16, tiers=TiersConfig(cpu_bytes="16MiB")))
    llm = LLM(
        tiny_checkpoint(tmp_path_factory.mktemp("rag")),
        dtype="fp32",
        kv_cache_bytes=1 << 22,
        kv_connector=conn,
        enable_prefix_caching=False,
        blend_calibration="off",  # a random checkpoint has no calibration: blend by the knobs
    )
    with ThreadServer(llm) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    conn.close()


def ask(client: openai.OpenAI, docs: list[str], question: str, **extra: Any) -> Any:
    msgs = [{"role": "system", "content": "w7 w8 w9"}, {"role": "user", "content": question}]
    return client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=4,
        temperature=0,
        extra_body={"documents": docs, **extra},
    )


def test_documents_are_reused_in_any_order(client: openai.OpenAI) -> None:
    first = ask(client, DOCS, "w20 w21")
    assert first.choices[0].message.content
    # first sighting: computed in the prompt's prefill, not stored (segment_admit_after=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the same documents in the other order, another question: the second sighting stores
    # them and their KV loads (blended)
    again = ask(client, DOCS[::-1], "w30 w31")
    src = again.usage.model_extra["cached_tokens_by_source"]
    assert again.usage.prompt_tokens_details.cached_tokens >= 96 and src.get("cpu", 0) >= 96


def test_blend_rule_per_request(client: openai.OpenAI) -> None:
    """A rule and ratio in the body blend the documents their way; ratio 1.0 under any rule
    answers as a full prefill does."""
    ask(client, DOCS, "w40 w41")  # stores the documents
    full = ask(client, DOCS[::-1], "w40 w41", blend_ratio=1.0, blend_rule="legolink+ape")
    again = ask(client, DOCS[::-1], "w40 w41", blend_ratio=1.0)
    assert full.choices[0].message.content == again.choices[0].message.content
    for rule in ("legolink", "ape+query_late", "legolink+query_early"):
        r = ask(client, DOCS[::-1], "w40 w41", blend_ratio=0.2, blend_rule=rule)
        assert r.choices[0].message.content and r.usage.prompt_tokens_details.cached_tokens >= 96
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, DOCS, "w40", blend_rule="query_early+query_late")
    assert e.value.body["param"] == "blend_rule" and "both rank" in e.value.body["message"]


def test_cache_salt_separates_connector_keys(client: openai.OpenAI) -> None:
    # no documents and no prefix cache: what is cached comes from the connector's prefix keys
    msgs = [{"role": "user", "content": words(list(range(60, 100)))}]

    def cached(**extra: Any) -> int:
        r = client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=1, extra_body=extra
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="a") == 0 and cached(cache_salt="a") >= 32
    assert cached(cache_salt="b") == 0 and cached() == 0 and cached() >= 32
