"""The engine's kernels chosen once per model (kernels/step_ops.py): a decode step reads no
environment variable, the bound functions are the selected backend's and the ones that run,
the environment changed after load moves nothing, the model's one-loop forward equals its
modules' forward, and decode steps' reused tensors equal the general Context's."""

from __future__ import annotations

import os
from collections.abc import Iterator, MutableMapping

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tierkv.engine import LLM, SamplingParams
from tierkv.engine.context import Context, build_context
from tierkv.engine.model import Linear, RMSNorm
from tierkv.engine.models import pull
from tierkv.kernels import cpu
from tierkv.kernels.layer_ops import rms_norm_ref, silu_mul_ref
from tierkv.kernels.rope import rotate_ref

CFG = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=512,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TIERKV_CPU_KERNEL", raising=False)


class Counting(MutableMapping[str, str]):
    """os.environ's stand-in that counts every read."""

    def __init__(self, inner: MutableMapping[str, str]) -> None:
        self.inner, self.reads = inner, 0

    def __getitem__(self, key: str) -> str:
        self.reads += 1
        return self.inner[key]

    def __contains__(self, key: object) -> bool:
        self.reads += 1
        return key in self.inner

    def __iter__(self) -> Iterator[str]:
        self.reads += 1
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __setitem__(self, key: str, value: str) -> None:
        self.inner[key] = value

    def __delitem__(self, key: str) -> None:
        del self.inner[key]


def tokens(n: int, seed: int, vocab: int = CFG["vocab_size"]) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kernel_calls(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], set[str]]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs], {e.key for e in prof.key_averages() if "tierkv::" in e.key}


def test_steps_read_no_environment(monkeypatch) -> None:
    """SmolLM2 in bf16, 3 sequences: neither their prefill step nor any decode step reads
    os.environ (the kernel-level dispatch reads it ~360 times per decode step)."""
    llm = LLM(str(pull("smollm2", progress=False)), dtype="bf16", kv_cache_bytes=64 << 20)
    for i in range(3):
        llm.add_request(None, tokens(40 + 9 * i, i, 40000), GREEDY)
    counting = Counting(os.environ)
    monkeypatch.setattr(os, "environ", counting)
    os.environ.get("TIERKV_CPU_KERNEL")
    assert counting.reads == 1  # the stand-in sees the kernel-level functions' kind of read
    counting.reads = 0
    llm.step()  # the prefill: the C++ prefill kernel
    assert counting.reads == 0
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    assert steps == GREEDY.max_tokens - 1
    assert counting.reads == 0
    # The kernel-level function, by contrast, still reads it at each call.
    cpu.enabled()
    assert counting.reads == 1


