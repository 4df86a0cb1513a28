"""The models a benchmark runs on (`--model`): the random-weight bench model, or
SmolLM2-135M-Instruct, a real trained checkpoint, pulled once and kept as a safetensors copy
so that each of a benchmark's engines loads it in a second or two."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.engine.config import RANDOM_CONFIGS
from tierkv.engine.models import cache_dir, pull

NAMES = ("bench", "smollm2")


@dataclass(slots=True)
class BenchModel:
    name: str
    source: str | dict[str, Any]  # what LLM(model=...) takes
    vocab_size: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int

    def kv_bytes(self, tokens: int, itemsize: int = 2) -> int:
        return (
            tokens
            * self.num_hidden_layers
            * 2
            * self.num_key_value_heads
            * self.head_dim
            * itemsize
        )


def bench_model(name: str, max_len: int = 8192, layers: int = 0) -> BenchModel:
    """`bench` (random weights from seed 0; `layers` overrides its depth) or `smollm2`."""
    if name == "bench":
        cfg = dict(RANDOM_CONFIGS["bench"], max_position_embeddings=max_len + 512)
        if layers:
            cfg["num_hidden_layers"] = layers
        d = cfg["hidden_size"] // cfg["num_attention_heads"]
        return BenchModel(
            name, cfg, cfg["vocab_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"], d
        )
    if name == "smollm2":
        path = safetensors_copy()
        c = json.loads((path / "config.json").read_text())
        return BenchModel(
            name,
            str(path),
            c["vocab_size"],
            c["num_hidden_layers"],
            c["num_key_value_heads"],
            c["head_dim"],
        )
    raise ValueError(f"unknown bench model {name!r}; use one of {NAMES}")


def safetensors_copy() -> Path:
    """SmolLM2's GGUF weights, dequantized once, as a checkpoint directory beside it."""
    out = cache_dir() / "smollm2-safetensors"
    if (out / "config.json").exists():
        return out
    from safetensors.torch import save_file

    from tierkv.engine import gguf_loader

    gguf = pull("smollm2")
    reader = gguf_loader.open_gguf(gguf)
    conf = gguf_loader.config_dict(reader)
    weights = dict(gguf_loader.iter_weights(reader, conf))
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(conf))  # written last: marks the copy complete
    return out
