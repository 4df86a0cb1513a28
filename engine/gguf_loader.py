"""Llama-family GGUF checkpoints: config, weights and tokenizer from one file.

The `gguf` package reads the file and dequantizes each tensor to fp32 (F32, F16, BF16, Q8_0,
Q4_0, Q4_1, Q4_K, Q6_K and the other ggml types it knows); the engine then casts to its dtype.
llama.cpp stores the Q and K projections with their rows permuted for its rotary layout;
they are permuted back here, so the weights equal a Hugging Face checkpoint's, bit for bit
the ones transformers' own GGUF loader produces.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierkv.engine.tokenizer import Tokenizer

# GGUF tensor names -> Hugging Face Llama names ({i} = layer).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SUPPORTED_ARCHS = ("llama",)


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    return p.suffix == ".gguf" and p.is_file()


def open_gguf(path: str | Path) -> Any:
    """A gguf.GGUFReader over the file (memory-mapped: tensors are read on use)."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ImportError("GGUF checkpoints need the `gguf` package: pip install gguf") from e
    reader = GGUFReader(str(path))
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported ({SUPPORTED_ARCHS})")
    return reader


def field(reader: Any, name: str, default: Any = None) -> Any:
    f = reader.fields.get(name)
    return default if f is None else f.contents()


def config_dict(reader: Any) -> dict[str, Any]:
    """An HF-style config.json dict from the GGUF metadata."""
    a = field(reader, "general.architecture")
    heads = int(field(reader, f"{a}.attention.head_count"))
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF rope_freqs (Llama 3.1 rope scaling) is not supported yet")
    scaling = field(reader, f"{a}.rope.scaling.type")
    rope_scaling = None
    if scaling not in (None, "none"):
        factor = float(field(reader, f"{a}.rope.scaling.factor", 1.0))
        rope_scaling = {"rope_type": scaling, "factor": factor}
    vocab = field(reader, f"{a}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    hidden = int(field(reader, f"{a}.embedding_length"))
    head_dim = int(field(reader, f"{a}.rope.dimension_count", hidden // heads))
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "model_type": a,
        "hidden_size": hidden,
        "num_hidden_layers": int(field(reader, f"{a}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, f"{a}.attention.head_count_kv", heads)),
        "intermediate_size": int(field(reader, f"{a}.feed_forward_length")),
        "vocab_size": int(vocab),
        "head_dim": head_dim,
        "rms_norm_eps": float(field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(field(reader, f"{a}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(field(reader, f"{a}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",
    }


def hf_name(name: str) -> str | None:
    """The HF name of a GGUF tensor; None for tensors the engine does not use."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K projection [heads * D, in]."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_weights(reader: Any, cfg: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) for every tensor the engine uses, dequantized."""
    from gguf import dequantize

    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name!r} has no place in a Llama model")
        w = dequantize(t.data, t.tensor_type)
        if name.endswith("q_proj.weight"):
            w = unpermute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, cfg["num_key_value_heads"])
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer and chat template in the GGUF metadata, converted by transformers' GGUF
    tokenizer conversion (the one its own GGUF loader uses)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError("a GGUF tokenizer needs transformers: pip install transformers") from e
    p = Path(path)
    hf = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    template = getattr(hf, "chat_template", None)
    return Tokenizer(
        hf.backend_tokenizer,
        template if isinstance(template, str) else None,
        str(hf.bos_token or ""),
        str(hf.eos_token or ""),
    )
