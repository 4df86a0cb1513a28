"""bench.workflow: multi-agent workflows (KVFlow) on SmolLM2-135M-Instruct, bf16, greedy.

Five agents, each with a fixed system prompt of ~1.2K tokens (--quick: ~400), run in an order
the application knows: a planner, then coder and tester in a loop (one or two rounds), a branch
(the tester once more, or not), a reviewer and a writer; each workflow runs two such tasks.
Short user turns, short answers. Systems side by side, each on a fresh engine and connector:

  lru             the engine's and the connector's tiers evict by recency, no hints
  hints           kv_hints on every request: eviction by next use in the engine's prefix cache
                  and the connector's tiers (eviction="hinted"), no prefetch
  hints+prefetch  the same, and each step prefetches the next step's agents' prompts (into
                  the cpu tier, then into free engine blocks: block prefetch)

The KV lives in the engine's blocks, the connector's cpu tier and, below them, its disk tier
(which holds everything). Memory "tight": the blocks hold ~2.5 agents' prompts and the cpu tier
~3 (of 5); "loose": both hold all. Before timing, each agent runs once (untimed) so the disk
tier holds every prompt: the steady state of an agent service. Measured: end-to-end time of
all workflows (makespan), median TTFT per step, the share of prompt tokens found in the engine's
prefix cache (block-prefetched blocks included), the cpu tier, the disk tier or recomputed,
bytes loaded, prefetched and block-prefetched, and the share of warned steps (every step after
the first) that start warm (the system prompt in the blocks or the cpu tier). vLLM's prefix
caching is not in this bench.

--slow none drops the disk tier (what the cpu tier evicts is recomputed; results in
bench/results/workflow_recompute.json).

    python -m bench.workflow [--quick] [--concurrent 8] [--slow disk|none]
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from typing import Any

from tqdm import tqdm

from bench.common import parser, print_table, write_results
from bench.models import bench_model
from bench.workflow_report import SYSTEMS, config, goals, plotter
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams
from tierkv.engine.gguf_loader import load_tokenizer
from tierkv.engine.models import pull
from tierkv.engine.tokenizer import Tokenizer
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.hints import MAX_STEPS, KVHint

AGENTS = ("planner", "coder", "tester", "reviewer", "writer")
CHUNK = 64  # the connector's chunk tokens: a step's turn spoils one chunk only
WORDS = (
    "module interface contract test branch merge review latency cache token budget schema "
    "parser service queue retry timeout index shard replica rollback deploy metric trace span "
    "patch diff commit release owner ticket sprint design spec input output error log config"
).split()


def system_prompt(agent: str, words: int) -> str:
    """A distinct, deterministic system prompt of about words words."""
    rng = random.Random(agent)
    rules = []
    for i in range(words // 12):
        body = " ".join(rng.choice(WORDS) for _ in range(9))
        rules.append(f"Rule {i + 1} for the {agent}: {body}.")
    return f"You are the {agent} of a software team. " + " ".join(rules)


def plan(wf: int, tasks: int = 2) -> list[str]:
    """A workflow's steps: tasks, each a loop of coder and tester and a branch."""
    rng, steps = random.Random(wf), []
    for _ in range(tasks):
        steps.append("planner")
        for _ in range(rng.randint(1, 2)):
            steps += ["coder", "tester"]
        if rng.random() < 0.5:  # the branch: the tester checks the fix once more
            steps.append("tester")
        steps += ["reviewer", "writer"]
    return steps


def next_use(steps: list[str], i: int) -> dict[str, int]:
    """What the application knows at step i: the steps until each agent runs next."""
    out: dict[str, int] = {}
    for j in range(i, len(steps)):
        out.setdefault(steps[j], j - i)
    return out


def build(system: str, mem: dict[str, int], tmp: str | None) -> tuple[LLM, TierKVConnector]:
    """tmp None: no disk tier (what the cpu tier evicts is recomputed when needed again)."""
    hinted = "lru" if system == "lru" else "hinted"
    tiers = TiersConfig(
        cpu_bytes=mem["cpu_bytes"], disk_dir=tmp, disk_bytes="8GiB", eviction=hinted
    )
    conn = TierKVConnector(ConnectorConfig(chunk_size=CHUNK, tiers=tiers))
    llm = LLM(
        str(MODEL.source),
        dtype="bf16",
        kv_cache_bytes=mem["kv_bytes"],
        kv_connector=conn,
        eviction=hinted,
        workflow_prefetch=system == "hints+prefetch",
    )
    return llm, conn


