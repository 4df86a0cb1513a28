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
from tierkv.engine.cli_args import LAYERED_KNOBS, build_parser
from tierkv.engine.config import RANDOM_CONFIGS
from tierkv.engine.llm import LLM
from tierkv.engine.models import pull
from tierkv.engine.outputs import RequestOutput
from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.tokenizer import Message
from tierkv.storage_backends.build import TiersConfig


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
        **{k: getattr(args, k) for k in LAYERED_KNOBS},
        enable_prefix_caching=not args.no_prefix_caching,
        cascade_attention=args.cascade_attention,
        eviction=args.eviction,
        blend_calibration=args.blend_calibration,
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
        blend_rule=getattr(args, "blend_rule", None),
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


def calibrate(args: argparse.Namespace) -> int:
    """Run calibrate-blend and print what it chose and where it wrote it."""
    from tierkv.connector import ConnectorConfig, TierKVConnector, TiersConfig
    from tierkv.engine.blend_calibrate import CalibrateConfig
    from tierkv.engine.blend_calibrate import calibrate as run

    cfg = CalibrateConfig(
        questions=args.questions,
        min_agreement=args.min_agreement,
        min_answer_agreement=args.min_answer_agreement,
        min_relative_accuracy=args.min_relative_accuracy,
        ratios=args.ratios,
        rules=args.rules,
        dtype=args.dtype,
        doc_tokens=args.doc_tokens,
        docs_per=args.docs_per,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )

    # the blends' segments, in a local cpu tier, stored on first sight: every trial must blend
    tiers = TiersConfig(cpu_bytes="1GiB")
    conn = TierKVConnector(ConnectorConfig(chunk_size=64, tiers=tiers, segment_admit_after=1))
    try:
        cal, path = run(args.model, cfg, conn, Path(args.out) if args.out else None)
    finally:
        conn.close()
    for t in cal.trials:
        print(
            f"{t.rule}@{t.ratio:g}: first token agrees {t.first_token_agreement:.0%}, "
            f"answer agrees {t.answer_agreement:.0%}, "
            f"accuracy {t.accuracy:.0%} of {t.questions} questions{' (met)' if t.met else ''}"
        )
    print(f"full prefill accuracy {cal.full_accuracy:.0%}; chosen: {cal.label}")
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    conn = None
    try:
        if args.cmd == "pull":
            print(pull(args.name, Path(args.dir) if args.dir else None))
            return 0
        if args.cmd == "calibrate-blend":
            return calibrate(args)
        prompts = prompts_of(args) if args.cmd == "generate" else []
        conn = make_connector(args)
        llm = make_llm(args, conn)
        if args.cmd == "chat":
            chat(llm, args)
            return 0
        if args.cmd == "serve":
            from tierkv.engine.serve.cli import run

            return run(args, llm, conn)
        for p in prompts:  # --doc files are the operator's own: stored at once, not on sight
            if isinstance(p, list) and p and isinstance(p[0], PromptPart) and llm.supports_segments:
                prefix, segs = llm.segments(p)  # type: ignore[arg-type]
                llm.ingest(segs, prefix)
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
