"""The fleet soak (`python -m bench.soak --fleet [--duration 120] [--quick]`): a fleet under load
while its processes fail. Two fleets of `tierkv-engine serve` replicas (a random tiny model,
fp32, greedy, a word per token), each behind vllm-router: two aggregated replicas over a
tierkv-server with Redis behind it, and a 1P1D pair over a server of its own. Clients send
prompts with shared prefixes to both routers the whole time; every answer is compared token by
token with the engine's own cold answer. Faults, in order: an aggregated replica SIGKILLed and
restarted, the prefill replica SIGKILLed and restarted, the aggregated fleet's server SIGKILLed
and restarted on its cache directory, Redis restarted. Reported: wrong answers, failed
requests by cause, the time back to speed after each fault, the peak RSS of every process.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from bench.common import goal, print_table, write_results
from tierkv.cacheserver.fleet import Fleet, FleetConfig, Proc, healthy
from tierkv.cacheserver.launch import RedisProcess, wait_port
from tierkv.engine import LLM, SamplingParams

NEW, BIN = 8, 1.0  # tokens per answer; seconds per throughput bin


def prompts(n: int) -> list[list[int]]:
    """n prompts over 4 shared 96-token prefixes, each with its own 8-token question."""
    rng = random.Random(0)
    heads = [[rng.randrange(4, 250) for _ in range(96)] for _ in range(4)]
    return [heads[i % 4] + [rng.randrange(4, 250) for _ in range(8)] for i in range(n)]


def checkpoint(path: Path) -> Path:
    """A tiny random Llama (seed 0) with a word-level tokenizer: token i is the word `wi`, so an
    answer's text names its token ids one to one."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def cold_answers(model: Path, pool: list[list[int]]) -> dict[tuple[int, ...], str]:
    llm = LLM(str(model), dtype="fp32", kv_cache_bytes=1 << 24, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(pool, params, use_tqdm=False)
    return {tuple(p): o.text for p, o in zip(pool, outs)}


def ask(url: str, prompt: list[int]) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0}
    body |= {"ignore_eos": True}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return str(json.loads(r.read())["choices"][0]["text"])


class Soak:
    def __init__(self, fleets: dict[str, Fleet], cold: dict[tuple[int, ...], str]) -> None:
        self.fleets, self.cold, self.pool = fleets, cold, list(cold)
        self.done: list[tuple[float, str]] = []  # (time, fleet) of each right answer
        self.wrong, self.failed = 0, Counter[str]()
        self.stop, self.t0 = threading.Event(), time.monotonic()
        self.rss: dict[str, int] = {}

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            name = rng.choice(list(self.fleets))
            prompt = list(rng.choice(self.pool))
            try:
                got = ask(self.fleets[name].url, prompt)
            except Exception as e:  # a request in flight on a killed process
                self.failed[f"{name}: {type(e).__name__}"] += 1
                time.sleep(0.2)
                continue
            if got != self.cold[tuple(prompt)]:
                self.wrong += 1
            self.done.append((time.monotonic() - self.t0, name))

    def sample_rss(self) -> None:
        while not self.stop.is_set():
            for name, f in self.fleets.items():
                for p in [f.router, *f.servers, *f.replicas]:
                    if p is not None and p.alive() and p.proc is not None:
                        try:
                            rss = psutil.Process(p.proc.pid).memory_info().rss
                        except psutil.Error:
                            continue
                        key = f"{name}/{p.name}"
                        self.rss[key] = max(self.rss.get(key, 0), rss)
            time.sleep(0.5)


def restart(p: Proc, log_dir: Path, down_s: float, health: bool = True) -> None:
    p.stop(kill=True)
    time.sleep(down_s)
    p.start(log_dir)
    if health:
        deadline = time.monotonic() + 60
        while not healthy(p.url) and time.monotonic() < deadline:
            time.sleep(0.2)
    else:
        wait_port(p.port, 60)


def back_to_speed(done: list[float], at: float, end: float, base: float) -> float | None:
    """Seconds after `at` (a restart) until a 1 s bin completes at least 80% of `base` answers/s."""
    t = at
    while t < end:
        if sum(1 for x in done if t <= x < t + BIN) >= 0.8 * base * BIN:
            return round(t - at, 2)
        t += BIN / 2
    return None


