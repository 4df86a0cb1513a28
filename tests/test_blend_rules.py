"""Every blend rule against its dense reference (tests/blend_dense.py, Hugging Face modules in
fp32): logits within 1e-4 and the same count of recomputed rows; deliberately wrong variants
of the rules fail that comparison; ratio 1.0 is a full prefill token for token under every
rule; bad rule specs are refused naming the field. A real model, connector and cpu tier."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from tests.blend_dense import Dense, Variant
from tests.test_blend import DOCS, QUESTION, ckpt, conn, engine, first_logits, flat, prompt  # noqa: F401
from tests.test_blend_prefix import SYS_A, with_prefix
from tierkv.engine import SamplingParams
from tierkv.engine.blend import BlendParams
from tierkv.engine.blend_ape import ape_attention
from tierkv.engine.blend_rules import Rule, parse_rule
from tierkv.engine.config import EngineConfig

ORDER = [2, 0, 1]
LOADED = sum(map(len, DOCS))


def run(llm, v: Variant, max_tokens: int = 1):
    """The engine's blend of prompt(ORDER) under v's rule and knobs: first logits, tokens,
    metrics."""
    c = llm.config
    c.blend_gradual, c.blend_sink_tokens, c.blend_query_layer = v.gradual, v.sinks, v.query_layer
    c.blend_query_smooth, c.blend_ape_temperature, c.blend_ape_scale = (
        v.smooth,
        v.temperature,
        v.scale,
    )
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        blend_rule=v.rule,
        blend_ratio=v.ratio,
        blend_check_layer=v.check,
    )
    return first_logits(llm, prompt(ORDER), params)


def matches(got: torch.Tensor, recomputed: int, ref: torch.Tensor, m: int) -> bool:
    return recomputed == m and torch.allclose(got, ref.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "v",
    [
        Variant("legolink", 0.15),
        Variant("legolink", 0.5, sinks=5),
        Variant("query_early", 0.3, 1),
        Variant("query_early", 0.2, 2, smooth=0),
        Variant("query_late", 0.3, 1),
        Variant("query_late", 0.2, 0, query_layer=2, smooth=1),
        Variant("ape", 0.15),
        pytest.param(Variant("ape+query_late", 0.3, 1), marks=pytest.mark.triton_path),
        Variant("ape+cacheblend", 0.2, 1, gradual=2),
        Variant("legolink+cacheblend", 0.2, 1),
        pytest.param(Variant("legolink+query_early", 0.2, 1), marks=pytest.mark.triton_path),
        Variant("legolink+ape", 0.0, temperature=0.7, scale=1.2),
        Variant("legolink+query_late", 0.0),
    ],
    ids=lambda v: f"{v.rule}-{v.ratio}-{v.check}",
)
def test_rule_matches_dense_reference(ckpt, conn, v: Variant) -> None:
    path, hf = ckpt
    with torch.no_grad():
        ref, m = Dense(hf).blend(ORDER, v)
    got, _, metrics = run(engine(path, conn), v)
    assert metrics.blend["loaded"] == LOADED and metrics.blend["computed"] == len(QUESTION)
    assert metrics.blend["recomputed"] == m
    torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "v,wrong",
    [
        (Variant("legolink", 0.15), "sinks+1"),
        (Variant("ape", 0.15), "ape-rest"),
        (Variant("ape+query_late", 0.3), "ape-rest"),
        (Variant("query_early", 0.3), "least"),
        (Variant("legolink+query_late", 0.2), "least"),
    ],
    ids=lambda x: x if isinstance(x, str) else x.rule,
)
def test_a_wrong_rule_fails_the_reference(ckpt, conn, v: Variant, wrong: str) -> None:
    """The comparison can fail: the engine matches the right reference and not the wrong one."""
    path, hf = ckpt
    with torch.no_grad():
        right = Dense(hf).blend(ORDER, v)
        bad = Dense(hf).blend(ORDER, Variant(**{**v.__dict__, "wrong": wrong}))
    got, _, metrics = run(engine(path, conn), v)
    assert matches(got, metrics.blend["recomputed"], *right)
    assert not matches(got, metrics.blend["recomputed"], *bad)


@pytest.fixture(scope="module")
def full(ckpt):
    """Full prefill of the flat prompt (no connector): first logits and 8 greedy tokens."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    logits, tokens, _ = first_logits(engine(ckpt[0]), flat(ORDER), params)
    return logits, tokens


@pytest.mark.parametrize(
    "rule",
    ["cacheblend", "legolink", "query_early", "query_late", "ape", "ape+query_late"]
    + ["legolink+cacheblend", "legolink+query_early+ape", "legolink+ape"],
)
def test_ratio_one_is_full_prefill_under_every_rule(ckpt, conn, full, rule: str) -> None:
    """Every loaded row recomputed: nothing is left in the cached block, so APE is plain
    attention and every rule is exactly a full prefill."""
    got, tokens, m = run(engine(ckpt[0], conn), Variant(rule, 1.0, 2), max_tokens=8)
    assert m.blend["recomputed"] == m.blend["loaded"] == LOADED
    torch.testing.assert_close(got, full[0], rtol=1e-4, atol=1e-4)
    assert tokens == full[1]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("", "non-empty"),
        ("cacheblend+nope", "unknown rule 'nope'"),
        ("cacheblend+query_early", "both rank"),
        ("query_late+query_early", "both rank"),
        ("legolink+legolink", "named twice"),
        ("ape+", "unknown rule ''"),
    ],
)
def test_bad_rule_specs_are_refused_naming_the_field(spec: str, message: str) -> None:
    for make in (
        lambda: parse_rule(spec),
        lambda: SamplingParams(blend_rule=spec),
        lambda: EngineConfig(blend_rule=spec),
    ):
        with pytest.raises(ValueError, match="blend_rule") as e:
            make()
        assert message in str(e.value)


