"""tierkv-engine: generate from a checkpoint directory or a random-weight model."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from engine.config import RANDOM_CONFIGS
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierkv-engine", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate for one or more prompts and print text and metrics")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF checkpoint directory (config.json + safetensors)")
    src.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), help="random weights of a named size")
    g.add_argument("--prompt", action="append", default=[], help="text prompt (needs tokenizer.json); repeatable")
    g.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids; repeatable")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    g.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--no-prefix-caching", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts: list = list(args.prompt)
    try:
        prompts += [[int(t) for t in s.split(",") if t.strip()] for s in args.prompt_ids]
    except ValueError:
        print("error: --prompt-ids takes comma-separated integers", file=sys.stderr)
        return 2
    if not prompts:
        print("error: give --prompt or --prompt-ids", file=sys.stderr)
        return 2
    try:
        llm = LLM(args.model or RANDOM_CONFIGS[args.random_config], dtype=args.dtype,
                  kv_cache_dtype=args.kv_cache_dtype, kv_cache_bytes=args.kv_cache_bytes,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=not args.no_prefix_caching)
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
        outs = llm.generate(prompts, params, use_tqdm=False)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for o in outs:
        c = o.outputs[0]
        print(f"[{o.request_id}] {c.text if c.text is not None else c.token_ids}")
        print(json.dumps({"token_ids": c.token_ids, "finish_reason": c.finish_reason, **asdict(c.metrics)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
