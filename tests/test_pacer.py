"""The layered prefill's pacer (engine/pacer.py, EngineConfig.layered_gap): its budget from fed
measurements (no clock), what a step feeds it, and an engine whose layered steps follow it
still sampling Hugging Face's tokens (fp32, the 6-layer random Llama of the layered tests)."""

from __future__ import annotations

import pytest
import torch

from tests.test_hf_match import VOCAB, save_checkpoint
from tests.test_layered_prefill import hf_greedy, layered
from tierkv.engine import SamplingParams
from tierkv.engine.pacer import WINDOW, Pacer, measure
from tierkv.engine.schedule_output import SchedulerOutput
from tierkv.engine.sequence import Sequence


def test_off_or_unmeasured_gives_no_budget() -> None:
    off = Pacer(0.0, 6)
    off.decode_step(0.01)
    off.layered_work(1000, 0.1)
    assert off.budget() is None
    p = Pacer(2.0, 6)
    assert p.budget() is None
    p.decode_step(0.01)
    assert p.budget() is None  # no rate yet
    q = Pacer(2.0, 6)
    q.layered_work(1000, 0.1)
    assert q.budget() is None  # no decode step yet


def test_budget_is_the_spare_time_at_the_measured_rate() -> None:
    p = Pacer(3.0, 6)
    for s in (0.010, 0.012, 0.5):  # an outlier: the median ignores it
        p.decode_step(s)
    for units, s in ((1000, 0.1), (3000, 0.1), (500, 0.1)):  # 10K, 30K, 5K units/s
        p.layered_work(units, s)
    assert p.budget() == int(2.0 * 0.012 * 10_000)
    p.layered_work(0, 0.1)  # nothing ran: no rate
    p.layered_work(100, 0.0)
    assert p.budget() == 240


def test_a_fixed_cost_per_step_is_fitted_apart_from_the_rate() -> None:
    """Pieces that cost 5 ms a step plus 1 ms per 100 units: the budget is the spare time less
    the fixed cost at 100K units/s, not the lower rate the small steps alone show."""
    p = Pacer(2.0, 6)
    p.decode_step(0.05)
    for units in (200, 800, 3200, 400, 1600):
        p.layered_work(units, 0.005 + units / 100_000)
    fixed, rate = p.fit()
    assert fixed == pytest.approx(0.005) and rate == pytest.approx(100_000)
    assert p.budget() == pytest.approx((0.05 - 0.005) * 100_000, abs=1)
    same = Pacer(2.0, 6)
    same.decode_step(0.05)
    for _ in range(4):  # one size only: no line to fit, the median rate
        same.layered_work(200, 0.007)
    assert same.fit() == (0.0, pytest.approx(200 / 0.007))


def test_budget_has_a_floor_and_follows_recent_steps() -> None:
    p = Pacer(1.5, 24)
    p.decode_step(0.001)
    p.layered_work(100, 1.0)  # 100 units/s: 0.05 in the spare half millisecond
    assert p.budget() == 24
    for _ in range(WINDOW):  # the old measurements leave the window
        p.decode_step(0.02)
        p.layered_work(50_000, 1.0)
    assert p.budget() == int(0.5 * 0.02 * 50_000)


def seq(n: int) -> Sequence:
    return Sequence(0, "0", "0", list(range(n)), n, SamplingParams())


def test_a_step_feeds_it_what_it_ran() -> None:
    p = Pacer(2.0, 6)
    decodes = SchedulerOutput([seq(5), seq(7)], [1, 1])
    measure(p, decodes, 0.02)
    assert list(p.decode_s) == [0.02]
    measure(p, SchedulerOutput([seq(5), seq(40)], [1, 16]), 0.5)  # a prefill chunk: not fed
    measure(p, SchedulerOutput(), 0.5)
    assert list(p.decode_s) == [0.02] and not p.works
    step = SchedulerOutput([seq(5)], [1], layered=[seq(300)], ran=(600, 0.03))
    measure(p, step, 0.05)  # its pieces' rate; not a decode-only step
    assert list(p.works) == [(600, 0.03)] and list(p.decode_s) == [0.02]
    assert p.budget() == 400


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama6-paced")
    return path, save_checkpoint(path, num_hidden_layers=6)


def test_paced_layered_prompt_matches_hf(ckpt) -> None:
    """layered_gap = 1.5 beside three decodes: after its first step (the fixed 40 rows x layers:
    nothing measured yet) the prompt's work each step is the pacer's budget while they run
    beside it (the fixed 40 once they finished), and every token is HF's."""
    g = torch.Generator().manual_seed(9)
    long, *shorts = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (400, 20, 20, 20))
    llm = layered(ckpt[0], layered_step_rows=40, layered_gap=1.5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    decodes = [llm.add_request(None, p, params) for p in shorts]
    for _ in range(4):  # their prefill, then decode-only steps: measured
        llm.step()
    assert len(llm.scheduler.pacer.decode_s) >= 2
    req = llm.add_request(None, long, params)
    works, paced = [], []
    while not req.seqs[0].num_output_tokens:
        budget = llm.scheduler.pacer.budget()
        beside = any(not r.finished for r in decodes)
        llm.step()
        st = req.seqs[0].layering
        if st is not None:
            works.append(st.work)
            paced.append(budget if beside and budget is not None else 40)
    assert paced[0] == works[0] == 40  # nothing measured yet: the fixed work
    assert len(works) > 1 and works == paced
    while llm.has_unfinished():
        llm.step()
    outs = [llm.output(r).token_ids for r in decodes + [req]]
    assert outs == hf_greedy(ckpt[1], shorts + [long], 40)
    llm.check_integrity()
