"""Cascade attention in the engine: decode sequences that share a prompt prefix through the prefix
cache read it once per step (kernels/cascade.py). Greedy tokens in fp32 with it on equal those
with it off and Hugging Face transformers' on the same random checkpoint, with requests joining
and finishing mid-run and parallel samples (copy-on-write) sharing their prompt's blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.test_hf_match import save_checkpoint
from tierkv.engine import LLM, SamplingParams
from tierkv.kernels import cpu

pytestmark = pytest.mark.cpu_path

SHARED = 70  # 4 full blocks of 16 and a part
MAX_NEW = [16, 6, 16, 9, 16, 5]  # requests finish at different steps


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_cascade")
    # G = 3 query heads per KV head: sub-groups of 16 // 3 = 5 sequences in the C++ kernel.
    return path, save_checkpoint(path, num_attention_heads=6, num_key_value_heads=2, hidden_size=96)


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (SHARED,), generator=g).tolist()
    return [shared + torch.randint(0, 256, (3 + 5 * i,), generator=g).tolist() for i in range(14)]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def joins(i: int) -> int:
    """The step request i joins at: the first alone (its prompt fills the prefix cache), eight
    at step 2, the others one a step while those decode."""
    return 0 if i == 0 else 2 if i <= 8 else i - 4


def run(llm: LLM, batch: list[list[int]]) -> dict[str, list[list[int]]]:
    """Request i joins at step joins(i) with MAX_NEW[i % 6] greedy tokens; every request's
    samples' tokens."""
    outs: dict[str, list[list[int]]] = {}
    step = 0
    while step <= joins(len(batch) - 1) or llm.has_unfinished():
        for i in (i for i in range(len(batch)) if joins(i) == step):
            sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW[i % 6], ignore_eos=True)
            llm.add_request(str(i), batch[i], sp)
        for r in llm.step():
            if r.finished:
                outs[r.request_id] = [s.output_ids for s in r.seqs]
        step += 1
    return outs


@pytest.fixture
def spy(monkeypatch):
    """Counts the engine's calls of the real cascade op (it still runs)."""
    calls = []
    real = cpu.paged_decode_cascade

    def counted(*args, **kwargs):
        calls.append(len(args[5][0]))  # members in groups
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu, "paged_decode_cascade", counted)
    return calls


def test_cascade_on_off_and_hf_with_joins_and_finishes(ckpt, batch, spy):
    path, hf = ckpt
    on = LLM(path, dtype="fp32", kv_cache_bytes=1 << 22, cascade_attention=True)
    assert on.runner.one_decode_group, "the C++ decode kernel must serve this model"
    got = run(on, batch)
    assert spy and max(spy) >= 6, "cascade never grouped more than a sub-group of sequences"
    on.check_integrity()
    spy.clear()
    off = LLM(path, dtype="fp32", kv_cache_bytes=1 << 22, cascade_attention=False)
    assert run(off, batch) == got and not spy
    for i, p in enumerate(batch):
        assert got[str(i)] == [hf_greedy(hf, p, MAX_NEW[i % 6])], f"request {i}"


def test_parallel_samples_share_their_prompt(ckpt, batch, spy):
    # n = 4 greedy samples: the prompt's blocks are shared, the partial last one copied on write.
    path, hf = ckpt
    llm = LLM(path, dtype="fp32", kv_cache_bytes=1 << 22, cascade_attention=True)
    sp = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, n=4)
    outs = llm.generate(batch[:3], sp, use_tqdm=False)
    assert spy
    for o, p in zip(outs, batch):
        assert [c.token_ids for c in o.outputs] == [hf_greedy(hf, p, 9)] * 4
    llm.check_integrity()


def test_groups_follow_the_tables(ckpt, batch):
    # The groups are found when a decode step's tables change and kept while they stay.
    path, _ = ckpt
    llm = LLM(path, dtype="fp32", kv_cache_bytes=1 << 22, cascade_attention=True)
    llm.generate(batch[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # fills the cache
    for i in range(5):
        llm.add_request(str(i), batch[i], SamplingParams(temperature=0.0, max_tokens=20))
    seen = []
    while llm.has_unfinished():
        llm.step()
        last = llm.runner.decodes.last
        if last is not None:
            seen.append(last)
    groups = [t.cascade for t in seen if t.cascade is not None]
    assert groups and all(g.members == [[0, 1, 2, 3, 4]] and g.shared == [64] for g in groups)
    assert len({id(t) for t in seen}) < len(seen)  # reused across steps


TRITON_SCRIPT = """
import json, sys
from tierkv.engine import LLM, SamplingParams
from tierkv.kernels import triton_cascade
calls = []
real = triton_cascade.cascade_decode_triton
def counted(*args):
    calls.append(1)
    return real(*args)
triton_cascade.cascade_decode_triton = counted
prompts = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], dtype="fp32", kv_cache_bytes=1 << 20, cascade_attention=True)
params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
first = llm.generate(prompts[:1], params, use_tqdm=False)  # the shared prefix into the cache
outs = llm.generate(prompts, params, use_tqdm=False)
print(json.dumps([len(calls), [o.token_ids for o in first + outs]]))
"""


def test_triton_path_cascade(ckpt, batch):
    # TRITON_INTERPRET must be set before triton is imported, so the Triton run is a subprocess;
    # fp32 only (a bf16 tl.dot gives garbage under the interpreter). Its tokens equal the C++
    # path's (which equal transformers', above).
    small = [p[: SHARED + 2 + i] for i, p in enumerate(batch[:4])]
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT, str(ckpt[0]), json.dumps(small)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    calls, tokens = json.loads(res.stdout.strip().splitlines()[-1])
    assert calls > 0, "the Triton path never ran the cascade"
    llm = LLM(ckpt[0], dtype="fp32", kv_cache_bytes=1 << 20)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = llm.generate(small[:1], sp, use_tqdm=False) + llm.generate(small, sp, use_tqdm=False)
    assert tokens == [o.token_ids for o in want]
