"""Workflow hints on the real SmolLM2-135M-Instruct (fp32, greedy): LLM.generate(kv_hints=...)
and the `kv_hints` body field of tierkv serve answer the same tokens as without hints; under
a tight KV cache "hinted" eviction keeps the agent that runs next where LRU drops it; a
malformed hint is a 400 naming its field and changes nothing; the agents of the next step are
the ones prefetched."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from bench.models import safetensors_copy
from tests.serve_helpers import ThreadServer
from tierkv.engine import LLM, SamplingParams
from tierkv.engine.models import pull
from tierkv.engine.workflow import StepPrefetch
from tierkv.storage_backends.hints import HintError, KVHint, StepGraph

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
KV_TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # SmolLM2 fp32: layers * (K, V) * kv heads * head_dim
AGENTS = ("planner", "coder", "reviewer")
GRAPH = {"steps": [["planner"], ["coder"], ["reviewer"]], "loop": True}


def system(agent: str) -> str:
    """A distinct, deterministic system prompt of ~150 tokens."""
    words = [f"{agent}{i % 7}" if i % 5 else f"rule {i} of the {agent}" for i in range(24)]
    return f"You are the {agent} of a software team. Follow these rules: " + ", ".join(words)


def prompt(llm: LLM, agent: str, turn: str = "Next task, please.") -> list[int]:
    msgs = [{"role": "system", "content": system(agent)}, {"role": "user", "content": turn}]
    return llm.chat_prompt(msgs)  # type: ignore[arg-type]


def hint(agent: str, at: int, wf: str = "w1") -> dict[str, Any]:
    return {"workflow": wf, "agent": agent, "graph": dict(GRAPH, at=at)}


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The GGUF checkpoint (it carries the tokenizer and chat template), hinted eviction."""
    return LLM(str(pull("smollm2", progress=False)), dtype="fp32", eviction="hinted")


def run_workflow(
    ps: list[list[int]], kv_bytes: int, order: list[int], eviction: str
) -> list[tuple[list[int], int]]:
    """One request per step, in order, hinted unless LRU; (answer, prefix-cache hits) of each."""
    llm = LLM(str(safetensors_copy()), dtype="fp32", kv_cache_bytes=kv_bytes, eviction=eviction)
    out = []
    for at, a in enumerate(order):
        h = hint(AGENTS[a], at % len(AGENTS)) if eviction == "hinted" else None
        (r,) = llm.generate([ps[a]], GREEDY, use_tqdm=False, kv_hints=h)
        out.append((r.token_ids, r.metrics.cached_tokens))
        llm.check_integrity()
    return out


def test_hinted_eviction_keeps_the_next_agent_and_answers_the_same(llm: LLM) -> None:
    ps = [prompt(llm, a) for a in AGENTS]
    p_blocks = max(len(p) for p in ps) // 16 + 1
    # Room for two agents' prompts, less the running one's output: the third step evicts.
    kv_bytes = 2 * p_blocks * 16 * KV_TOKEN_BYTES
    order = [0, 1, 2, 0, 1, 2]
    lru = run_workflow(ps, kv_bytes, order, "lru")
    hinted = run_workflow(ps, kv_bytes, order, "hinted")
    assert [t for t, _ in hinted] == [t for t, _ in lru]  # hints never change an answer
    # Steps 3 and 5: LRU has just dropped most of the agent that runs (a loop of 3 agents over
    # room for 2); next-use eviction dropped the agent needed last and keeps it whole.
    for i in (3, 5):
        whole = len(ps[order[i]]) // 16 * 16
        assert hinted[i][1] == whole and lru[i][1] < whole // 2, (lru, hinted)


def test_generate_takes_one_hint_a_list_or_kvhints(llm: LLM) -> None:
    ps = [prompt(llm, a) for a in AGENTS]
    want = [r.token_ids for r in llm.generate(ps, GREEDY, use_tqdm=False)]
    one = llm.generate(ps, GREEDY, use_tqdm=False, kv_hints=hint("planner", 0))
    each = llm.generate(
        ps,
        GREEDY,
        use_tqdm=False,
        kv_hints=[
            KVHint("w2", "planner", {"planner": 0, "coder": 1}),
            hint("coder", 1),
            None,
        ],
    )
    assert [r.token_ids for r in one] == want == [r.token_ids for r in each]
    with pytest.raises(HintError) as e:
        llm.generate(ps, GREEDY, use_tqdm=False, kv_hints=[None, {"workflow": "w"}, None])
    assert e.value.field == "kv_hints[1].agent"
    with pytest.raises(ValueError):
        llm.generate(ps, GREEDY, use_tqdm=False, kv_hints=[None])
    assert not llm.has_unfinished()
    llm.check_integrity()


