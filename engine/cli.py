"""tierkv-engine: generate from a checkpoint directory or a random-weight model."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from tierkv.engine.blend import PromptPart
from tierkv.engine.config import RANDOM_CONFIGS
from tierkv.engine.llm import LLM
from tierkv.engine.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierkv-engine", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser(
        "generate", help="generate for one or more prompts and print text and metrics"
    )
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF checkpoint directory (config.json + safetensors)")
    src.add_argument(
        "--random-config", choices=sorted(RANDOM_CONFIGS), help="random weights of a named size"
    )
    g.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="text prompt (needs tokenizer.json); repeatable",
    )
    g.add_argument(
        "--prompt-ids", action="append", default=[], help="comma-separated token ids; repeatable"
    )
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
    c = g.add_argument_group("KV connector (tierkv tiers; needs the connector package)")
    c.add_argument(
        "--kv-connector", action="store_true", help="attach TierKVConnector with local tiers"
    )
    c.add_argument("--cache-server", help="HOST:PORT of a tierkv-server (implies --kv-connector)")
    c.add_argument(
        "--remote", help="redis://, rediss:// or redis+cluster:// URL (implies --kv-connector)"
    )
    c.add_argument("--token", help="bearer token for the cache server")
    c.add_argument("--cpu-cache", default="1GiB", help="local cpu tier capacity (0 = none)")
    c.add_argument("--disk-cache", default=None, help="local disk tier directory")
    c.add_argument("--chunk-size", type=int, default=256)
    b = g.add_argument_group("any-position reuse (CacheBlend)")
    b.add_argument(
        "--system",
        help="the shared system prefix file: reused exactly; the documents' KV is "
        "computed after it and stored under it",
    )
    b.add_argument(
        "--doc", action="append", default=[], help="a document file (text, or token ids with --ids)"
    )
    b.add_argument("--question", help="the question file; with --doc the prompt is docs + question")
    b.add_argument(
        "--ids",
        action="store_true",
        help="--system/--doc/--question files hold comma-separated token ids",
    )
    b.add_argument(
        "--blend-ratio", type=float, default=None, help="share of document tokens recomputed"
    )
    return p


def read_segment(path: str, ids: bool):
    text = open(path).read()
    return [int(t) for t in text.replace("\n", ",").split(",") if t.strip()] if ids else text


def make_connector(args):
    if not (args.kv_connector or args.cache_server or args.remote):
        return None
    from tierkv.connector import (
        ConnectorConfig,
        TierKVConnector,
    )  # the engine runs without it otherwise

    remote = f"grpc://{args.cache_server}" if args.cache_server else args.remote
    return TierKVConnector(
        ConnectorConfig(
            chunk_size=args.chunk_size,
            cpu_bytes=args.cpu_cache,
            disk_dir=args.disk_cache,
            remote=remote,
            token=args.token,
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts: list = list(args.prompt)
    try:
        prompts += [[int(t) for t in s.split(",") if t.strip()] for s in args.prompt_ids]
    except ValueError:
        print("error: --prompt-ids takes comma-separated integers", file=sys.stderr)
        return 2
    if args.system and not args.doc:
        print("error: --system needs --doc", file=sys.stderr)
        return 2
    if args.doc:
        if not args.question:
            print("error: --doc needs --question", file=sys.stderr)
            return 2
        system = (
            [PromptPart(read_segment(args.system, args.ids), prefix=True)] if args.system else []
        )
        prompts.append(
            system
            + [PromptPart(read_segment(d, args.ids)) for d in args.doc]
            + [PromptPart(read_segment(args.question, args.ids), reusable=False)]
        )
    if not prompts:
        print("error: give --prompt, --prompt-ids or --doc with --question", file=sys.stderr)
        return 2
    conn = None
    try:
        conn = make_connector(args)
        llm = LLM(
            args.model or RANDOM_CONFIGS[args.random_config],
            dtype=args.dtype,
            kv_connector=conn,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_bytes=args.kv_cache_bytes,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
        )
        params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            blend_ratio=args.blend_ratio,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if conn is not None:
            conn.close()
    for o in outs:
        c = o.outputs[0]
        print(f"[{o.request_id}] {c.text if c.text is not None else c.token_ids}")
        print(
            json.dumps(
                {"token_ids": c.token_ids, "finish_reason": c.finish_reason, **asdict(c.metrics)}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
