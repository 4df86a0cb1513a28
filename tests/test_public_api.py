"""The Engine's step API, and the parts around the engine using only it: no private names of
the engine or the LLM, no scheduler queues, no monkeypatched methods."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tierkv.engine import LLM, Engine, NoFit, SamplingParams
from tierkv.engine.config import RANDOM_CONFIGS, EngineConfig

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ["engine/serve", "bench", "examples", "connector", "vllm_adapter"]
FORBIDDEN = {
    "a private name of the engine": re.compile(r"\b(?:llm|engine)\._[A-Za-z]"),
    "the scheduler's queues": re.compile(
        r"\bscheduler\.(?:waiting|running|held)\b|\b(?:llm|engine)\.scheduler\b"
    ),
    "a monkeypatched method": re.compile(r"\.runner\.\w+\s*=[^=]|method-assign"),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def uses(text: str) -> list[str]:
    return [what for what, rx in FORBIDDEN.items() if rx.search(text)]


def test_the_patterns_catch_what_they_name() -> None:
    assert uses("seqs = self.llm._groups.get(g)") == ["a private name of the engine"]
    assert uses("head = llm.scheduler.waiting[0]") == ["the scheduler's queues"]
    assert uses("llm.runner.run = run  # type: ignore[method-assign]") == ["a monkeypatched method"]
    assert uses("self.engine.submit(job); self._send(x); n = llm.num_waiting") == []


def test_nothing_outside_the_engine_reaches_into_it() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{i}: {what}: {line.strip()}"
        for part in OUTSIDE
        for path in sorted((ROOT / part).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        for what in uses(line)
    ]
    assert not found, "\n".join(found)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(dict(RANDOM_CONFIGS["tiny"]), dtype="float32", kv_cache_bytes=1 << 20)


def test_step_api_matches_generate(engine: Engine) -> None:
    seen: list[torch.Tensor] = []
    engine.logits_hooks.append(seen.append)
    a = engine.add_request("a", [1, 2, 3], GREEDY)
    b = engine.add_request(None, [4, 5], SamplingParams(temperature=0.0, max_tokens=2, n=2))
    with pytest.raises(ValueError):
        engine.add_request("a", [6], GREEDY)  # in use
    assert engine.num_waiting == 2 and engine.num_running == 0 and engine.has_unfinished()
    finished = []
    while engine.has_unfinished():
        updated = engine.step()
        assert updated and all(r in (a, b) for r in updated)
        finished += [r for r in updated if r.finished]
    assert finished == [b, a] and engine.requests == {} and engine.step() == []
    assert len(seen) == engine.stats.steps and seen[0].shape == (
        2,
        RANDOM_CONFIGS["tiny"]["vocab_size"],
    )
    engine.logits_hooks.clear()
    out = engine.output(a)
    assert out.request_id == "a" and out.prompt_token_ids == [1, 2, 3] and len(out.token_ids) == 4
    assert [len(c.token_ids) for c in engine.output(b).outputs] == [2, 2]
    llm = LLM(dict(RANDOM_CONFIGS["tiny"]), dtype="float32", kv_cache_bytes=1 << 20)
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids == out.token_ids
    engine.check_integrity()


def test_abort_a_sample_then_the_request(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, n=2, ignore_eos=True)
    req = engine.add_request("x", [7, 8, 9], params)
    engine.step()  # prefill: the second sample forks from the first
    assert len(req.seqs) == 2 and engine.num_running == 2
    engine.abort("x", 1)
    assert req.seqs[1].finish_reason == "abort" and not req.seqs[0].is_finished
    assert engine.num_running == 1 and "x" in engine.requests
    engine.abort("x")
    assert req.seqs[0].finish_reason == "abort" and not engine.has_unfinished()
    assert engine.requests == {}
    engine.check_integrity()


def test_a_prompt_that_can_never_fit_names_its_request() -> None:
    small = Engine(dict(RANDOM_CONFIGS["tiny"]), dtype="float32", kv_cache_bytes=1 << 14)
    small.add_request("big", list(range(300)), GREEDY)
    with pytest.raises(NoFit) as e:
        small.step()
    assert e.value.request_id == "big"


def test_knobs_are_engine_config_fields_set_over_a_config() -> None:
    tiny = dict(RANDOM_CONFIGS["tiny"])
    base = EngineConfig(dtype="float32", block_size=32, kv_cache_bytes=1 << 20)
    e = Engine(tiny, base, max_num_seqs=3, retain_host_memory=False)
    assert (e.config.block_size, e.config.max_num_seqs, e.config.retain_host_memory) == (
        32,
        3,
        False,
    )
    assert base.max_num_seqs == 256  # the caller's config is not changed
    knobs = Engine(tiny, dtype="float32", kv_cache_bytes=1 << 20, block_size=32, max_num_seqs=3)
    assert knobs.config == EngineConfig(
        dtype="float32", kv_cache_bytes=1 << 20, block_size=32, max_num_seqs=3
    )
    with pytest.raises(TypeError, match="'kv_cache_byte' .*did you mean 'kv_cache_bytes'"):
        Engine(tiny, kv_cache_byte=1 << 20)
    with pytest.raises(ValueError, match="block_size"):
        Engine(tiny, base, block_size=12)
