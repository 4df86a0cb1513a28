"""Llama-architecture model (Llama 2/3, Mistral, Qwen2): RMSNorm, RoPE, GQA, SwiGLU.

The model is pure compute over flattened tokens [N, hidden]. Attention over the paged cache
is a callback, `attend(layer, q, k, v) -> out`, supplied by the ModelRunner for each step, so
the runner owns every cache write, connector hook and per-layer schedule (CacheBlend can run
the later layers on a subset of rows by calling `layer()` itself).

bind() fixes each op's kernel once (kernels/step_ops.py): the modules then call the bound
functions, and forward() runs the layers as one loop over plain per-layer records (LayerStep)
with no module call and no dispatch check per op. An unbound model dispatches at each call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tierkv.engine.config import ModelConfig
from tierkv.kernels import RotaryEmbedding
from tierkv.kernels.layer_ops import linear, rms_norm, silu_mul
from tierkv.kernels.step_ops import StepOps

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LinearFn = Callable[[torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.op: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear whose weight may be wider than its input (see LlamaForCausalLM.widen_matmuls),
    then with the model-dtype weight kept as `narrow` for steps of few rows."""

    narrow: torch.Tensor | None = None
    op: LinearFn | None = None  # set by LlamaForCausalLM.bind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = self.op
        return op(x) if op is not None else linear(x, self.weight, self.bias, self.narrow)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.hq * self.d, self.hkv * self.d
        # q, k and v in one matmul (the loader packs HF's q_proj/k_proj/v_proj into it).
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rope = rope

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, Hq, D], k and v [N, Hkv, D] of normed rows x, q and k rotated to their
        positions."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = x.shape[0]
        q, k = self.rope.apply(q.view(n, self.hq, self.d), k.view(n, self.hkv, self.d), positions)
        return q, k, v.reshape(n, self.hkv, self.d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.silu: Callable[[torch.Tensor], torch.Tensor] = silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, layer: int, h: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        q, k, v = self.self_attn.qkv(self.input_layernorm(h), positions)
        return self.finish(h, attend(layer, q, k, v))

    def finish(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer after attention: out projection, residual, MLP. h [M, hidden] are the rows
        whose attention output out [M, Hq, D] is (CacheBlend's check layer finishes a subset)."""
        h = h + self.self_attn.o_proj(out.reshape(h.shape[0], -1))
        return h + self.mlp(self.post_attention_layernorm(h))


def _bound(m: nn.Module) -> LinearFn:
    assert isinstance(m, Linear) and m.op is not None  # bind() sets every Linear's op first
    return m.op


@dataclass(slots=True)
class LayerStep:
    """One decoder layer as forward's loop reads it: its norm weights and bound linear layers."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    qkv: LinearFn
    o: LinearFn
    gate_up: LinearFn
    down: LinearFn


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our module fragment, shard index in the packed weight)
    packed = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = rope = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.ops: StepOps | None = None
        self.steps: list[LayerStep] = []
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Final hidden states [N, hidden] (before the norm) of flattened tokens."""
        h = self.embed_tokens(input_ids)
        ops = self.ops
        if ops is None:
            for i, layer in enumerate(self.layers):
                h = layer(i, h, positions, attend)
            return h
        # DecoderLayer.forward, op for op, on the bound functions.
        n, cfg = h.shape[0], self.cfg
        if positions.shape != (n,):
            raise ValueError(f"positions must be [{n}], got {tuple(positions.shape)}")
        cos, sin = self.rope.cos_sin(positions)  # once for every layer
        norm, silu, rot, eps = ops.rms_norm, ops.silu_mul, ops.rotate, cfg.rms_norm_eps
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        sizes = [hq * d, hkv * d, hkv * d]
        for i, s in enumerate(self.steps):
            q, k, v = s.qkv(norm(h, s.norm1, eps)).split_with_sizes(sizes, -1)
            q, k = rot(q.view(n, hq, d), cos, sin), rot(k.view(n, hkv, d), cos, sin)
            h = h + s.o(attend(i, q, k, v.reshape(n, hkv, d)).reshape(n, -1))
            h = h + s.down(silu(s.gate_up(norm(h, s.norm2, eps))))
        return h

    def bind(self, ops: StepOps) -> None:
        """Fix every op's kernel (after the weights are final: loaded, widened). The linear
        layers hold their weights' Parameters, so in-place updates of those stay seen."""
        self.ops = ops
        self.rope.rotate = ops.rotate
        for m in self.modules():
            if isinstance(m, Linear):
                m.op = ops.linear(m.weight, m.bias, m.narrow)
            elif isinstance(m, RMSNorm):
                m.op = ops.rms_norm
            elif isinstance(m, MLP):
                m.silu = ops.silu_mul
        self.steps = [
            LayerStep(
                x.input_layernorm.weight,
                x.post_attention_layernorm.weight,
                _bound(x.self_attn.qkv_proj),
                _bound(x.self_attn.o_proj),
                _bound(x.mlp.gate_up_proj),
                _bound(x.mlp.down_proj),
            )
            for x in self.layers
            if isinstance(x, DecoderLayer)
        ]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h)).float()

    def widen_matmuls(self, dtype: torch.dtype) -> None:
        """Keep every linear layer's weights in `dtype` (fp32 for a bf16 model on a CPU whose
        torch GEMM has no native bf16): activations stay in the model dtype, each product is
        computed in `dtype` and rounded back. A tied lm_head gets its own widened copy. The bf16
        weights stay too, as each Linear's `narrow`, for steps of few rows (layer_ops.GEMV_ROWS):
        the weights then take the bf16 bytes plus the widened copy's."""
        if self.lm_head.weight is self.embed_tokens.weight:
            self.lm_head.weight = nn.Parameter(
                self.embed_tokens.weight.detach().to(dtype), requires_grad=False
            )
            self.lm_head.narrow = self.embed_tokens.weight.detach()  # shared with the embedding
        for m in self.modules():
            if isinstance(m, Linear):  # column-major: the GEMM reads it untransposed (M=1: -15-20%)
                if m.narrow is None and m.weight.dtype == torch.bfloat16:
                    m.narrow = m.weight.detach().contiguous()
                m.weight.data = m.weight.data.to(dtype).t().contiguous().t()
                if m.bias is not None:
                    m.bias.data = m.bias.data.to(dtype)
        if self.ops is not None:  # the tied lm_head and every narrow copy are new tensors
            self.bind(self.ops)

    def _shard(self, cfg: ModelConfig, target: str, idx: int) -> tuple[int, int]:
        if target == "qkv_proj":
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][idx]
        return (idx * cfg.intermediate_size, cfg.intermediate_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every parameter must be covered exactly once."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, w in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, shard = name, None
            for src, (ours, idx) in self.packed.items():
                if f".{src}." in name:
                    target, shard = name.replace(src, ours), idx
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            p = params[target]
            dst = (
                p.data
                if shard is None
                else p.data.narrow(0, *self._shard(self.cfg, target.split(".")[-2], shard))
            )
            if dst.shape != w.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(w.shape)} != model {tuple(dst.shape)}"
                )
            dst.copy_(w)
            filled[target] = filled.get(target, 0) + dst.numel()
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
        if missing:
            raise ValueError(
                f"checkpoint lacks weights for {missing[:5]}{'...' if len(missing) > 5 else ''}"
            )