def run_fleet_soak(duration: float, quick: bool) -> None:
    logs = Path(tempfile.mkdtemp(prefix="bench-soak-fleet-"))
    pool = prompts(16 if quick else 48)
    model = checkpoint(logs / "model")
    cold = cold_answers(model, pool)
    base = {"model": str(model), "dtype": "fp32", "chunk_size": 16, "replica_cpu": "8MiB"}
    agg = Fleet(FleetConfig(policy="round_robin", redis=True, log_dir=logs / "agg", **base))
    pd = Fleet(FleetConfig(policy="round_robin", pd=True, log_dir=logs / "pd", **base))
    agg.start()
    pd.start()
    soak = Soak({"aggregated": agg, "1P1D": pd}, cold)
    threads = [threading.Thread(target=soak.client, args=(i,), daemon=True) for i in range(4)]
    threads.append(threading.Thread(target=soak.sample_rss, daemon=True))
    for t in threads:
        t.start()
    faults: list[dict[str, Any]] = []
    redis = agg.redis
    assert isinstance(redis, RedisProcess)
    schedule = [
        (
            0.15,
            "aggregated replica SIGKILLed",
            lambda: restart(agg.replicas[1], agg.cfg.log_dir, 3),
        ),
        (0.35, "prefill replica SIGKILLed", lambda: restart(pd.replicas[0], pd.cfg.log_dir, 3)),
        (0.55, "server SIGKILLed", lambda: restart(agg.servers[0], agg.cfg.log_dir, 1, False)),
        (0.75, "Redis restarted", redis.restart),
    ]
    try:
        for frac, what, act in schedule:
            time.sleep(max(0.0, soak.t0 + frac * duration - time.monotonic()))
            at = time.monotonic() - soak.t0
            act()  # returns once the process is back (healthy, or its port open)
            back = time.monotonic() - soak.t0
            faults.append({"fault": what, "at_s": round(at, 1), "restarted_s": round(back, 1)})
        time.sleep(max(0.0, soak.t0 + duration - time.monotonic()))
    finally:
        soak.stop.set()
        for t in threads:
            t.join(90)
        agg.stop()
        pd.stop()
    end = duration
    times = [t for t, _ in soak.done]
    before = [sum(1 for x in times if b <= x < b + BIN) for b in range(2, int(0.15 * end))]
    base_rate = statistics.median(before) / BIN if before else 0.0
    rows = []
    for f in faults:
        back = back_to_speed(times, f["restarted_s"], end, base_rate)
        rows.append({**f, "back_to_speed_s": back})
    rows.append({"fault": "answers right / wrong", "at_s": None, "back_to_speed_s": None,
                 "right": len(times), "wrong": soak.wrong})  # fmt: skip
    for cause, n in sorted(soak.failed.items()):
        rows.append({"fault": f"failed: {cause}", "at_s": None, "back_to_speed_s": None,
                     "right": None, "wrong": n})  # fmt: skip
    for name, rss in sorted(soak.rss.items()):
        rows.append({"fault": f"peak RSS {name} (MiB)", "at_s": None, "back_to_speed_s": None,
                     "right": round(rss / 2**20, 1), "wrong": None})  # fmt: skip
    print_table(rows, ["fault", "at_s", "restarted_s", "back_to_speed_s", "right", "wrong"])
    backs = [r["back_to_speed_s"] for r in rows[: len(faults)]]
    goals = [
        goal("wrong answers", soak.wrong, "<=", 0),
        goal(
            "slowest return to speed after a restart",
            max(1e9 if b is None else b for b in backs),
            "<=",
            5,
            "s",
        ),
    ]

    def plot(ax: Any) -> None:
        bins = range(int(end))
        ax.plot(list(bins), [sum(1 for x in times if b <= x < b + 1) for b in bins])
        for f in faults:
            ax.axvline(f["at_s"], color="r", lw=0.8)
        ax.set_xlabel("seconds")
        ax.set_ylabel("right answers per second")

    config = {"duration_s": duration, "clients": 4, "prompts": len(pool), "new_tokens": NEW,
              "fleets": "2 aggregated replicas + Redis; a 1P1D pair; vllm-router in front of each",
              "baseline_answers_s": base_rate}  # fmt: skip
    write_results("soak_fleet", config, rows, goals, plot)
