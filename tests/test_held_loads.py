"""Loads held past their step (connector/held.py) for a layered prefill: which loads may be held,
what wait_layer reads while one is resumed, cancellation, and the report of what failed; then
through the engine: a layered prefill over connector hits spreads its load's waits over its
steps and gives the same tokens, also when the held load fails or the prompt is aborted."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from tierkv.connector.held import HeldLoads
from tierkv.connector.plan import LoadPlan
from tierkv.connector.transfer import LoadJob


def job(*rids: str, staged: bool = False) -> LoadJob:
    plans = [
        LoadPlan(r, torch.arange(4, dtype=torch.int32), 0, 64, [], [], np.zeros(64, np.int64))
        for r in rids
    ]
    j = LoadJob(plans, [threading.Event() for _ in range(3)])
    j.staged = {} if staged else None
    return j


def test_only_a_load_of_one_request_scattered_on_arrival_is_held() -> None:
    h = HeldLoads()
    assert not h.hold("a", None)
    assert not h.hold("a", job("a", "b"))  # the step loads for another request too
    assert not h.hold("a", job("a", staged=True))  # its layers scatter on the engine's wait
    j = job("a", "a")
    assert h.hold("a", j) and h.jobs == {"a": j}
    assert not h.hold("a", job("a"))  # one held load per request
    assert h.active is None


def test_resume_names_the_load_waited_on_and_end_reports_it_once() -> None:
    h = HeldLoads()
    a, b = job("a"), job("b")
    assert h.hold("a", a) and h.hold("b", b)
    h.resume("b")
    assert h.active is b
    h.resume("nobody")
    assert h.active is None
    h.resume("a")
    h.end("a", cancel=False)
    assert h.active is None and "a" not in h.jobs and not a.cancelled
    h.end("a", cancel=True)  # already ended: nothing more
    assert h.take_ended() == [a] and h.take_ended() == []
    h.end("b", cancel=True)
    assert b.cancelled and all(p.failed_from == p.start for p in b.plans)
    assert h.take_ended() == [b] and h.jobs == {}


def test_cancel_waits_for_a_scatter_in_progress() -> None:
    """end(cancel=True) returns only once a scatter holding the job's lock let go of it."""
    h, j = HeldLoads(), job("a")
    assert h.hold("a", j)
    order: list[str] = []
    inside = threading.Event()

    def scatter() -> None:
        with j.lock:
            inside.set()
            threading.Event().wait(0.2)
            order.append("scatter")

    t = threading.Thread(target=scatter)
    t.start()
    inside.wait(5)
    h.end("a", cancel=True)
    order.append("ended")
    t.join()
    assert order == ["scatter", "ended"]


@pytest.mark.parametrize("bad", ["raise", "staged"])
def test_bad_holds_change_nothing(bad: str) -> None:
    h = HeldLoads()
    j = job("a", staged=bad == "staged") if bad == "staged" else job("a", "b")
    assert not h.hold("a", j)
    assert h.jobs == {} and h.active is None and h.ended == []


# -- through the engine: a real cpu tier, a 6-layer random Llama in fp32 -----------------------

BUDGET = 32  # max_num_batched_tokens: the new tokens of each prompt below go layered


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.test_hf_match import save_checkpoint

    path = tmp_path_factory.mktemp("held-llama6")
    save_checkpoint(path, num_hidden_layers=6)
    return str(path)


def prompt(n: int, seed: int) -> list[int]:
    from tests.test_hf_match import VOCAB

    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(ckpt: str, conn=None, **kw):
    from tierkv.engine import LLM

    return LLM(
        ckpt,
        dtype="fp32",
        kv_cache_bytes=1 << 22,
        prefill_mode="layered",
        max_num_batched_tokens=BUDGET,
        layered_step_rows=64,  # 96 new rows x 6 layers: about 9 steps
        enable_prefix_caching=False,
        kv_connector=conn,
        **kw,
    )


def connector(mode: str = "none"):
    from tests.test_connector import FaultTier
    from tierkv.connector import ConnectorConfig, TierKVConnector
    from tierkv.storage_backends.cpu_tier import CpuTierConfig

    tier = FaultTier(CpuTierConfig(capacity_bytes="16MiB"))
    return TierKVConnector(ConnectorConfig(chunk_size=16), tiers=[tier]), tier


def greedy():
    from tierkv.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def run_held(ckpt: str, mode: str) -> tuple[list[int], list[int], list[list[int]], Any]:
    """The 160-token prefix stored, then prefix + 96 new tokens beside a decode; the tokens, the
    cold engine's, and per step the layers the held load was waited for."""
    conn, tier = connector()
    llm = engine(ckpt, conn)
    head, tail = prompt(160, 1), prompt(96, 2)
    llm.generate([head], greedy(), use_tqdm=False)
    conn.flush()
    tier.mode = mode
    side = llm.add_request(None, prompt(20, 3), greedy())
    llm.step()
    req = llm.add_request(None, head + tail, greedy())
    waits: list[list[int]] = []
    wait = conn.wait_for_layer_load

    def record(layer: int) -> None:
        if conn.worker.held.active is not None:
            waits[-1].append(layer)
        wait(layer)

    conn.wait_for_layer_load = record  # type: ignore[method-assign]
    while not req.seqs[0].num_output_tokens:
        waits.append([])
        llm.step()
    while llm.has_unfinished():
        llm.step()
    assert conn.worker.held.jobs == {} and side.seqs[0].num_output_tokens == 8
    llm.check_integrity()
    cold = engine(ckpt).generate([head + tail], greedy(), use_tqdm=False)[0].token_ids
    out = llm.output(req)
    conn.close()
    return out.token_ids, cold, waits, conn.worker.stats


def test_a_layered_prefill_waits_for_its_held_load_layer_by_layer_over_its_steps(ckpt) -> None:
    got, cold, waits, stats = run_held(ckpt, "none")
    assert got == cold and stats.loaded_tokens == 160 and stats.recomputed_tokens == 0
    steps = [w for w in waits if w]
    assert len(steps) >= 3  # the six layers' waits over the steps whose pieces read them
    assert sorted({x for w in steps for x in w}) == list(range(6))  # a layer may span steps
    assert all(max(a) <= min(b) for a, b in zip(steps, steps[1:]))  # in layer order
    assert len(set(waits[0])) < 6  # the admission step did not wait for the whole load


@pytest.mark.parametrize("mode", ["flip", "drop"])
def test_a_held_load_that_fails_is_recomputed(ckpt, mode: str) -> None:
    got, cold, _, stats = run_held(ckpt, mode)
    assert got == cold and stats.recomputed_tokens > 0


def test_an_aborted_layered_prefill_ends_its_held_load(ckpt) -> None:
    conn, tier = connector()
    llm = engine(ckpt, conn)
    head = prompt(160, 1)
    llm.generate([head], greedy(), use_tqdm=False)
    conn.flush()
    tier.mode = "slow"  # the load still streams when the prompt goes
    req = llm.add_request("long", head + prompt(96, 2), greedy())
    llm.step()
    assert list(conn.worker.held.jobs) == ["long"]
    job = conn.worker.held.jobs["long"]
    llm.abort("long")
    assert conn.worker.held.jobs == {} and job.cancelled and req.finished
    tier.mode = "none"
    again = llm.generate([prompt(60, 5)], greedy(), use_tqdm=False)[0].token_ids
    assert again == engine(ckpt).generate([prompt(60, 5)], greedy(), use_tqdm=False)[0].token_ids
    llm.check_integrity()
    conn.close()