def test_next_step_agents_are_the_ones_prefetched() -> None:
    steps = StepPrefetch(max_agents=6)
    g = StepGraph((("planner",), ("coder", "tester"), ("reviewer",)), 0, loop=True)
    # The first round: only the planner's prompt is known when its step is next.
    want: list[list[tuple[str, tuple[list[int], str | None]]]] = [
        [],
        [],
        [],
        [("planner", ([0], None))],
    ]
    got = []
    for at, a in [(0, "planner"), (1, "coder"), (1, "tester"), (2, "reviewer")]:
        h = KVHint("w", a, graph=StepGraph(g.steps, at, True))
        got.append(steps.step_started(h, [at if a != "tester" else 9]))
    assert got == want
    # Second round, step 0: coder and tester run next, once each per step.
    got = steps.step_started(KVHint("w", "planner", graph=g), [0])
    assert sorted(a for a, _ in got) == ["coder", "tester"]
    assert dict(got)["tester"] == ([9], None)  # the agent's latest prompt
    assert steps.step_started(KVHint("w", "planner", graph=g), [0]) == []  # same step
    # A table with explicit next uses: unknown agents are skipped.
    nu = KVHint("w", "coder", {"reviewer": 1, "planner": 2, "other": 1})
    assert steps.step_started(nu, [1], "salt") == [("reviewer", ([2], None))]
    # Another workflow falls back to the agent's last prompt under the same salt only.
    assert steps.step_started(KVHint("v", "x", {"coder": 1}), [5]) == [("coder", ([1], None))]
    assert steps.step_started(KVHint("u", "x", {"tester": 1}), [5], "other") == []
    assert len(steps.by_workflow.items) <= 6 and len(steps.by_agent.items) <= 6  # bounded


def post(url: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


GOOD = {"workflow": "w9", "agent": "coder", "next_use": {"planner": 2, "coder": 0}}
BAD = [
    ("x", "kv_hints"),
    ({"workflow": 3, "agent": "coder", "next_use": {"coder": 0}}, "kv_hints.workflow"),
    ({"workflow": "w", "agent": "a b", "next_use": {"coder": 0}}, "kv_hints.agent"),
    ({"workflow": "w", "agent": "coder", "next_use": {"coder": -1}}, "kv_hints.next_use.coder"),
    ({"workflow": "w", "agent": "coder", "next_use": {"coder": "1"}}, "kv_hints.next_use.coder"),
    ({"workflow": "w", "agent": "coder", "next_use": {"coder": True}}, "kv_hints.next_use.coder"),
    ({"workflow": "w", "agent": "coder", "next_use": {}}, "kv_hints.next_use"),
    ({**GOOD, "evict_everyone": True}, "kv_hints.evict_everyone"),
    ({**GOOD, "graph": GRAPH}, "kv_hints"),
    (
        {"workflow": "w", "agent": "coder", "graph": {"steps": [["a"]] * 5000}},
        "kv_hints.graph.steps",
    ),
    (
        {"workflow": "w", "agent": "c", "graph": {"steps": [[f"a{i}" for i in range(300)]]}},
        "kv_hints.graph.steps",
    ),
    ({"workflow": "w", "agent": "c", "graph": {"steps": [["a"]], "at": 1}}, "kv_hints.graph.at"),
    ({"workflow": "w", "agent": "c", "graph": {"steps": [[]]}}, "kv_hints.graph.steps[0]"),
    ({"workflow": "w", "agent": "c", "graph": {"steps": [["a"]], "x": 1}}, "kv_hints.graph"),
]


def test_kv_hints_over_http(llm: LLM) -> None:
    msgs = [{"role": "system", "content": system("coder")}, {"role": "user", "content": "Go."}]
    with ThreadServer(llm) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        kw: dict[str, Any] = dict(model="tiny", messages=msgs, max_tokens=8, temperature=0)
        plain = client.chat.completions.create(**kw)
        hinted = client.chat.completions.create(**kw, extra_body={"kv_hints": GOOD})
        graph = client.chat.completions.create(
            **kw, extra_body={"kv_hints": hint("coder", 1, "w8")}
        )
        assert plain.choices[0].message.content == hinted.choices[0].message.content
        assert graph.choices[0].message.content == plain.choices[0].message.content
        ids = prompt(llm, "planner")
        body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0}
        code, a = post(s.url + "/v1/completions", body)
        code2, b = post(s.url + "/v1/completions", {**body, "kv_hints": hint("planner", 0)})
        assert code == code2 == 200 and a["choices"][0]["text"] == b["choices"][0]["text"]
        tables = dict(llm.blocks.tree.book.tables[""])  # type: ignore[union-attr]
        assert {"w9", "w8", "w1"} <= set(tables)
        for bad, field in BAD:
            code, err = post(s.url + "/v1/chat/completions", {**kw, "kv_hints": bad})
            assert code == 400, (bad, err)
            assert (
                err["error"]["param"] == field and err["error"]["type"] == "invalid_request_error"
            )
        # Nothing changed: no table, no request, the same answer.
        assert set(llm.blocks.tree.book.tables[""]) == set(tables)  # type: ignore[union-attr]
        again = client.chat.completions.create(**kw, extra_body={"kv_hints": GOOD})
        assert again.choices[0].message.content == plain.choices[0].message.content
    assert not llm.has_unfinished()
    llm.check_integrity()
