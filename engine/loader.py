"""Build the model: from an HF checkpoint directory (config.json + safetensors, sharded or
not; tokenizer.json when present), from a Llama-family GGUF file, or with random weights
from a config."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tierkv.engine import gguf_loader, models
from tierkv.engine.config import DTYPES, ModelConfig
from tierkv.engine.model import LlamaForCausalLM
from tierkv.engine.tokenizer import Tokenizer
from tierkv.engine.tokenizer import from_dir as tokenizer_from_dir


def safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"shard {f} named in the index is missing")
    return files


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in safetensor_files(path):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def resolve_dtype(dtype: str, cfg: ModelConfig | None) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    return DTYPES.get(cfg.torch_dtype, torch.float32) if cfg is not None else torch.float32


def load_model(
    model: str | Path | dict[str, Any] | ModelConfig, dtype: str, seed: int
) -> tuple[LlamaForCausalLM, ModelConfig, torch.dtype, Tokenizer | None]:
    """(model in eval mode, its config, its dtype, its tokenizer or None). `model` is a
    checkpoint directory, a .gguf file, or a config for random weights."""
    tokenizer = None
    if isinstance(model, str):
        model = models.resolve(model)
    if isinstance(model, (str, Path)) and gguf_loader.is_gguf(model):
        reader = gguf_loader.open_gguf(model)
        conf = gguf_loader.config_dict(reader)
        cfg = ModelConfig.from_dict(conf)
        torch_dtype = resolve_dtype(dtype, cfg)
        net = LlamaForCausalLM(cfg).to(torch_dtype)
        net.load_weights(gguf_loader.iter_weights(reader, conf))
        tokenizer = gguf_loader.load_tokenizer(model)
    elif isinstance(model, (str, Path)):
        path = Path(model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path} is neither a checkpoint directory (no config.json) nor a .gguf file"
            )
        cfg = ModelConfig.from_dir(path)
        torch_dtype = resolve_dtype(dtype, cfg)
        net = LlamaForCausalLM(cfg).to(torch_dtype)
        net.load_weights(iter_weights(path))
        tokenizer = tokenizer_from_dir(path)
    else:
        cfg = model if isinstance(model, ModelConfig) else ModelConfig.from_dict(model)
        torch_dtype = resolve_dtype(dtype, None)
        gen = torch.Generator().manual_seed(seed)
        net = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for name, p in net.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        net = net.to(torch_dtype)
    return net.eval().requires_grad_(False), cfg, torch_dtype, tokenizer
