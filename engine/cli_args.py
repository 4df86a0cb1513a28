"""`tierkv-engine`'s flags: each one's help is the documentation of the config field it sets
(EngineConfig, SamplingParams, ServeConfig, ConnectorConfig, TiersConfig), with its default."""

from __future__ import annotations

import argparse
from typing import Any

from tierkv.connector.config import ConnectorConfig
from tierkv.engine.config import RANDOM_CONFIGS, EngineConfig
from tierkv.engine.models import MODELS
from tierkv.engine.sampling_params import SamplingParams
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.knobs import knob_default, knob_help
from tierkv.storage_backends.sizes import parse_size as size

# The prefill knobs of EngineConfig that generate, chat and serve take as flags, and their types.
LAYERED_KNOBS: dict[str, type] = {
    "prefill_mode": str,
    "layer_groups": int,
    "layered_step_rows": int,
    "max_layered": int,
    "layered_gap": float,
}


def engine_options() -> argparse.ArgumentParser:
    """The model, sampling, engine and connector options that generate and chat share."""
    g = argparse.ArgumentParser(add_help=False)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        help="HF checkpoint directory (config.json + safetensors), a Llama-family .gguf "
        f"file, or a model that `pull` fetches ({', '.join(sorted(MODELS))}); this or "
        "--random-config is required (default: none)",
    )
    src.add_argument(
        "--random-config",
        choices=sorted(RANDOM_CONFIGS),
        help="random weights of a named size, seed 0 (default: none)",
    )
    sp, ec, cc = SamplingParams, EngineConfig, ConnectorConfig
    g.add_argument("--max-tokens", type=int, default=32, help=knob_help(sp, "max_tokens", 32))
    g.add_argument("--temperature", type=float, default=0.0, help=knob_help(sp, "temperature", 0))
    g.add_argument("--top-k", type=int, default=0, help=knob_help(sp, "top_k"))
    g.add_argument("--top-p", type=float, default=1.0, help=knob_help(sp, "top_p"))
    g.add_argument("--seed", type=int, default=None, help=knob_help(sp, "seed"))
    g.add_argument("--ignore-eos", action="store_true", help=knob_help(sp, "ignore_eos"))
    g.add_argument("--dtype", default="auto", help=knob_help(ec, "dtype"))
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help=knob_help(ec, "kv_cache_dtype"),
    )
    g.add_argument(
        "--kv-cache-bytes",
        type=size,
        default=256 << 20,
        help=knob_help(ec, "kv_cache_bytes", 256 << 20) + "; sizes read as 512MiB, 2GiB",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=knob_default(ec, "max_num_batched_tokens"),
        help=knob_help(ec, "max_num_batched_tokens"),
    )
    for knob, kind in LAYERED_KNOBS.items():  # how long prompts are prefilled
        g.add_argument(
            "--" + knob.replace("_", "-"),
            type=kind,
            choices=("chunked", "layered") if knob == "prefill_mode" else None,
            default=knob_default(ec, knob),
            help=knob_help(ec, knob),
        )
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn off the engine's automatic prefix caching (default: on)",
    )
    g.add_argument(
        "--cascade-attention",
        action="store_true",
        help="read a prefix shared by several decoding sequences once per step, cascade "
        "attention (default: off; every sequence reads its whole context)",
    )
    g.add_argument(
        "--eviction",
        choices=("lru", "hinted"),
        default=knob_default(ec, "eviction"),
        help=knob_help(ec, "eviction"),
    )
    g.add_argument(
        "--blend-calibration",
        default=knob_default(ec, "blend_calibration"),
        help=knob_help(ec, "blend_calibration"),
    )
    c = g.add_argument_group("KV connector (tierkv tiers)")
    c.add_argument(
        "--kv-connector",
        action="store_true",
        help="attach TierKVConnector with local tiers (default: off; implied by the two below)",
    )
    c.add_argument(
        "--cache-server",
        help="HOST:PORT or grpc[s]://HOST:PORT of a tierkv-server, the remote tier (default: none)",
    )
    c.add_argument("--remote", help=knob_help(cc, "remote"))
    c.add_argument("--token", help=knob_help(cc, "token"))
    c.add_argument("--cpu-cache", default="1GiB", help=knob_help(TiersConfig, "cpu_bytes"))
    c.add_argument("--disk-cache", default=None, help=knob_help(TiersConfig, "disk_dir"))
    c.add_argument(
        "--chunk-size",
        type=int,
        default=knob_default(cc, "chunk_size"),
        help=knob_help(cc, "chunk_size"),
    )
    return g


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierkv-engine",
        description="generate or chat with a checkpoint (HF directory, GGUF file, or a named "
        "model that `pull` fetches) or a random-weight model; serve it over the OpenAI API",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    common = engine_options()
    g = sub.add_parser(
        "generate",
        parents=[common],
        help="generate for one or more prompts and print text and metrics",
    )
    g.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="text prompt (needs a tokenizer); repeatable (default: none)",
    )
    g.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        help="comma-separated token ids; repeatable (default: none)",
    )
    ch = sub.add_parser(
        "chat",
        parents=[common],
        help="chat through the model's chat template: one reply to --message, else a "
        "conversation read line by line from stdin",
    )
    ch.add_argument("--system", dest="system_prompt", help="the system message (default: none)")
    ch.add_argument(
        "--message", help="one user message: print the reply and exit (default: read stdin)"
    )
    sv = sub.add_parser(
        "serve", parents=[common], help="serve the OpenAI API over HTTP (see docs/serve.md)"
    )
    from tierkv.engine.serve.cli import add_serve_options

    add_serve_options(sv)
    pl = sub.add_parser("pull", help="fetch a named model into the model cache")
    pl.add_argument("name", choices=sorted(MODELS), help="the model to fetch")
    pl.add_argument(
        "--dir",
        default=None,
        help="cache directory (default: $TIERKV_MODEL_DIR, else ~/.cache/tierkv/models)",
    )
    add_calibrate(sub)
    b = g.add_argument_group("any-position reuse (CacheBlend)")
    b.add_argument(
        "--system",
        help="the shared system prefix file: reused exactly; the documents' KV is "
        "computed after it and stored under it (default: none)",
    )
    b.add_argument(
        "--doc",
        action="append",
        default=[],
        help="a document file (text, or token ids with --ids); repeatable (default: none)",
    )
    b.add_argument(
        "--question",
        help="the question file; with --doc the prompt is docs + question (default: none)",
    )
    b.add_argument(
        "--ids",
        action="store_true",
        help="--system/--doc/--question files hold comma-separated token ids (default: off)",
    )
    b.add_argument(
        "--blend-ratio",
        type=float,
        default=None,
        help=knob_help(EngineConfig, "blend_ratio").replace("(default: ", "(default: engine's, "),
    )
    b.add_argument(
        "--blend-rule",
        default=None,
        help=knob_help(EngineConfig, "blend_rule").replace("(default: ", "(default: engine's, "),
    )
    return p


