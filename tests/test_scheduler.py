"""Scheduler: token budget, chunked prefill mixed with decodes, FCFS, newest-first preemption,
determinism. Driven without a model: each step 'samples' a fixed token."""

from __future__ import annotations

from tierkv.engine.block_manager import BlockManager
from tierkv.engine.config import EngineConfig
from tierkv.engine.noop_connector import NoOpConnector
from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.scheduler import Scheduler
from tierkv.engine.sequence import Sequence, Status

BS = 4


def make(
    num_blocks: int = 64, budget: int = 64, prefix: bool = True, max_seqs: int = 256
) -> Scheduler:
    cfg = EngineConfig(
        block_size=BS,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_prefix_caching=prefix,
    )
    return Scheduler(
        cfg,
        BlockManager(num_blocks, BS, prefix),
        NoOpConnector(),
        eos_token_ids=[],
        max_model_len=4096,
    )


def add(s: Scheduler, i: int, n: int, out: int = 4, base: int = 0) -> Sequence:
    seq = Sequence(
        i,
        str(i),
        str(i),
        [base + i * 1000 + t for t in range(n)],
        n,
        SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True),
    )
    s.add(seq)
    return seq


def step(s: Scheduler) -> list[tuple[int, int]]:
    out = s.schedule()
    tokens = {q.seq_id: 7 for q, smp in zip(out.seqs, out.samples()) if smp}
    s.postprocess(out, tokens, set())
    s.check_integrity()
    return [(q.seq_id, n) for q, n in zip(out.seqs, out.num_new_tokens)]


def test_budget_that_fits_n_requests_admits_all_in_one_step():
    s = make(budget=5 * 12)
    for i in range(5):
        add(s, i, 12)
    assert step(s) == [(i, 12) for i in range(5)]
    assert step(s) == [(i, 1) for i in range(5)]  # then all decode together


def test_one_token_short_chunks_the_last_prompt():
    s = make(budget=5 * 12 - 1)
    for i in range(5):
        add(s, i, 12)
    assert step(s) == [(0, 12), (1, 12), (2, 12), (3, 12), (4, 11)]
    assert step(s) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]  # 4 finishes its prefill and samples


def test_chunked_prefill_mixed_with_decodes():
    s = make(budget=10)
    add(s, 0, 6, out=8)
    assert step(s) == [(0, 6)]
    add(s, 1, 25)
    assert step(s) == [(0, 1), (1, 9)]
    assert step(s) == [(0, 1), (1, 9)]
    assert step(s) == [(0, 1), (1, 7)]
    assert step(s) == [(0, 1), (1, 1)]


def test_fcfs_head_blocks_later_requests():
    s = make(num_blocks=6, budget=100)
    add(s, 0, 16, out=2)  # 4 blocks
    add(s, 1, 12)  # 3 blocks: does not fit
    add(s, 2, 4)  # would fit, but FCFS keeps it behind 1
    assert step(s) == [(0, 16)]
    assert [q.seq_id for q in s.waiting] == [1, 2]


def test_preemption_takes_the_newest_and_recomputes():
    s = make(num_blocks=6, budget=100, prefix=False)
    a, b = add(s, 0, 8, out=12), add(s, 1, 8, out=12)  # 2 blocks each, growing
    step(s)
    preempted = []
    while s.has_work():
        out = s.schedule()
        preempted += [q.seq_id for q in out.preempted]
        s.postprocess(out, {q.seq_id: 7 for q, smp in zip(out.seqs, out.samples()) if smp}, set())
        s.check_integrity()
    assert preempted and set(preempted) == {1}  # b is newer: it goes, a never does
    assert a.metrics.num_preemptions == 0 and b.metrics.num_preemptions >= 1
    assert a.output_ids == [7] * 12 and b.output_ids == [7] * 12
    assert b.metrics.num_computed_tokens > 8 + 11  # recomputed after preemption
    assert len(s.blocks.free) == 6


def test_same_workload_schedules_identically():
    def trace():
        s = make(num_blocks=20, budget=13)
        for i in range(6):
            add(s, i, 5 + 3 * i, out=3 + i)
        steps = []
        while s.has_work():
            steps.append(step(s))
        return steps

    assert trace() == trace()


def test_max_num_seqs_and_finish():
    s = make(budget=100, max_seqs=2)
    seqs = [add(s, i, 4, out=1) for i in range(3)]
    assert step(s) == [(0, 4), (1, 4)]
    assert seqs[0].status is Status.FINISHED and seqs[0].finish_reason == "length"
    assert step(s) == [(2, 4)]
    assert not s.has_work() and len(s.blocks.free) + s.blocks.tree.num_blocks == 64


def test_a_block_computed_this_step_is_not_computed_twice():
    """Requests sharing a prefix that arrive together: the first computes it, the others wait a
    step and hit it in the prefix cache (without prefix caching all go at once)."""
    for prefix in (True, False):
        s = make(budget=64, prefix=prefix)
        shared = [5000 + t for t in range(3 * BS)]
        seqs = []
        for i in range(3):
            seq = Sequence(
                i,
                str(i),
                str(i),
                shared + [i, i + 1],
                3 * BS + 2,
                SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            )
            s.add(seq)
            seqs.append(seq)
        first = step(s)
        if not prefix:
            assert first == [(0, 14), (1, 14), (2, 14)]
            continue
        assert first == [(0, 14)]
        assert step(s) == [(0, 1), (1, 2), (2, 2)]  # 3 blocks hit, the 2 own tokens computed
        assert [q.metrics.num_cached_tokens for q in seqs[1:]] == [3 * BS, 3 * BS]


def test_a_different_prefix_is_not_held_back():
    s = make(budget=64)
    add(s, 0, 14)
    add(s, 1, 14, base=7)  # other tokens from the first block on
    assert step(s) == [(0, 14), (1, 14)]
