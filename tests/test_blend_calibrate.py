"""calibrate-blend on the real model, SmolLM2-135M-Instruct in fp32: without a calibration a
prompt in parts runs as its plain prompt (its tokens equal full prefill's); calibrate-blend on a
tiny sample writes the model's cache entry, which serve then blends with. The model file is
linked into a temporary directory: its cache entry is written there, not in the real cache."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.serve_helpers import ThreadServer
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams, blend_tasks
from tierkv.engine.blend_gate import entry, load, model_digest
from tierkv.engine.cli import main as cli
from tierkv.engine.models import pull
from tierkv.storage_backends.build import TiersConfig


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    real = pull("smollm2", progress=False)
    link = tmp_path_factory.mktemp("models") / real.name
    link.symlink_to(real)
    return link


def connector() -> TierKVConnector:
    return TierKVConnector(ConnectorConfig(chunk_size=64, tiers=TiersConfig(cpu_bytes="256MiB")))


def test_task_prompt_is_the_chat_template(model: Path) -> None:
    llm = LLM(str(model), dtype="fp32", kv_cache_bytes=64 << 20)
    tok = llm.tokenizer
    assert tok is not None
    encode = lambda s: tok.encode(s, add_special_tokens=False)
    task = blend_tasks.tasks(lambda s: len(encode(s)), 1, (3,), 120, seed=3)[0]
    flat, parts = blend_tasks.prompt(encode, task)
    msgs = [
        {"role": "system", "content": blend_tasks.SYSTEM},
        {
            "role": "user",
            "content": "".join(d + "\n\n" for d in task.docs) + "Question: " + task.question,
        },
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert tok.decode(flat, skip_special_tokens=False) == text + task.lead
    assert sum(1 for d in task.docs if blend_tasks.holds(d, task.answer)) == 1
    assert len(parts) == 5 and parts[0].prefix and not parts[-1].reusable


def test_uncalibrated_falls_back_to_prefix_reuse(model: Path) -> None:
    full = LLM(str(model), dtype="fp32", kv_cache_bytes=96 << 20, enable_prefix_caching=False)
    conn = connector()
    try:
        llm = LLM(str(model), dtype="fp32", kv_cache_bytes=96 << 20, kv_connector=conn)
        assert llm.blend_gate.calibration is None  # no cache entry beside the linked file
        tok = full.tokenizer
        assert tok is not None
        encode = lambda s: tok.encode(s, add_special_tokens=False)
        task = blend_tasks.tasks(lambda s: len(encode(s)), 1, (3,), 100, seed=5)[0]
        flat, parts = blend_tasks.prompt(encode, task)
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        ref = full.generate(flat, greedy, use_tqdm=False)[0]
        out = llm.generate([parts], greedy, use_tqdm=False)[0]
        assert out.token_ids == ref.token_ids
        assert out.metrics.blend_rule == "uncalibrated" and out.metrics.blend == {}
        assert (
            conn.lookup_segments(llm.segments(parts)[1], flat[: len(parts[0].content)])
            == [False] * 3
        )  # nothing ingested for a blend that never runs
    finally:
        conn.close()


def test_calibrate_blend_writes_the_entry_serve_uses(model: Path, capsys) -> None:
    args = ["calibrate-blend", "--model", str(model), "--questions", "2", "--docs-per", "2"]
    args += ["--doc-tokens", "80", "--ratios", "0.5", "--max-tokens", "2"]
    args += ["--min-agreement", "0", "--min-answer-agreement", "0", "--min-relative-accuracy", "0"]
    assert cli(args) == 0
    path = entry(model, model_digest(model))
    assert f"wrote {path}" in capsys.readouterr().out
    cal = load(path, model_digest(model))
    assert cal.label == "cacheblend@0.5" and cal.questions == 2 and cal.trials[0].met
    assert json.loads(path.read_text())["format"] == "tierkv-blend-calibration"
    conn = connector()
    llm = LLM(str(model), dtype="fp32", kv_cache_bytes=96 << 20, kv_connector=conn)
    assert llm.blend_gate.calibration == cal
    docs = ["The answer to the riddle is forty-two. " * 8, "Cats sleep for most of the day. " * 8]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Riddle?"}]
    try:
        with ThreadServer(llm) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
            for order in (docs, docs[::-1]):
                r = client.chat.completions.create(
                    model="tiny", messages=msgs, max_tokens=2, extra_body={"documents": order}
                )
                assert r.usage.model_extra["blend"] == "cacheblend@0.5"
            # the other order: both documents' KV loaded where they now sit (blended)
            assert r.usage.model_extra["cached_tokens_by_source"].get("cpu", 0) >= 100
    finally:
        conn.close()


def test_a_trial_that_did_not_blend_is_refused(model: Path, tmp_path: Path) -> None:
    """A connector that stores parts only on their second sighting lets a trial's first run go
    unblended (a plain prefill, which agrees with full prefill trivially): calibrate refuses it
    rather than score a rule it never ran."""
    from tierkv.engine.blend_calibrate import CalibrateConfig, calibrate

    cfg = CalibrateConfig(questions=1, docs_per=(2,), doc_tokens=60, ratios=(0.5,), max_tokens=1)
    conn = connector()  # segment_admit_after=2, the connector's default
    try:
        with pytest.raises(RuntimeError, match="segment_admit_after=1"):
            calibrate(str(model), cfg, conn, tmp_path / "cal.json", progress=False)
    finally:
        conn.close()
    assert not (tmp_path / "cal.json").exists()
