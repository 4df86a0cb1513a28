"""The blend quality gate (engine/blend_gate.py): the calibration file's format (round trip,
refusals naming the field, another model's file), and the fallback to prefix reuse without a
calibration, shown in serve's usage, on the tiny random checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.serve_helpers import ThreadServer, tiny_checkpoint, words
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM
from tierkv.engine.blend_gate import VERSION, Calibration, Trial, entry, load, model_digest
from tierkv.storage_backends.build import TiersConfig

SHA = "ab" * 32
shares = st.floats(0.0, 1.0, allow_nan=False)
rules = st.sampled_from(["cacheblend", "legolink", "query_early", "legolink+cacheblend"])
trials = st.builds(
    Trial, rules, st.floats(0.01, 1.0), st.integers(1, 500), shares, shares, st.booleans(), shares
)


@st.composite
def calibrations(draw: st.DrawFn) -> Calibration:
    ts = draw(st.lists(trials, max_size=8))
    met = [t for t in ts if t.met]
    chosen = draw(st.sampled_from(met)) if met and draw(st.booleans()) else None
    return Calibration(
        draw(st.from_regex(r"[0-9a-f]{64}", fullmatch=True)),
        draw(st.sampled_from(["fp32", "bf16"])),
        draw(shares),
        draw(shares),
        draw(shares),
        draw(st.integers(1, 500)),
        ts,
        chosen.rule if chosen else None,
        chosen.ratio if chosen else None,
        draw(shares),
    )


@settings(max_examples=200, deadline=None)
@given(calibrations())
def test_calibration_round_trips(cal: Calibration) -> None:
    back = Calibration.from_json(cal.to_json())
    assert back == cal
    assert back.label == ("uncalibrated" if cal.rule is None else f"{cal.rule}@{cal.ratio:g}")


def good() -> dict:
    t = Trial("cacheblend", 0.3, 20, 1.0, 0.5, True)
    return json.loads(
        Calibration(SHA, "fp32", 0.95, 0.98, 0.5, 20, [t], "cacheblend", 0.3).to_json()
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "other"}, "field 'format'"),
        ({"version": 1}, "version 1"),
        ({"min_answer_agreement": 2}, "'min_answer_agreement'"),
        ({"model_sha256": "xyz"}, "'model_sha256'"),
        ({"ratio": 1.5}, "'ratio' must be a number in \\[0, 1\\]"),
        ({"ratio": None}, "both set or both null"),
        ({"rule": "legolink"}, "no trial that met"),
        ({"rule": "Bad Rule!"}, "not a rule name"),
        ({"questions": 0}, "'questions' must be >= 1"),
        ({"min_agreement": "high"}, "'min_agreement'"),
        ({"trials": [{"rule": "cacheblend"}]}, "trials\\[0\\]"),
        ({"trials": [good()["trials"][0] | {"answer_agreement": -1}]}, "'answer_agreement'"),
    ],
)
def test_bad_calibration_is_refused_naming_the_field(
    tmp_path: Path, change: dict, message: str
) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(good() | change))
    with pytest.raises(ValueError, match=message):
        load(path, None)
    path.write_text("not json {")
    with pytest.raises(ValueError, match="not JSON"):
        load(path, None)


def test_an_older_cache_entry_is_no_calibration(tmp_path: Path) -> None:
    """A cache entry of an earlier format version was measured by other rules: "auto" runs
    uncalibrated and says to calibrate again; naming the file explicitly still refuses it."""
    ckpt = tiny_checkpoint(tmp_path / "tiny")
    digest = model_digest(ckpt)
    old = good() | {"model_sha256": digest, "version": VERSION - 1}
    entry(ckpt, digest).write_text(json.dumps(old))
    llm = LLM(str(ckpt), dtype="fp32", kv_cache_bytes=1 << 22)
    assert llm.blend_gate.calibration is None and "calibrate again" in llm.blend_gate.where
    with pytest.raises(ValueError, match=f"version {VERSION - 1}"):
        LLM(
            str(ckpt),
            dtype="fp32",
            kv_cache_bytes=1 << 22,
            blend_calibration=str(entry(ckpt, digest)),
        )


def test_another_models_calibration_is_refused(tmp_path: Path) -> None:
    ckpt = tiny_checkpoint(tmp_path / "tiny")
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(good()))  # calibrated on a model with sha256 SHA
    with pytest.raises(ValueError, match="not of this model"):
        LLM(str(ckpt), dtype="fp32", kv_cache_bytes=1 << 22, blend_calibration=str(path))
    # a rule this engine does not know
    digest = model_digest(ckpt)
    t = Trial("nosuchrule", 0.3, 20, 1.0, 0.5, True)
    cal = Calibration(digest, "fp32", 0.95, 0.98, 0.5, 20, [t], "nosuchrule", 0.3)
    entry(ckpt, digest).write_text(cal.to_json())
    with pytest.raises(ValueError, match="not one this engine knows"):
        LLM(str(ckpt), dtype="fp32", kv_cache_bytes=1 << 22)


def test_serve_without_calibration_falls_back_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    conn = TierKVConnector(ConnectorConfig(chunk_size=16, tiers=TiersConfig(cpu_bytes="16MiB")))
    llm = LLM(
        str(tiny_checkpoint(tmp_path / "tiny")),
        dtype="fp32",
        kv_cache_bytes=1 << 22,
        kv_connector=conn,
        enable_prefix_caching=False,
    )  # blend_calibration "auto": a checkpoint without a calibration
    docs = [words(list(range(100, 148))), words(list(range(150, 198)))]
    caplog.set_level(logging.WARNING, "tierkv.engine")
    try:
        with ThreadServer(llm) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
            for order in (docs, docs[::-1], docs[::-1]):
                msgs = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w20"}]
                r = client.chat.completions.create(
                    model="tiny", messages=msgs, max_tokens=2, extra_body={"documents": order}
                )
                assert r.usage.model_extra["blend"] == "uncalibrated"
            # prefix reuse: the repeated order hits its stored prefix chunks, and nothing loads
            # at any position (no segment is ever stored)
            assert r.usage.prompt_tokens_details.cached_tokens >= 96
            plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
            assert "blend" not in plain.usage.model_extra  # a prompt not in parts
    finally:
        conn.close()
    said = [r for r in caplog.records if "uncalibrated" in r.getMessage()]
    assert len(said) == 1 and "prefix reuse" in said[0].getMessage()
    assert conn.stats.saved_chunks > 0 and llm.blend_gate.calibration is None
