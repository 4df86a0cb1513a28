"""Several layered prefills in flight (max_layered), against Hugging Face transformers (fp32, the
6-layer random Llama of tests/test_layered_prefill.py): the same greedy tokens with two or three
long prompts layered at once, beside running decodes (each gains one token every step), under
preemption (the newest layered prompt dropped first) and with one of them aborted; the step's
layered work is shared evenly among them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tests.test_hf_match import GREEDY, VOCAB, save_checkpoint
from tests.test_layered_prefill import hf_greedy, layered
from tierkv.engine import LLM, SamplingParams
from tierkv.engine.outputs import Request

LONG = [90, 150, 230]  # over the step budget (32): each goes layered


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama6-multi")
    return path, save_checkpoint(path, num_hidden_layers=6)


@pytest.fixture(scope="module")
def longs():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LONG]


@pytest.fixture(scope="module")
def hf_longs(ckpt, longs):
    return hf_greedy(ckpt[1], longs)


def drive(llm: LLM, decodes: Sequence[Request] = ()) -> int:
    """Step until every request finishes; each step, every decode that has sampled and is not
    done gains exactly one token. Returns the most prefills layered at once."""
    most = 0
    while llm.has_unfinished():
        before = [r.seqs[0].num_output_tokens for r in decodes]
        llm.step()
        most = max(most, len(llm.scheduler.layering))
        for r, b in zip(decodes, before):
            if b and not r.finished:
                assert r.seqs[0].num_output_tokens == b + 1
    return most


@pytest.mark.parametrize("most", [1, 2, 3])
def test_long_prompts_layered_at_once_match_hf(ckpt, longs, hf_longs, most: int) -> None:
    llm = layered(ckpt[0], max_layered=most, layered_step_rows=120, enable_prefix_caching=False)
    reqs = [llm.add_request(None, p, GREEDY) for p in longs]
    assert drive(llm) == most
    assert [llm.output(r).token_ids for r in reqs] == hf_longs
    llm.check_integrity()


def test_work_is_shared_evenly(ckpt, longs) -> None:
    """Two in flight: each runs half the step's rows x layers (at least 1)."""
    llm = layered(ckpt[0], layered_step_rows=120, enable_prefix_caching=False)
    a, b = (llm.add_request(None, p, GREEDY) for p in longs[1:])
    llm.step()  # a alone: the whole step's work
    llm.step()  # b admitted beside it
    assert llm.scheduler.layering == [a.seqs[0], b.seqs[0]]
    assert [s.layering.work for s in llm.scheduler.layering] == [60, 60]
    assert a.seqs[0].layering.pace.left == 150 * 6 - 120 - 60
    assert b.seqs[0].layering.pace.left == 230 * 6 - 60


def test_two_layered_beside_decodes_match_hf(ckpt, longs, hf_longs) -> None:
    llm = layered(ckpt[0], layered_step_rows=90)
    shorts = [p[:20] for p in longs]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    decodes = [llm.add_request(None, p, params) for p in shorts]
    while any(not r.seqs[0].num_output_tokens for r in decodes):
        llm.step()
    reqs = [llm.add_request(None, p, GREEDY) for p in longs[1:]]
    assert drive(llm, decodes) == 2
    assert [llm.output(r).token_ids for r in reqs] == hf_longs[1:]
    assert [llm.output(r).token_ids for r in decodes] == hf_greedy(ckpt[1], shorts, 60)
    llm.check_integrity()


