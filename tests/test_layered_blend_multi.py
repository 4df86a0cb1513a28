"""A blend prefill layered beside a plain layered prompt (max_layered = 2; the 4-layer model of
tests/test_blend.py, fp32, a real cpu tier): the blend is admitted while the plain prompt is
still in flight instead of waiting for it, and both sample the same tokens (the blend the same
report) as in chunked mode, where the blend runs alone in its step; likewise two blends in
flight at once."""

from __future__ import annotations

import pytest
import torch

from tests.test_layered_prefill import blend_engine
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams
from tierkv.engine.outputs import Request
from tierkv.storage_backends.build import TiersConfig

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, blend_ratio=0.15)


@pytest.fixture(scope="module")
def blend_ckpt(tmp_path_factory):
    from tests.test_blend import blend_checkpoint

    path = tmp_path_factory.mktemp("layered-blend-multi")
    blend_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def plain() -> list[int]:
    return torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(7)).tolist()


def first_tokens(llm: LLM, reqs: list[Request]) -> tuple[list[int], int]:
    """Step until every request finishes: the step at which each sampled its first token, and
    the most prefills layered at once."""
    at, step, most = [0] * len(reqs), 0, 0
    while llm.has_unfinished():
        llm.step()
        step += 1
        most = max(most, len(llm.scheduler.layering))
        for i, r in enumerate(reqs):
            at[i] = at[i] or (step if r.seqs[0].num_output_tokens else 0)
    return at, most


def blend_beside_plain(path, mode: str, plain: list[int], step_rows: int):
    """A 200-token plain prompt, then (a step later) the blend of prompt([2, 0, 1]): their
    tokens, the blend's report, and whether the blend was admitted beside the plain prompt."""
    from tests.test_blend import DOCS, prompt

    conn = TierKVConnector(ConnectorConfig(tiers=TiersConfig(cpu_bytes="64MiB")))
    llm = blend_engine(path, mode, conn, step_rows)
    llm.ingest([list(d) for d in DOCS])
    a = llm.add_request(None, plain, PARAMS)
    llm.step()
    b = llm.add_request(None, prompt([2, 0, 1]), PARAMS)
    llm.step()
    beside = [s.request_id for s in llm.scheduler.layering] == [a.request_id, b.request_id]
    first_tokens(llm, [a, b])
    report = b.seqs[0].blend.report
    assert report is not None and report.loaded > 0
    llm.check_integrity()
    conn.close()
    return list(a.seqs[0].output_ids), list(b.seqs[0].output_ids), report.as_dict(), beside


@pytest.mark.parametrize("step_rows", [0, 48])
def test_blend_admitted_beside_a_layered_prompt(blend_ckpt, plain, step_rows: int) -> None:
    chunked = blend_beside_plain(blend_ckpt, "chunked", plain, step_rows)
    layered = blend_beside_plain(blend_ckpt, "layered", plain, step_rows)
    assert layered[3] and not chunked[3]  # in flight together: the blend did not wait
    assert layered[:3] == chunked[:3]


@pytest.mark.parametrize(
    ("step_rows", "second", "same"), [(48, [1, 2, 0], False), (96, [1, 0], True)]
)
def test_two_blends_in_flight(blend_ckpt, step_rows: int, second: list[int], same: bool) -> None:
    """Two blends layered at once (the second admitted the step after the first), step_rows
    rows x layers a step between them, give each the report and tokens it gives in chunked
    mode; at 96 they finish and sample in the same step."""
    from tests.test_blend import DOCS, prompt

    seen = []
    for mode in ("chunked", "layered"):
        conn = TierKVConnector(ConnectorConfig(tiers=TiersConfig(cpu_bytes="64MiB")))
        llm = blend_engine(blend_ckpt, mode, conn, step_rows)
        llm.ingest([list(d) for d in DOCS])
        reqs = [llm.add_request(None, prompt(o), PARAMS) for o in ([2, 0, 1], second)]
        at, most = first_tokens(llm, reqs)
        if mode == "layered":
            assert most == 2 and (at[0] == at[1]) == same
        seen.append([(r.seqs[0].blend.report.as_dict(), list(r.seqs[0].output_ids)) for r in reqs])
        llm.check_integrity()
        conn.close()
    assert seen[0] == seen[1]
