"""tierkv-engine: generate or chat with a checkpoint (HF directory, GGUF file, or a named
model that `pull` fetches), or with a random-weight model."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tierkv.connector.config import ConnectorConfig
from tierkv.engine.blend import PromptPart
from tierkv.engine.config import RANDOM_CONFIGS, EngineConfig
from tierkv.engine.llm import LLM
from tierkv.engine.models import MODELS, pull
from tierkv.engine.outputs import RequestOutput
from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.tokenizer import Message
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.knobs import knob_default, knob_help
from tierkv.storage_backends.sizes import parse_size as size


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
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn off the engine's automatic prefix caching (default: on)",
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
    p = argparse.ArgumentParser(prog="tierkv-engine", description=__doc__)
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
    return p


def read_segment(path: str, ids: bool):
    text = open(path).read()
    return [int(t) for t in text.replace("\n", ",").split(",") if t.strip()] if ids else text


def make_connector(args):
    if not (args.kv_connector or args.cache_server or args.remote):
        return None
    from tierkv.connector import TierKVConnector  # loaded only when asked for

    server = args.cache_server
    remote = (server if "://" in server else f"grpc://{server}") if server else args.remote
    return TierKVConnector(
        ConnectorConfig(
            chunk_size=args.chunk_size,
            tiers=TiersConfig(cpu_bytes=args.cpu_cache, disk_dir=args.disk_cache),
            remote=remote,
            token=args.token,
        )
    )


def make_llm(args: argparse.Namespace, conn: Any) -> LLM:
    return LLM(
        args.model or RANDOM_CONFIGS[args.random_config],
        dtype=args.dtype,
        kv_connector=conn,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        blend_ratio=getattr(args, "blend_ratio", None),
    )


def prompts_of(args: argparse.Namespace) -> list[Any]:
    """generate's prompts; ValueError on bad flags."""
    prompts: list[Any] = list(args.prompt)
    try:
        prompts += [[int(t) for t in s.split(",") if t.strip()] for s in args.prompt_ids]
    except ValueError:
        raise ValueError("--prompt-ids takes comma-separated integers") from None
    if args.system and not args.doc:
        raise ValueError("--system needs --doc")
    if args.doc:
        if not args.question:
            raise ValueError("--doc needs --question")
        system = (
            [PromptPart(read_segment(args.system, args.ids), prefix=True)] if args.system else []
        )
        prompts.append(
            system
            + [PromptPart(read_segment(d, args.ids)) for d in args.doc]
            + [PromptPart(read_segment(args.question, args.ids), reusable=False)]
        )
    if not prompts:
        raise ValueError("give --prompt, --prompt-ids or --doc with --question")
    return prompts


def print_outputs(outs: list[RequestOutput]) -> None:
    for o in outs:
        c = o.outputs[0]
        print(f"[{o.request_id}] {c.text if c.text is not None else c.token_ids}")
        print(
            json.dumps(
                {"token_ids": c.token_ids, "finish_reason": c.finish_reason, **asdict(c.metrics)}
            )
        )


def chat(llm: LLM, args: argparse.Namespace) -> None:
    """One reply to --message, else a conversation: each stdin line is a user turn."""
    history: list[Message] = []
    if args.system_prompt:
        history.append({"role": "system", "content": args.system_prompt})
    lines = [args.message] if args.message is not None else sys.stdin
    for line in lines:
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.strip()})
        out = llm.chat(history, sampling(args), use_tqdm=False)[0]
        reply = out.outputs[0].text or ""
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
        m = out.metrics
        print(
            f"  [{m.prompt_tokens} prompt tokens, {m.cached_tokens} from the prefix cache, "
            f"{m.external_tokens} loaded; ttft {m.ttft * 1e3:.0f} ms]",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    conn = None
    try:
        if args.cmd == "pull":
            print(pull(args.name, Path(args.dir) if args.dir else None))
            return 0
        prompts = prompts_of(args) if args.cmd == "generate" else []
        conn = make_connector(args)
        llm = make_llm(args, conn)
        if args.cmd == "chat":
            chat(llm, args)
            return 0
        if args.cmd == "serve":
            from tierkv.engine.serve.cli import run

            return run(args, llm, conn)
        outs = llm.generate(prompts, sampling(args), use_tqdm=False)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if conn is not None:
            conn.close()
    print_outputs(outs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