def test_two_layered_under_preemption(ckpt, longs, hf_longs) -> None:
    # 24 KiB a block (tests/test_layered_prefill.py): 20 blocks. A 40-token prompt decodes (3
    # blocks, then 5) while the 90- and 150-token prompts (6 and 10 blocks) are layered; its
    # growth drops the newest layered prompt first, which starts over later.
    llm = layered(ckpt[0], kv_cache_bytes=20 * 24576, enable_prefix_caching=False)
    short = longs[2][:40]
    dec = llm.add_request(None, short, GREEDY)
    while not dec.seqs[0].num_output_tokens:
        llm.step()
    reqs = [llm.add_request(None, p, GREEDY) for p in longs[:2]]
    assert drive(llm) == 2
    assert [llm.output(r).token_ids for r in reqs] == hf_longs[:2]
    assert llm.output(dec).token_ids == hf_greedy(ckpt[1], [short])[0]
    assert llm.output(reqs[1]).metrics.preemptions > 0
    llm.check_integrity()


def test_abort_one_layered(ckpt, longs, hf_longs) -> None:
    """Aborting one of two in flight: its blocks freed, the other's tokens unchanged."""
    llm = layered(ckpt[0], layered_step_rows=60, enable_prefix_caching=False)
    free = len(llm.blocks.free)
    a, b = (llm.add_request(None, p, GREEDY) for p in longs[1:])
    llm.step()
    llm.step()
    assert len(llm.scheduler.layering) == 2
    llm.abort(a.request_id)
    assert llm.scheduler.layering == [b.seqs[0]] and a.seqs[0].layering is None
    llm.check_integrity()
    drive(llm)
    assert llm.output(b).token_ids == hf_longs[2]
    llm.check_integrity()
    assert len(llm.blocks.free) == free


def test_failed_load_restarts_only_that_one() -> None:
    """The scheduler alone (no model): a load that failed into the prompt admitted beside
    another layered one sends just that one back to the queue, its blocks freed."""
    from tests.test_scheduler import add
    from tierkv.engine.block_manager import BlockManager
    from tierkv.engine.config import EngineConfig
    from tierkv.engine.noop_connector import NoOpConnector
    from tierkv.engine.scheduler import Scheduler
    from tierkv.engine.sequence import Status

    cfg = EngineConfig(
        block_size=4, max_num_batched_tokens=8, prefill_mode="layered", layered_step_rows=8
    )
    s = Scheduler(cfg, BlockManager(64, 4, True), NoOpConnector(), [], 4096, num_layers=2)
    a, b = add(s, 0, 40), add(s, 1, 40)
    s.postprocess(s.schedule(), {}, set())  # a admitted alone
    out = s.schedule()  # b beside it
    assert s.layering == [a, b] and out.layered == [a, b]
    s.postprocess(out, {}, {b.block_table[3]})
    assert s.layering == [a] and a.layering is not None and list(s.waiting) == [b]
    assert b.layering is None and not b.block_table and b.status == Status.WAITING
    s.check_integrity()


@pytest.mark.parametrize("first_short", [True, False])
def test_layered_prompts_count_toward_max_num_seqs(first_short: bool) -> None:
    """max_num_seqs bounds the running sequences and the layered prefills together: with two
    allowed and two taken (a decode and a layered prompt, or two layered prompts), a third
    waits, though max_layered has room for it."""
    from tests.test_scheduler import add
    from tierkv.engine.block_manager import BlockManager
    from tierkv.engine.config import EngineConfig
    from tierkv.engine.noop_connector import NoOpConnector
    from tierkv.engine.scheduler import Scheduler

    cfg = EngineConfig(
        block_size=4,
        max_num_batched_tokens=8,
        prefill_mode="layered",
        layered_step_rows=8,
        max_num_seqs=2,
        max_layered=3,
    )
    s = Scheduler(cfg, BlockManager(64, 4, True), NoOpConnector(), [], 4096, num_layers=2)
    first = add(s, 0, 6 if first_short else 40)  # 6 tokens fit a step: a plain prefill
    s.postprocess(s.schedule(), {}, set())
    second, third = add(s, 1, 40), add(s, 2, 40)
    for _ in range(3):
        s.postprocess(s.schedule(), {}, set())
        assert len(s.running) + len(s.layering) == 2 and third in s.waiting
        assert (first in s.running) == first_short and second in s.layering
        s.check_integrity()