def add_calibrate(sub: Any) -> None:
    """`calibrate-blend`: the knobs of CalibrateConfig (engine/blend_calibrate.py)."""
    from tierkv.engine.blend_calibrate import CalibrateConfig

    cc, d = CalibrateConfig, CalibrateConfig()
    c = sub.add_parser(
        "calibrate-blend",
        help="measure blend rules on the model and store the cheapest that meets the target "
        "beside the model file, for serve and LLM (docs/cacheblend.md)",
    )
    c.add_argument(
        "--model",
        required=True,
        help="the model to calibrate: a .gguf file, a checkpoint directory or a pulled name "
        "(required)",
    )
    c.add_argument("--questions", type=int, default=d.questions, help=knob_help(cc, "questions"))
    c.add_argument(
        "--min-agreement", type=float, default=d.min_agreement, help=knob_help(cc, "min_agreement")
    )
    c.add_argument(
        "--min-answer-agreement",
        type=float,
        default=d.min_answer_agreement,
        help=knob_help(cc, "min_answer_agreement"),
    )
    c.add_argument(
        "--min-relative-accuracy",
        type=float,
        default=d.min_relative_accuracy,
        help=knob_help(cc, "min_relative_accuracy"),
    )
    floats = lambda s: tuple(float(x) for x in s.split(",") if x.strip())
    words = lambda s: tuple(x.strip() for x in s.split(",") if x.strip())
    ints = lambda s: tuple(int(x) for x in s.split(",") if x.strip())
    c.add_argument("--ratios", type=floats, default=d.ratios, help=knob_help(cc, "ratios"))
    c.add_argument("--rules", type=words, default=d.rules, help=knob_help(cc, "rules"))
    c.add_argument("--dtype", default=d.dtype, help=knob_help(cc, "dtype"))
    c.add_argument("--doc-tokens", type=int, default=d.doc_tokens, help=knob_help(cc, "doc_tokens"))
    c.add_argument("--docs-per", type=ints, default=d.docs_per, help=knob_help(cc, "docs_per"))
    c.add_argument("--max-tokens", type=int, default=d.max_tokens, help=knob_help(cc, "max_tokens"))
    c.add_argument("--seed", type=int, default=d.seed, help=knob_help(cc, "seed"))
    c.add_argument(
        "--out",
        default=None,
        help="where to write the calibration (default: the model's cache entry, "
        "blend-<sha256>.json beside the model file)",
    )