@pytest.mark.parametrize("env", [{}, {"TIERKV_CPU_KERNEL": "0"}, {"TRITON_INTERPRET": "1"}])
def test_bound_dispatch_matches_backend(monkeypatch, env: dict[str, str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    llm = LLM(dict(CFG), dtype="fp32", kv_cache_bytes=4 << 20)
    runner, model = llm.runner, llm.runner.model
    ops = runner.ops
    want = "triton" if env.get("TRITON_INTERPRET") else "torch" if env else "cpp"
    assert (ops.backend, ops.cpp) == (want, want != "torch")
    lib = torch.ops.tierkv
    if want == "torch":
        assert (ops.rms_norm, ops.silu_mul, ops.rotate) == (rms_norm_ref, silu_mul_ref, rotate_ref)
    else:  # the layer ops run the C++ kernels on the Triton path too, as the kernel-level ones
        assert (ops.rms_norm, ops.silu_mul) == (lib.rms_norm, lib.silu_mul)
    if want == "cpp":
        assert ops.rotate == lib.rope and runner.one_decode_group
    if want == "triton":
        from tierkv.kernels.triton_rope import rope_triton

        assert ops.rotate is rope_triton and not runner.one_decode_group
    assert model.ops is ops and model.rope.rotate is ops.rotate
    assert all(m.op is ops.rms_norm for m in model.modules() if isinstance(m, RMSNorm))
    assert all(m.op is not None for m in model.modules() if isinstance(m, Linear))
    # What runs is what was bound, whatever the environment says after load.
    monkeypatch.setenv("TIERKV_CPU_KERNEL", "1" if want == "torch" else "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    prompts = [tokens(12, 1), tokens(5, 2)]
    got, ran = kernel_calls(llm, prompts)
    if want == "torch":
        assert not ran
    elif want == "cpp":
        assert {"rms_norm", "rope", "write_kv", "paged_decode"} <= {x[8:] for x in ran}
    else:
        assert "tierkv::rms_norm" in ran and not ran & {"tierkv::rope", "tierkv::write_kv"}
    monkeypatch.setenv("TIERKV_CPU_KERNEL", "0")
    ref = LLM(dict(CFG), dtype="fp32", kv_cache_bytes=4 << 20)
    assert ref.runner.ops.backend == "torch"
    assert got == [o.token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)]


def test_one_loop_forward_equals_the_modules() -> None:
    """The bound model's forward loop and its DecoderLayer modules give the same bits."""
    llm = LLM(dict(CFG, attention_bias=True), dtype="bf16", kv_cache_bytes=4 << 20)
    model = llm.runner.model
    ids = torch.tensor(tokens(11, 3))
    pos = torch.arange(11)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1) * (layer + 1)

    with torch.inference_mode():
        flat = model(ids, pos, attend)
        h = model.embed_tokens(ids)
        for i, layer in enumerate(model.layers):
            h = layer(i, h, pos, attend)
        with pytest.raises(ValueError, match="positions"):
            model(ids, pos[:5], attend)
    assert torch.equal(flat, h)


def test_decode_contexts_equal_the_general_context() -> None:
    """Every decode step's Context from reused tensors equals build_context's, while sequences
    join, finish, fork (copy-on-write of a shared block) and cross block boundaries."""
    llm = LLM(dict(CFG), dtype="fp32", kv_cache_bytes=4 << 20, block_size=4, max_num_seqs=4)
    runner, eng = llm.runner, llm
    checked, reused = [], 0
    prepare = runner.prepare

    def both(out):  # the runner's own prepare, checked against the general path
        nonlocal reused
        last = runner.decodes.last
        ctx = prepare(out)
        if all(n == 1 for n in out.num_new_tokens):
            reused += last is not None and runner.decodes.last is last
            want = build_context(out, 4, runner.num_blocks, True, False, runner.device)
            same_context(ctx, want)
            checked.append(len(out.seqs))
        return ctx

    runner.prepare = both
    sample = SamplingParams(temperature=0.8, max_tokens=9, n=2, seed=5, ignore_eos=True)
    for i, n in enumerate((7, 13, 4, 22, 9, 16)):
        eng.add_request(None, tokens(n, 10 + i), sample if i % 2 else GREEDY)
        eng.step()
    while eng.has_unfinished():
        eng.step()
    assert len(checked) > 10 and len(set(checked)) > 2 and reused > 3


def same_context(got: Context, want: Context) -> None:
    for f in ("input_ids", "positions", "slot_mapping", "logits_indices"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and torch.equal(a, b), f
    assert (got.num_tokens, got.num_sampled, got.seq_ids, got.block_ids) == (
        want.num_tokens,
        want.num_sampled,
        want.seq_ids,
        want.block_ids,
    )
    assert got.fresh == want.fresh and len(got.paged) == len(want.paged) == 1
    for a, b in ((got.all.meta, want.all.meta), (got.paged[0].meta, want.paged[0].meta)):
        for f in ("block_tables", "seq_lens", "cu_seqlens_q", "q_positions"):
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and torch.equal(x, y), f
        assert (a.max_seqlen_q, a.max_seqlen_k) == (b.max_seqlen_q, b.max_seqlen_k)
    assert got.decode is not None and want.decode is not None
    assert torch.equal(got.decode[0], want.decode[0]) and torch.equal(got.decode[1], want.decode[1])
    assert got.decode[2] == want.decode[2] and got.decode[0].is_contiguous()
