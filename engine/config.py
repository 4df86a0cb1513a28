"""Configuration: the model's shape (from an HF config.json) and the engine's knobs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierkv.engine.blend import BlendParams
from tierkv.engine.blend_rules import parse_rule
from tierkv.engine.random_configs import RANDOM_CONFIGS as RANDOM_CONFIGS

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(slots=True)
class ModelConfig:
    """The Llama-family shape, read from an HF config.json (Llama 2/3, Mistral, Qwen2)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = (
        None  # HF rope_scaling / rope_parameters (llama3, linear, ...)
    )
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 sets QKV bias
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.head_dim <= 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads {self.num_key_value_heads}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        arch = d.get("model_type", "llama")
        if arch not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported model_type {arch!r} (llama, mistral, qwen2)")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = d.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            head_dim=d.get("head_dim") or 0,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", arch == "qwen2"),
            eos_token_id=eos,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


@dataclass(slots=True)
class EngineConfig:
    """Every knob of the engine."""

    dtype: str = (
        "auto"  # weights/activations: auto (checkpoint's, fp32 for random) | fp32 | bf16 | fp16
    )
    kv_cache_dtype: str = "auto"  # auto (= dtype) | fp8 (e4m3, per-layer per-head scales)
    kv_cache_bytes: int = 1 << 30  # byte budget for all layers' K and V; sets num_blocks
    block_size: int = 16  # tokens per KV block
    max_num_batched_tokens: int = 2048  # per-step token budget (prefill chunks + decodes)
    max_num_seqs: int = 256  # most sequences running at once (layered prefills in flight too)
    # How a prompt longer than max_num_batched_tokens is prefilled: "chunked" (token chunks of
    # the step's budget, beside the decodes) or "layered" (its whole prompt through a group of
    # layers per step, beside the decodes, which run every layer every step; engine/layered.py)
    prefill_mode: str = "chunked"
    # Layered prefill: the layer groups a prompt goes in (its steps); 0 = a step's prefill work
    # (rows x layers) is a quarter of a full chunk's (max_num_batched_tokens tokens through
    # every layer), a layer's rows split over steps where they exceed it
    layer_groups: int = 0
    # Layered prefill: the rows x layers a step runs of the prompt (plain or blend), over
    # layer_groups; 0 = as layer_groups says. A layer whose rows exceed it runs in row chunks
    # over several steps.
    layered_step_rows: int = 0
    # Layered prefill: the most prompts layered at once (a blend prefill beside a long plain
    # prompt), first come first served; the step's layered work is shared evenly among them.
    max_layered: int = 2
    # Layered prefill: 0 = the step's work is fixed (layer_groups, layered_step_rows); g > 1 =
    # a step that runs layered work beside other sequences aims at g x the median time of
    # recent decode-only steps, its work set from the measured rate (engine/pacer.py).
    layered_gap: float = 0.0
    enable_prefix_caching: bool = True  # radix-tree reuse of block-aligned prompt prefixes
    # The prefix cache's eviction: "lru" (least recently used leaf first) or "hinted" (the leaf
    # whose next use, by the requests' workflow hints, is farthest first; LRU among equals and
    # where nothing is hinted). docs/workflows.md.
    eviction: str = "lru"
    # When a hinted request starts a workflow step, prefetch through the connector the prompts
    # of the agents of the next step (their last ones seen); off: hints order eviction only.
    workflow_prefetch: bool = True
    # With workflow_prefetch and the prefix cache: most KV blocks per step that a prefetched
    # prompt, once in the connector's local tier, is loaded into (verified, through the step's
    # own loads) and indexed in the prefix cache as if computed; only blocks free beyond what
    # the queued and running sequences may need. 0: off (the prompt waits in the local tier).
    block_prefetch: int = 32
    # Decode steps: sequences whose block tables start with the same blocks (a prompt prefix
    # shared through the prefix cache) read those keys once per step for all of them (cascade
    # attention, kernels/cascade.py) where the C++ decode kernel or the Triton kernel serves
    # the step. Off by default: on CPUs the decode is bound by its arithmetic, not by reading
    # KV, and bench.cascade measured it at 0.98x (docs/engine.md); it is for memory-bound
    # decodes (GPUs, long shared prefixes on many cores).
    cascade_attention: bool = False
    # Decode steps on the C++ kernels: each layer in one op call (engine/decode_step.py; the same
    # ops and bits as the Python loop, ~45 fewer Python calls a layer). Off: the Python loop.
    fused_decode: bool = True
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    seed: int = 0  # random weights and unseeded sampling
    # Linear layers compute in: "auto" = fp32 for bf16/fp16 weights on a CPU without native
    # bf16/fp16 GEMMs (kernels/layer_ops.native_matmul; 6-8x faster there, weights take twice
    # the memory), else the model dtype; "model" = always the model dtype; "float32" = always fp32.
    # Activations and the KV cache stay in the model dtype either way.
    matmul_dtype: str = "auto"
    # glibc on a CPU device: serve big tensors from the heap and never trim it, so a step's
    # buffers are reused instead of freshly mmapped and page-faulted (steps ran 2-10x slower
    # and erratic without it here). Process-wide; the heap stays at its peak size.
    retain_host_memory: bool = True
    blend_ratio: float = (
        0.15  # CacheBlend: share of reused segment tokens recomputed after the check layer
    )
    blend_check_layer: int = (
        1  # CacheBlend: layers before it run in full; rows ranked by its K/V deviation
    )
    blend_metric: str = "k"  # CacheBlend ranking: "k" / "v" distance, or "random" (a baseline)
    # CacheBlend gradual filtering: 0 picks the recomputed rows once, at the check layer; g > 0
    # picks 2x blend_ratio there and re-ranks the picked rows at each of the next g layers by
    # their K deviation at that layer, narrowing linearly to blend_ratio.
    blend_gradual: int = 0
    # Which loaded rows a blend prefill recomputes: rule names joined by "+" (docs/cacheblend.md):
    # "cacheblend" (K/V deviation at the check layer), "query_early" (the question's attention
    # at the check layer), "query_late" (its attention at blend_query_layer from a question-only
    # pass over the cached KV), "legolink" (each loaded segment's first tokens, alone or in a
    # union with one ranking rule), "ape" (APE's attention over the still-cached context, alone
    # or on top of any rule). SamplingParams.blend_rule overrides it per request.
    blend_rule: str = "cacheblend"
    # legolink: the first tokens of every loaded segment recomputed through every layer (where
    # an independently encoded segment's false attention sink sits).
    blend_sink_tokens: int = 16
    # query_late: the layer whose question attention ranks the loaded rows; None = round(0.75 *
    # the model's layers).
    blend_query_layer: int | None = None
    # query_early / query_late: a row's score is its attention from the question plus that of
    # this many loaded rows on each side (a smoothed ranking keeps runs of tokens).
    blend_query_smooth: int = 2
    # ape: temperature T on the still-cached context block's logits (weights softmax(s/T)).
    blend_ape_temperature: float = 0.9
    # ape: scale S of the context block's log-mass, T * S * logsumexp(s/T), against the rest's.
    blend_ape_scale: float = 0.9
    # CacheBlend: how a reusable part without a declared shared prefix is encoded for storage.
    # "preamble": computed after the model's fixed preamble (engine/encoding.py: BOS and the
    # chat template's system preamble), whose KV is dropped, so no part carries a false
    # attention sink; "standalone": computed from position 0 (its first token a sink). Each is
    # stored under its own keys. A declared prefix's parts are encoded after it either way.
    # Standalone is the default: on SmolLM2 the preamble deviated more (docs/cacheblend.md).
    blend_encoding: str = "standalone"
    # Which rule a prompt in parts blends with when its request sets no blend_ratio: "auto" =
    # the model's calibration (`tierkv-engine calibrate-blend`, stored beside the model file);
    # without one, prompts in parts fall back to prefix reuse (no blend). "off" = the blend_*
    # knobs above. A path = that calibration file (refused if it is another model's).
    blend_calibration: str = "auto"

    def __post_init__(self) -> None:
        BlendParams(
            self.blend_ratio,
            self.blend_check_layer,
            self.blend_metric,
            self.blend_gradual,
            parse_rule(self.blend_rule, "blend_rule"),
            self.blend_sink_tokens,
            self.blend_query_layer,
            self.blend_query_smooth,
            self.blend_ape_temperature,
            self.blend_ape_scale,
        )  # checks every blend knob, naming the bad one
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.matmul_dtype not in ("auto", "model", "float32"):
            raise ValueError(
                f"matmul_dtype must be 'auto', 'model' or 'float32', got {self.matmul_dtype!r}"
            )
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.prefill_mode not in ("chunked", "layered"):
            raise ValueError(
                f"prefill_mode must be 'chunked' or 'layered', got {self.prefill_mode!r}"
            )
        if self.layer_groups < 0:
            raise ValueError(f"layer_groups must be >= 0, got {self.layer_groups}")
        if self.layered_step_rows < 0:
            raise ValueError(f"layered_step_rows must be >= 0, got {self.layered_step_rows}")
        if self.max_layered < 1:
            raise ValueError(f"max_layered must be >= 1, got {self.max_layered}")
        if self.layered_gap != 0 and not self.layered_gap > 1:
            raise ValueError(f"layered_gap must be 0 (off) or > 1, got {self.layered_gap}")
        if self.eviction not in ("lru", "hinted"):
            raise ValueError(f"eviction must be 'lru' or 'hinted', got {self.eviction!r}")
        if self.blend_encoding not in ("preamble", "standalone"):
            raise ValueError(
                f"blend_encoding must be 'preamble' or 'standalone', got {self.blend_encoding!r}"
            )
        if self.block_prefetch < 0:
            raise ValueError(f"block_prefetch must be >= 0, got {self.block_prefetch}")
        if not self.blend_calibration:
            raise ValueError("blend_calibration must be 'auto', 'off' or a file path")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
