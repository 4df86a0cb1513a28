"""Layered prefill against Hugging Face transformers (fp32, a 6-layer random Llama): the same
greedy tokens as HF in every case (alone, batched, in row chunks, over prefix-cache hits, over
connector hits from a real cpu tier, under preemption), and the running decodes advance one
token every step while a long prompt's prefill (plain or blend) is in flight."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_hf_match import GREEDY, VOCAB, save_checkpoint
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams
from tierkv.storage_backends.build import TiersConfig

LENS = [5, 40, 90, 150, 230]
BUDGET = 32  # max_num_batched_tokens: every prompt over it goes layered


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama6")
    return path, save_checkpoint(path, num_hidden_layers=6)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENS]


def hf_greedy(hf, batch: list[list[int]], n: int = 32) -> list[list[int]]:
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist()
            for p in batch
        ]


@pytest.fixture(scope="module")
def hf_tokens(ckpt, prompts):
    return hf_greedy(ckpt[1], prompts)


def layered(path, **kw) -> LLM:
    kw.setdefault("kv_cache_bytes", 1 << 22)
    return LLM(path, dtype="fp32", prefill_mode="layered", max_num_batched_tokens=BUDGET, **kw)


@pytest.mark.parametrize("groups", [0, 1, 4, 6])
def test_layered_matches_hf(ckpt, prompts, hf_tokens, groups: int) -> None:
    llm = layered(ckpt[0], layer_groups=groups, enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == hf_tokens
    for i in (4, 1):  # alone
        assert llm.generate([prompts[i]], GREEDY, use_tqdm=False)[0].token_ids == hf_tokens[i]
    llm.check_integrity()


def test_decodes_advance_every_step_while_a_prompt_is_layered(ckpt, prompts) -> None:
    llm = layered(ckpt[0], layer_groups=6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    short = [llm.add_request(None, p[:20], params) for p in prompts[1:4]]
    while any(not r.seqs[0].num_output_tokens for r in short):
        llm.step()
    long = llm.add_request(None, prompts[4], params)
    steps = 0
    while not long.seqs[0].num_output_tokens:
        before = [r.seqs[0].num_output_tokens for r in short]
        llm.step()
        steps += 1
        assert [r.seqs[0].num_output_tokens for r in short] == [b + 1 for b in before]
    assert steps == 6  # one group of layers a step
    while llm.has_unfinished():
        llm.step()
    llm.check_integrity()


def test_layered_row_chunks_match_hf(ckpt, prompts, hf_tokens) -> None:
    """A step's work below a layer's rows: each layer's rows go in chunks over several steps."""
    llm = layered(ckpt[0], layered_step_rows=40, enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == hf_tokens
    assert llm.generate([prompts[4]], GREEDY, use_tqdm=False)[0].token_ids == hf_tokens[4]
    llm.check_integrity()


@settings(max_examples=6, deadline=None)
@given(step_rows=st.integers(8, 400), which=st.sampled_from([2, 3, 4]))
def test_any_row_budget_matches_hf(ckpt, prompts, hf_tokens, step_rows: int, which: int) -> None:
    """Whatever the step's rows x layers (chunks cut anywhere in a layer, several layers a
    step, a layer's last chunk and the next layer's first in one step), HF's tokens."""
    llm = layered(ckpt[0], layered_step_rows=step_rows, enable_prefix_caching=False)
    assert llm.generate([prompts[which]], GREEDY, use_tqdm=False)[0].token_ids == hf_tokens[which]


def test_decodes_advance_every_step_while_rows_are_chunked(ckpt, prompts) -> None:
    """40 rows x layers a step: the 230-token prompt takes ceil(230 * 6 / 40) steps, and every
    step the decodes beside it gain one token each, their context built from the runner's
    reused decode tables (they gain a block on the way: the tables follow)."""
    llm = layered(ckpt[0], layered_step_rows=40)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    short = [llm.add_request(None, p[:20], params) for p in prompts[1:4]]
    while any(not r.seqs[0].num_output_tokens for r in short):
        llm.step()
    long = llm.add_request(None, prompts[4], params)
    steps = 0
    while not long.seqs[0].num_output_tokens:
        before = [r.seqs[0].num_output_tokens for r in short]
        llm.step()
        steps += 1
        assert [r.seqs[0].num_output_tokens for r in short] == [b + 1 for b in before]
        tables = llm.runner.decodes.last
        assert tables is not None
        assert tables.block_ids == [list(r.seqs[0].block_table) for r in short]
    assert steps == -(-230 * 6 // 40)
    while llm.has_unfinished():
        llm.step()
    outs = [llm.output(r) for r in short + [long]]
    refs = hf_greedy(ckpt[1], [p[:20] for p in prompts[1:4]] + [prompts[4]], 60)
    assert [o.token_ids for o in outs] == refs
    llm.check_integrity()


def test_layered_over_prefix_cache_hits(ckpt, prompts) -> None:
    shared = prompts[4][:64]
    batch = [shared + p[:40] for p in prompts[1:]]
    refs = hf_greedy(ckpt[1], batch)
    llm = layered(ckpt[0])
    assert llm.generate(batch[:1], GREEDY, use_tqdm=False)[0].token_ids == refs[0]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert all(o.metrics.cached_tokens >= 64 for o in outs)
    llm.check_integrity()


def test_layered_over_connector_hits(ckpt, prompts, hf_tokens) -> None:
    conn = TierKVConnector(ConnectorConfig(tiers=TiersConfig(cpu_bytes="64MiB"), chunk_size=16))
    llm = layered(ckpt[0], kv_connector=conn, enable_prefix_caching=False)
    first = llm.generate(prompts[3:], GREEDY, use_tqdm=False)  # layered, saved at their end
    assert [o.token_ids for o in first] == hf_tokens[3:]
    conn.flush()
    again = llm.generate(prompts[3:], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == hf_tokens[3:]
    assert all(o.metrics.external_tokens >= 128 for o in again)
    llm.check_integrity()


def test_layered_under_preemption(ckpt, prompts, hf_tokens) -> None:
    # 6 layers * 2 (K, V) * 16 tokens * 2 heads * 16 dims * 4 bytes = 24 KiB per block. The
    # 150-token prompt takes 10 of 13 blocks while the 40-token one decodes; that one's fourth
    # block then preempts the layered prefill, which starts over once blocks are free.
    llm = layered(ckpt[0], kv_cache_bytes=13 * 24576, enable_prefix_caching=False)
    assert llm.runner.num_blocks == 13
    outs = llm.generate([prompts[1], prompts[3]], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_tokens[1], hf_tokens[3]]
    assert outs[1].metrics.preemptions > 0
    llm.check_integrity()


def test_bad_mode_is_refused(ckpt) -> None:
    with pytest.raises(ValueError, match="prefill_mode"):
        LLM(ckpt[0], dtype="fp32", prefill_mode="sideways")
    with pytest.raises(ValueError, match="layer_groups"):
        LLM(ckpt[0], dtype="fp32", layer_groups=-1)
    with pytest.raises(ValueError, match="layered_step_rows"):
        LLM(ckpt[0], dtype="fp32", layered_step_rows=-1)


def blend_engine(path, mode: str, conn, step_rows: int = 0) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        kv_cache_bytes=16 << 20,
        enable_prefix_caching=False,
        kv_connector=conn,
        prefill_mode=mode,
        max_num_batched_tokens=BUDGET,
        layer_groups=2,
        layered_step_rows=step_rows,
    )


@pytest.fixture(scope="module")
def blend_ckpt(tmp_path_factory):
    from tests.test_blend import blend_checkpoint

    path = tmp_path_factory.mktemp("layered-blend")
    blend_checkpoint(path)
    return path


def blend_runs(path, params: SamplingParams, step_rows: int) -> list[tuple[dict, list[int]]]:
    """The blend of prompt([2, 0, 1]) beside two decodes, run alone in its step (chunked mode)
    and layered: each run's report and tokens. Every step of the layered one, each decode
    gains one token; it takes at least the steps its rows x layers need at step_rows a step."""
    from tests.test_blend import DOCS, prompt

    seen = []
    for mode in ("chunked", "layered"):
        conn = TierKVConnector(ConnectorConfig(tiers=TiersConfig(cpu_bytes="64MiB")))
        llm = blend_engine(path, mode, conn, step_rows)
        llm.ingest([list(d) for d in DOCS])
        decode = SamplingParams(max_tokens=40, ignore_eos=True)
        sides = [llm.add_request(None, d[:20], decode) for d in DOCS[:2]]
        while not all(s.seqs[0].num_output_tokens for s in sides):
            llm.step()
        req = llm.add_request(None, prompt([2, 0, 1]), params)
        steps = 0
        while not req.seqs[0].num_output_tokens:
            before = [s.seqs[0].num_output_tokens for s in sides]
            llm.step()
            steps += 1
            gained = int(mode == "layered" or steps > 1)
            assert [s.seqs[0].num_output_tokens for s in sides] == [b + gained for b in before]
        while llm.has_unfinished():
            llm.step()
        report = req.seqs[0].blend.report
        assert report is not None and report.loaded > 0
        if mode == "chunked":
            assert steps == 1  # a step alone
        elif step_rows:  # rows x layers it ran at least, step_rows a step at most
            rows, full = report.loaded + report.computed, report.full_layers
            least = rows * full + (report.recomputed + report.computed) * (4 - full)
            assert steps >= max(2, -(-least // step_rows))
        else:
            assert steps >= 2  # 2 groups of layers
        seen.append((report.as_dict(), list(req.seqs[0].output_ids)))
        llm.check_integrity()
        conn.close()
    return seen


@pytest.mark.parametrize("step_rows", [0, pytest.param(64, marks=pytest.mark.triton_path)])
@pytest.mark.parametrize("ratio", [0.0, 0.15, 1.0])
def test_layered_blend_equals_the_blend_alone(blend_ckpt, ratio: float, step_rows: int) -> None:
    """A blend prefill layered over steps, beside decodes, recomputes the same rows and samples
    the same tokens as the same blend run alone in its step (the 4-layer model of
    tests/test_blend.py, fp32): in groups of 2 layers, or 64 rows x layers a step (a layer's
    rows in chunks)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, blend_ratio=ratio)
    alone, layered = blend_runs(blend_ckpt, params, step_rows)
    assert alone == layered


@pytest.mark.parametrize("rule", ["ape", "query_late", "legolink+cacheblend", "query_early"])
def test_layered_blend_rules_in_row_chunks(blend_ckpt, rule: str) -> None:
    """The other rules, 48 rows x layers a step: the same rows and tokens as alone."""
    params = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, blend_ratio=0.15, blend_rule=rule
    )
    alone, layered = blend_runs(blend_ckpt, params, 48)
    assert alone == layered