def run_case(
    system: str, mem: dict[str, int], n_wf: int, prompts: dict[str, list[int]], args: Any
) -> dict[str, Any]:
    """n_wf workflows at once; each submits its next step when its last one ends."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        llm, conn = build(system, mem, tmp if args.slow == "disk" else None)
        try:
            for a in AGENTS:  # each prompt once, untimed: the disk tier holds them all
                hint = None if system == "lru" else KVHint("warm-up", a, {a: MAX_STEPS})
                llm.generate([prompts[a] + TURN], params, use_tqdm=False, kv_hints=hint)
            llm.drain_saves()
            conn.flush()
            return drive(llm, conn, system, n_wf, prompts, params)
        finally:
            conn.close()


def drive(
    llm: LLM,
    conn: TierKVConnector,
    system: str,
    n_wf: int,
    prompts: dict[str, list[int]],
    params: SamplingParams,
) -> dict[str, Any]:
    plans = [plan(w, TASKS) for w in range(n_wf)]
    at, live, recs = [0] * n_wf, {}, []
    moved0 = conn.store.prefetcher.stats.moved
    bp0 = sum(llm.block_prefetch.stats.loaded_tokens.values())

    def submit(w: int) -> None:
        i, agent = at[w], plans[w][at[w]]
        ids = prompts[agent] + turn(f"Workflow {w}, step {i}: your turn.")
        hint = None if system == "lru" else KVHint(f"w{w}", agent, next_use(plans[w], i))
        live[llm.add_request(None, ids, params, hint).request_id] = (w, agent)

    t0 = time.perf_counter()
    for w in range(n_wf):
        submit(w)
    while live:
        for req in llm.step():
            if not req.finished:
                continue
            w, agent = live.pop(req.request_id)
            m = llm.output(req).metrics
            loaded = dict((m.connector or {}).get("loaded_tokens", {}))
            sys_len = len(prompts[agent]) // CHUNK * CHUNK
            recs.append(
                dict(
                    step=at[w],
                    agent=agent,
                    ttft=m.ttft,
                    prompt=m.prompt_tokens,
                    engine=m.cached_tokens,
                    cpu=loaded.get("cpu", 0),
                    disk=loaded.get("disk", 0),
                    warm=m.cached_tokens + loaded.get("cpu", 0) >= sys_len,
                )
            )
            at[w] += 1
            if at[w] < len(plans[w]):
                submit(w)
    wall = time.perf_counter() - t0
    llm.drain_saves()
    prompt = sum(r["prompt"] for r in recs)
    found = {k: sum(r[k] for r in recs) for k in ("engine", "cpu", "disk")}
    warned = [r["warm"] for r in recs if r["step"] > 0]
    block_prefetched = sum(llm.block_prefetch.stats.loaded_tokens.values())
    return dict(
        time_s=wall,
        ttft_ms=1000 * statistics.median(r["ttft"] for r in recs),
        steps=len(recs),
        engine_pct=100 * found["engine"] / prompt,
        cpu_pct=100 * found["cpu"] / prompt,
        disk_pct=100 * found["disk"] / prompt,
        computed_pct=100 * (prompt - sum(found.values())) / prompt,
        loaded_mb=(found["cpu"] + found["disk"]) * MODEL.kv_bytes(1) / 1e6,
        prefetched_mb=(conn.store.prefetcher.stats.moved - moved0) * MODEL.kv_bytes(CHUNK) / 1e6,
        warm_pct=100 * sum(warned) / max(1, len(warned)),
        block_prefetched_mb=(block_prefetched - bp0) * MODEL.kv_bytes(1) / 1e6,
    )


def memory(prompt_tokens: int, n_wf: int) -> dict[str, dict[str, int]]:
    """KV bytes of the engine's blocks and the cpu tier, tight and loose."""
    kv = MODEL.kv_bytes(1)
    run = n_wf * 64 * kv  # the running requests' turns and answers
    return {
        "tight": dict(
            kv_bytes=int(2.5 * prompt_tokens * kv) + run, cpu_bytes=int(3.0 * prompt_tokens * kv)
        ),
        "loose": dict(
            kv_bytes=int(6 * prompt_tokens * kv) + 2 * run, cpu_bytes=int(7 * prompt_tokens * kv)
        ),
    }


def main() -> None:
    global MODEL, TOK, TURN, TASKS
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--concurrent", type=int, default=0, help="workflows at once (8; --quick 2)")
    p.add_argument(
        "--slow",
        choices=("disk", "none"),
        default="disk",
        help="below the cpu tier: a disk tier holding every prompt, or none (recomputed)",
    )
    p.add_argument("--max-tokens", type=int, default=0, help="answer tokens (12; --quick 6)")
    args = p.parse_args()
    args.concurrent = args.concurrent or (2 if args.quick else 8)
    args.max_tokens = args.max_tokens or (6 if args.quick else 12)
    MODEL, TOK = bench_model("smollm2"), load_tokenizer(pull("smollm2"))
    words, TASKS = (250, 1) if args.quick else (750, 2)
    prompts = {a: chat_ids(TOK, system_prompt(a, words)) for a in AGENTS}
    TURN = turn("Warm-up.")
    plen = max(len(v) for v in prompts.values())
    rows, cases = [], [(m, n) for m in ("tight", "loose") for n in (1, args.concurrent)]
    bar = tqdm(total=len(cases) * len(SYSTEMS), desc="workflow")
    for mem_name, n_wf in cases:
        mem = memory(plen, n_wf)[mem_name]
        for system in SYSTEMS:
            r = run_case(system, mem, n_wf, prompts, args)
            rows.append(dict(memory=mem_name, workflows=n_wf, system=system, **r))
            bar.update(1)
    bar.close()
    print_table(rows)
    name = "workflow" if args.slow == "disk" else "workflow_recompute"
    write_results(
        name, config(args, plen, CHUNK, AGENTS), rows, goals(rows, args.concurrent), plotter(rows)
    )


def chat_ids(tok: Tokenizer, system: str) -> list[int]:
    """The system message as the chat template renders it: every step's prompt starts so."""
    text = tok.apply_chat_template([{"role": "system", "content": system}], False)
    return tok.encode(text, add_special_tokens=False)


def turn(text: str) -> list[int]:
    """A user message and the assistant's cue, as the chat template renders them."""
    return TOK.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", False)


MODEL: Any = None
TOK: Any = None
TURN: list[int] = []
TASKS = 2

if __name__ == "__main__":
    main()
