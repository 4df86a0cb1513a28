"""A decode-only step on the C++ kernels in one op call (torch.ops.tierkv.decode_layers,
kernels/cpu_step.cpp): the same ops as LlamaForCausalLM.forward's loop, in the same order, so
the same bits, without ~45 Python calls per layer. Where the connector has per-layer work in the
step (KVConnector.layer_work), it runs one op call per layer (decode_layer) with the hooks
around each: the layer's load is awaited before it writes its KV, and its save follows.

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
class FusedModel:
    """Every layer's weights, one list each as decode_layers takes them: the norms one per
    layer, the linear layers four per layer (qkv, o, gate_up, down); decode_layer takes layer
    i's slice of each."""

    norm1: list[torch.Tensor]
    norm2: list[torch.Tensor]
    w: list[torch.Tensor]
    few: list[torch.Tensor | None]
    bias: list[torch.Tensor | None]
    limit: list[int]


def fused_layers(model: LlamaForCausalLM, ops: StepOps, kv_dtype: torch.dtype) -> FusedModel | None:
    """The model's FusedModel where decode_layer(s) serve its decode steps (the C++ ops bound,
    the cache in the model's dtype), else None."""
    if not (ops.backend == "cpp" and ops.cpp and kv_dtype == ops.dtype):
        return None
    layers = [x for x in model.layers if isinstance(x, DecoderLayer)]
    assert len(layers) == len(model.layers)
    specs = [
        spec(ops, p)
        for x in layers
        for p in (x.self_attn.qkv_proj, x.self_attn.o_proj, x.mlp.gate_up_proj, x.mlp.down_proj)
    ]
    return FusedModel(
        [x.input_layernorm.weight for x in layers],
        [x.post_attention_layernorm.weight for x in layers],
        [s.weight for s in specs],
        [s.few for s in specs],
        [s.bias for s in specs],
        [s.limit for s in specs],
    )


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


def fused_forward(runner: ModelRunner, f: FusedModel, ctx: Context) -> torch.Tensor:
    """The step's final hidden states [N, hidden], as model(ctx.input_ids, ...) returns them."""
    assert ctx.decode is not None
    model, cfg, conn = runner.model, runner.cfg, runner.connector
    ids, seen, chunk = ctx.decode
    h = model.embed_tokens(ctx.input_ids)
    cos, sin = model.rope.cos_sin(ctx.positions)
    slots, scale, caches = ctx.slot_mapping, runner.scale, runner.layer_caches
    hq, hkv, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    if not conn.layer_work():
        return torch.ops.tierkv.decode_layers(
            h, cos, sin, [c.k for c in caches], [c.v for c in caches], slots, ids, seen, scale,
            chunk, f.norm1, f.norm2, eps, hq, hkv, f.w, f.few, f.bias, f.limit,
        )  # fmt: skip
    step = torch.ops.tierkv.decode_layer
    for i, c in enumerate(caches):
        j = slice(4 * i, 4 * i + 4)
        conn.wait_for_layer_load(i)
        h = step(
            h, cos, sin, c.k, c.v, slots, ids, seen, scale, chunk,
            f.norm1[i], f.norm2[i], eps, hq, hkv, f.w[j], f.few[j], f.bias[j], f.limit[j],
        )  # fmt: skip
        conn.save_kv_layer(i, runner.kv_caches[i], ctx)
    return h
