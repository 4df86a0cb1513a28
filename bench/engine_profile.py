"""Where tierkv's engine spends a step, per case of bench.engine --vs vllm (SmolLM2-135M-Instruct,
bf16): each case's requests run once untimed, then again under torch's profiler, and the ops'
own time is summed by kind. "outside ops" is the wall time no op accounts for: Python in the
model, runner, scheduler and sampler (the profiler's own cost per op lands here too). The
single-request decode runs twice: with each layer in one op call (the engine's default) and
with the Python loop over the ops (`fused_decode` off), the baseline; its outside-ops time per
decode step is the goal's "Python per decode step".

    python -m bench.engine_profile [--quick]
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import goal, parser, print_table, write_results
from bench.engine_cases import FULL, QUICK, chat, ids
from bench.step_python import MODES, measure, mode

# op name fragment -> kind; the first match wins
KINDS = (
    ("gemv_bf16", "linear"),
    ("aten::mm", "linear"),
    ("aten::addmm", "linear"),
    ("paged_decode", "attention"),  # the cascade kernel's name too
    ("prefill_attention", "attention"),
    ("scaled_dot_product", "attention"),
    ("index_select", "attention"),
    ("rms_norm", "norm, silu, rope, kv write"),
    ("silu_mul", "norm, silu, rope, kv write"),
    ("tierkv::rope", "norm, silu, rope, kv write"),
    ("write_kv", "norm, silu, rope, kv write"),
    ("aten::add", "residual adds"),
    ("argmax", "lm_head and sampling"),
)


class Local:
    """The engine in this process, answering like bench.engine_worker's TierKV."""

    system = "tierkv"

    def __init__(self, model: str) -> None:
        from bench.engine_worker import TierKV

        self.engine = TierKV(model)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
        return self.engine.generate(prompts, max_tokens)


def cases(c: dict[str, Any]) -> dict[str, tuple[list[list[int]], list[int]]]:
    r = random.Random(7)
    system = ids(r, c.system)
    users = [ids(r, r.randint(*c.user)) for _ in range(c.shared)]
    return {
        "throughput": (
            [ids(r, r.randint(*c.prompt)) for _ in range(c.requests)],
            [r.randint(*c.output) for _ in range(c.requests)],
        ),
        "shared_prefix": ([system + u for u in users], [c.shared_output] * len(users)),
        "decode": ([ids(r, c.decode_prompt)], [c.decode_output]),
    }


def profiled(job: Callable[[], object]) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        job()
        wall = time.perf_counter() - t0
    kinds: dict[str, float] = {}
    for ev in prof.key_averages():
        kind = next((k for frag, k in KINDS if frag in ev.key), "other ops")
        kinds[kind] = kinds.get(kind, 0.0) + ev.self_cpu_time_total / 1e6
    kinds["outside ops"] = wall - sum(kinds.values())
    return {"wall_s": wall, **kinds}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="unprofiled decode rounds per mode")
    args = p.parse_args()
    from bench.serve_vllm import hf_checkpoint
    from tierkv.engine.models import cache_dir

    c = QUICK if args.quick else FULL
    eng = Local(str(hf_checkpoint(cache_dir() / "smollm2-hf")))
    rows: list[dict[str, Any]] = []
    jobs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        name: (  # (untimed: the same shapes, other tokens; profiled)
            lambda p=prompts, o=outs: eng.generate([[x[0] + 1] + x[1:] for x in p], o),
            lambda p=prompts, o=outs: eng.generate(p, o),
        )
        for name, (prompts, outs) in cases(c).items()
    }
    jobs["chat"] = (lambda: chat(eng, c, 1), lambda: chat(eng, c, 0))
    decode = jobs.pop("decode")
    for m in MODES:
        jobs[f"decode, {m}"] = decode
    runner = eng.engine.llm.runner
    for name, (warm, job) in jobs.items():
        with mode(runner, name.removeprefix("decode, ") if name.startswith("decode") else MODES[0]):
            warm()
            prof = profiled(job)
        wall = prof.pop("wall_s")
        for kind, sec in sorted(prof.items(), key=lambda kv: -kv[1]):
            rows.append(dict(case=name, kind=kind, seconds=sec, share_pct=100 * sec / wall))
        rows.append(dict(case=name, kind="wall", seconds=wall, share_pct=100.0))
    print_table(rows)
    steps = c.decode_output - 1  # the first token comes from the prefill step
    per_step = measure(runner, decode[1], steps, args.rounds)
    for r in per_step:
        out = next(
            x for x in rows if x["case"] == f"decode, {r['mode']}" and x["kind"] == "outside ops"
        )
        r["outside_ops_ms_per_step"] = out["seconds"] / steps * 1e3
    print_table(per_step)
    one = per_step[0]
    goals = [
        goal(
            "Python per single-request decode step (cProfile)",
            one["python_ms_per_step"],
            "<=",
            1.5,
            "ms",
        ),
        goal(
            "the same, by the profiler's outside-ops time",
            one["outside_ops_ms_per_step"],
            "<=",
            1.5,
            "ms",
        ),
    ]

    def plot(ax: Any) -> None:
        names = list(dict.fromkeys(r["case"] for r in rows))
        kinds = list(dict.fromkeys(r["kind"] for r in rows if r["kind"] != "wall"))
        bottom = [0.0] * len(names)
        for kind in kinds:
            vals: list[float] = [
                next((r["share_pct"] for r in rows if r["case"] == n and r["kind"] == kind), 0.0)
                for n in names
            ]
            ax.bar(names, vals, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("% of wall time")
        ax.legend(fontsize=7)

    config = dict(
        asdict(c),
        quick=args.quick,
        threads=torch.get_num_threads(),
        rounds=args.rounds,
        decode_steps=per_step,
    )
    write_results("engine_profile", config, rows, goals, plot)


if __name__ == "__main__":
    main()