def test_rule_specs_and_knobs() -> None:
    assert parse_rule("ape + query_late") == Rule("query_late", False, True)
    assert parse_rule("query_early+legolink").spec == "legolink+query_early"
    assert parse_rule("ape") == Rule(None, False, True) and parse_rule("legolink").sinks
    assert BlendParams(0.2, 1).layer_of_query(30) == 22 and BlendParams(0.2, 1).rule.rank
    for knob, bad in [
        ("blend_sink_tokens", -1),
        ("blend_query_layer", -2),
        ("blend_query_smooth", -1),
        ("blend_ape_temperature", 0.0),
        ("blend_ape_scale", -0.5),
        ("blend_ratio", 1.5),
    ]:
        with pytest.raises(ValueError, match=knob):
            EngineConfig(**{knob: bad})
    with pytest.raises(ValueError, match="blend_ratio"):
        SamplingParams(blend_ratio=-0.1)
    with pytest.raises(ValueError, match="blend_check_layer"):
        SamplingParams(blend_check_layer=-1)


def plain(q, qpos, k, v, scale):
    rep = q.shape[1] // k.shape[1]
    s = torch.einsum("mhd,thd->hmt", q, k.repeat_interleave(rep, 1)) * scale
    s = s.masked_fill(torch.arange(k.shape[0])[None, None] > qpos[None, :, None], float("-inf"))
    return torch.einsum("hmt,thd->mhd", s.softmax(-1), v.repeat_interleave(rep, 1))


@settings(max_examples=40, deadline=None)
@given(
    t=hs.integers(2, 40),
    m=hs.integers(1, 6),
    seed=hs.integers(0, 1 << 16),
    temperature=hs.floats(0.3, 2.0),
    scale=hs.floats(0.3, 2.0),
)
def test_ape_is_plain_attention_with_unit_knobs_or_nothing_cached(
    t: int, m: int, seed: int, temperature: float, scale: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(x, h, 8, generator=g) for x, h in ((m, 4), (t, 2), (t, 2)))
    qpos = torch.randint(0, t, (m,), generator=g)
    cached = torch.rand(t, generator=g) < 0.5
    ref = plain(q, qpos, k, v, 0.35)
    torch.testing.assert_close(ape_attention(q, qpos, k, v, cached, 0.35, 1.0, 1.0), ref)
    none = torch.zeros(t, dtype=torch.bool)
    got = ape_attention(q, qpos, k, v, none, 0.35, temperature, scale)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("rule", ["query_early", "query_late", "legolink", "legolink+cacheblend"])
def test_unit_ape_after_a_declared_prefix_is_the_rule_alone(ckpt, conn, rule: str) -> None:
    """After a declared prefix (its keys in the paged cache before the step's rows), APE with
    T = S = 1 gathers the whole sequence's keys and must give the rule's own paged attention."""
    llm = engine(ckpt[0], conn)
    llm.config.blend_ape_temperature = llm.config.blend_ape_scale = 1.0
    docs = sum(map(len, DOCS))
    out = {}
    for spec in (rule, rule + "+ape"):
        params = SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, blend_rule=spec, blend_ratio=0.2
        )
        out[spec] = first_logits(llm, with_prefix(SYS_A, ORDER), params)
        m = out[spec][2].blend
        assert m["loaded"] == docs and m["computed"] == len(QUESTION)
        assert m["recomputed"] >= (math.ceil(0.2 * docs) if "query" in rule else 48)
    torch.testing.assert_close(out[rule][0], out[rule + "+ape"][0], rtol=1e-4, atol=1e-4)
    assert out[rule][2].blend == out[rule + "+ape"][2].blend
    llm.config.blend_ape_temperature = 0.5  # APE does run: another temperature differs
    hot = first_logits(llm, with_prefix(SYS_A, ORDER), params)[0]
    assert not torch.allclose(hot, out[rule][0], rtol=1e-3, atol=1e-3)


@settings(max_examples=200, deadline=None)
@given(
    names=hs.lists(
        hs.sampled_from(["cacheblend", "query_early", "query_late", "legolink", "ape"]),
        min_size=1,
        max_size=4,
    ),
    pad=hs.sampled_from(["", " "]),
)
def test_rule_specs_parse_in_any_order(names: list[str], pad: str) -> None:
    """A spec is a set of names: any order parses to the same rule, and its canonical spec
    parses back to it; a repeated name or two ranking rules are refused, naming the field."""
    spec = (pad + "+" + pad).join(names)
    ranks = [n for n in names if n not in ("legolink", "ape")]
    if len(set(names)) != len(names) or len(ranks) > 1:
        with pytest.raises(ValueError, match="blend_rule"):
            parse_rule(spec)
        return
    rule = parse_rule(spec)
    assert rule == parse_rule("+".join(reversed(names))) == parse_rule(rule.spec)
    assert (rule.rank, rule.sinks, rule.ape) == (
        ranks[0] if ranks else None,
        "legolink" in names,
        "ape" in names,
    )
