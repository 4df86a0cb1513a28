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
the first) that start warm (the system prompt in the blocks or the cpu tier). For reference,
vLLM's prefix caching runs the same workflows with the engine blocks' KV bytes and nothing
below them (bench/workflow_vllm.py; --no-vllm skips it).

--slow none drops the disk tier (what the cpu tier evicts is recomputed; results in
bench/results/workflow_recompute.json).

    python -m bench.workflow [--quick] [--concurrent 8] [--slow disk|none]
"""

from __future__ import annotations

import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import workflow_vllm
from bench.common import parser, print_table, write_results
from bench.models import bench_model
from bench.serve_vllm import hf_checkpoint
from bench.workflow_load import AGENTS, CHUNK, chat_ids, next_use, plan, system_prompt
from bench.workflow_report import SYSTEMS, config, goals, plotter, summarize
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams
from tierkv.engine.gguf_loader import load_tokenizer
from tierkv.engine.models import cache_dir, pull
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.hints import MAX_STEPS, KVHint


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
    found = {k: sum(r[k] for r in recs) for k in ("cpu", "disk")}
    block_prefetched = sum(llm.block_prefetch.stats.loaded_tokens.values())
    return dict(
        **summarize(recs, wall),
        loaded_mb=(found["cpu"] + found["disk"]) * MODEL.kv_bytes(1) / 1e6,
        prefetched_mb=(conn.store.prefetcher.stats.moved - moved0) * MODEL.kv_bytes(CHUNK) / 1e6,
        block_prefetched_mb=(block_prefetched - bp0) * MODEL.kv_bytes(1) / 1e6,
    )


def run_vllm(mem: dict[str, int], n_wf: int, prompts: dict[str, list[int]], args: Any) -> dict:
    """The same workflows on vLLM's prefix caching with the engine blocks' KV bytes."""
    plans = [plan(w, TASKS) for w in range(n_wf)]
    steps = [
        [(a, prompts[a] + turn(f"Workflow {w}, step {i}: your turn.")) for i, a in enumerate(p)]
        for w, p in enumerate(plans)
    ]
    job = dict(
        model=str(HF),
        kv_bytes=mem["kv_bytes"],
        kv_per_token=MODEL.kv_bytes(1),
        max_model_len=max(len(ids) for s in steps for _, ids in s) + args.max_tokens + 64,
        max_tokens=args.max_tokens,
        warm=[prompts[a] + TURN for a in AGENTS],
        steps=steps,
    )
    out = workflow_vllm.run(job, Path(tempfile.gettempdir()) / "tierkv-workflow-vllm.log")
    recs = out["records"]
    for r in recs:
        r.update(cpu=0, disk=0, warm=r["engine"] >= len(prompts[r["agent"]]) // CHUNK * CHUNK)
    return dict(
        **summarize(recs, out["time_s"]), loaded_mb=0.0, prefetched_mb=0.0, block_prefetched_mb=0.0
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
    global MODEL, TOK, TURN, TASKS, HF
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--concurrent", type=int, default=0, help="workflows at once (8; --quick 2)")
    p.add_argument(
        "--slow",
        choices=("disk", "none"),
        default="disk",
        help="below the cpu tier: a disk tier holding every prompt, or none (recomputed)",
    )
    p.add_argument("--max-tokens", type=int, default=0, help="answer tokens (12; --quick 6)")
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip vLLM's column")
    args = p.parse_args()
    args.concurrent = args.concurrent or (2 if args.quick else 8)
    args.max_tokens = args.max_tokens or (6 if args.quick else 12)
    MODEL, TOK = bench_model("smollm2"), load_tokenizer(pull("smollm2"))
    HF = hf_checkpoint(cache_dir() / "smollm2-hf") if args.vllm else None
    words, TASKS = (250, 1) if args.quick else (750, 2)
    prompts = {a: chat_ids(TOK, system_prompt(a, words)) for a in AGENTS}
    TURN = turn("Warm-up.")
    plen = max(len(v) for v in prompts.values())
    rows, cases = [], [(m, n) for m in ("tight", "loose") for n in (1, args.concurrent)]
    bar = tqdm(total=len(cases) * (len(SYSTEMS) + args.vllm), desc="workflow")
    for mem_name, n_wf in cases:
        mem = memory(plen, n_wf)[mem_name]
        for system in SYSTEMS + (("vllm",) if args.vllm else ()):
            run = run_vllm if system == "vllm" else partial(run_case, system)
            r = run(mem, n_wf, prompts, args)
            rows.append(dict(memory=mem_name, workflows=n_wf, system=system, **r))
            bar.update(1)
    bar.close()
    print_table(rows)
    name = "workflow" if args.slow == "disk" else "workflow_recompute"
    write_results(
        name, config(args, plen, CHUNK, AGENTS), rows, goals(rows, args.concurrent), plotter(rows)
    )


def turn(text: str) -> list[int]:
    """A user message and the assistant's cue, as the chat template renders them."""
    return TOK.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", False)


MODEL: Any = None
HF: Any = None  # SmolLM2 as an HF checkpoint, vLLM's
TOK: Any = None
TURN: list[int] = []
TASKS = 2

if __name__ == "__main__":
    main()
