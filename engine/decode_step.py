"""A decode-only step on the C++ kernels, one op call per layer (torch.ops.tierkv.decode_layer,
kernels/cpu_step.cpp): the same ops as LlamaForCausalLM.forward's loop, in the same order, so
the same bits, without ~45 Python calls per layer. The connector's per-layer hooks run around
each call: the layer's load is awaited before it writes its KV, and its save follows the write.

It serves a step whose Context has the decode kernel's arguments (every row one decoding
sequence, no padding, no cascade groups) on a runner whose ops are the C++ ones with a cache in
the model's dtype; any other step runs the Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tierkv.engine.model import DecoderLayer, Linear
from tierkv.kernels.step_ops import LinearSpec, StepOps

if TYPE_CHECKING:
    from tierkv.engine.context import Context
    from tierkv.engine.model import LlamaForCausalLM
    from tierkv.engine.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class FusedLayer:
    """One layer's weights as decode_layer takes them (qkv, o, gate_up, down)."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    w: list[torch.Tensor]
    few: list[torch.Tensor | None]
    bias: list[torch.Tensor | None]
    limit: list[int]

    @classmethod
    def of(cls, norm1: torch.Tensor, norm2: torch.Tensor, specs: list[LinearSpec]) -> FusedLayer:
        return cls(
            norm1,
            norm2,
            [s.weight for s in specs],
            [s.few for s in specs],
            [s.bias for s in specs],
            [s.limit for s in specs],
        )


def fused_layers(
    model: LlamaForCausalLM, ops: StepOps, kv_dtype: torch.dtype
) -> list[FusedLayer] | None:
    """Each layer's FusedLayer where decode_layer serves this model's decode steps (the C++ ops
    bound, the cache in the model's dtype), else None."""
    if not (ops.backend == "cpp" and ops.cpp and kv_dtype == ops.dtype):
        return None
    out = []
    for x in model.layers:
        assert isinstance(x, DecoderLayer)
        a, m = x.self_attn, x.mlp
        specs = [spec(ops, p) for p in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
        out.append(
            FusedLayer.of(x.input_layernorm.weight, x.post_attention_layernorm.weight, specs)
        )
    return out


def spec(ops: StepOps, m: torch.nn.Module) -> LinearSpec:
    assert isinstance(m, Linear)
    return ops.linear_spec(m.weight, m.bias, m.narrow)


def fits(ctx: Context) -> bool:
    """Whether decode_layer serves ctx's step (its rows are the decodes, whole)."""
    return (
        ctx.decode is not None
        and ctx.all.meta.cascade is None
        and ctx.num_tokens == ctx.input_ids.shape[0]
    )


def fused_forward(runner: ModelRunner, layers: list[FusedLayer], ctx: Context) -> torch.Tensor:
    """The step's final hidden states [N, hidden], as model(ctx.input_ids, ...) returns them."""
    assert ctx.decode is not None
    model, cfg, conn = runner.model, runner.cfg, runner.connector
    ids, seen, chunk = ctx.decode
    h = model.embed_tokens(ctx.input_ids)
    cos, sin = model.rope.cos_sin(ctx.positions)
    step, slots, scale = torch.ops.tierkv.decode_layer, ctx.slot_mapping, runner.scale
    hq, hkv, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    for i, x in enumerate(layers):
        c = runner.layer_caches[i]
        conn.wait_for_layer_load(i)
        h = step(
            h, cos, sin, c.k, c.v, slots, ids, seen, scale, chunk,
            x.norm1, x.norm2, eps, hq, hkv, x.w, x.few, x.bias, x.limit,
        )  # fmt: skip
        conn.save_kv_layer(i, runner.kv_caches[i], ctx)
    return h
