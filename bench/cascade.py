"""Cascade attention: what reading shared prefix blocks once buys (`python -m bench.cascade`).

(a) The decode kernel alone: S sequences sharing P prefix keys plus a suffix of their own, one
layer's call on SmolLM2's head shapes (9 query heads, 3 KV heads, head dim 64, bf16 cache),
cascade (torch.ops.tierkv.paged_decode_cascade) against the plain paged decode on the same
inputs, alternating, medians of the per-round ratios.
(b) The engine: 32 requests sharing a 1K-token prompt prefix (bench.engine_cases' shared-prefix
case), SmolLM2-135M-Instruct in bf16, cascade_attention on against off, rounds alternating who
goes first; wall time and decode ms per token.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch
from tqdm import tqdm

from bench.common import goal, parser, print_table, write_results
from tierkv.engine import LLM, SamplingParams
from tierkv.engine.models import pull
from tierkv.kernels import cpu
from tierkv.kernels.args import LayerCache

HQ, HKV, D, BS = 9, 3, 64, 16


def kernel_case(seqs: int, shared: int, suffix: int, rounds: int) -> dict[str, Any]:
    blocks_shared = shared // BS
    per = -(-suffix // BS)
    nb = blocks_shared + seqs * per + 1
    k = torch.randn(nb, BS, HKV, D).to(torch.bfloat16)
    v = torch.randn(nb, BS, HKV, D).to(torch.bfloat16)
    cache = LayerCache(k, v)
    ids = torch.zeros(seqs, blocks_shared + per, dtype=torch.int64)
    for s in range(seqs):
        ids[s, :blocks_shared] = torch.arange(blocks_shared)
        ids[s, blocks_shared:] = torch.arange(per) + blocks_shared + s * per
    seen = torch.full((seqs,), shared + suffix, dtype=torch.int64)
    q = torch.randn(seqs, HQ, D).to(torch.bfloat16)
    groups = (
        torch.arange(seqs, dtype=torch.int64),
        torch.tensor([0, seqs], dtype=torch.int64),
        torch.tensor([shared], dtype=torch.int64),
    )
    scale = D**-0.5
    plain = lambda: cpu.paged_decode(q, cache, ids, seen, scale)
    casc = lambda: cpu.paged_decode_cascade(q, cache, ids, seen, scale, groups)
    torch.testing.assert_close(casc().float(), plain().float(), atol=2e-2, rtol=2e-2)
    times: dict[str, list[float]] = {"plain": [], "cascade": []}
    for r in range(rounds):
        for name, f in (("plain", plain), ("cascade", casc))[:: 1 if r % 2 else -1]:
            t0 = time.perf_counter()
            for _ in range(20):
                f()
            times[name].append((time.perf_counter() - t0) / 20 * 1e6)
    ratios = [p / c for p, c in zip(times["plain"], times["cascade"])]
    return {
        "case": f"kernel, {seqs} x ({shared} shared + {suffix})",
        "plain": statistics.median(times["plain"]),
        "cascade": statistics.median(times["cascade"]),
        "unit": "us per layer call",
        "speedup": statistics.median(ratios),
    }


def engine_case(rounds: int, bar: tqdm) -> list[dict[str, Any]]:
    path = str(pull("smollm2", progress=False))
    llms = {
        on: LLM(path, dtype="bf16", kv_cache_bytes=1 << 30, cascade_attention=on)
        for on in (False, True)
    }
    rows: dict[bool, list[float]] = {False: [], True: []}
    tpot: dict[bool, list[float]] = {False: [], True: []}
    for rnd in range(rounds):
        r = random.Random(rnd)
        system = [r.randrange(100, 40000) for _ in range(1024)]
        prompts = [system + [r.randrange(100, 40000) for _ in range(64)] for _ in range(32)]
        sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        outs = {}
        for on in (False, True)[:: 1 if rnd % 2 else -1]:
            llm = llms[on]
            t0 = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            rows[on].append(time.perf_counter() - t0)
            tpot[on].append(statistics.median(x.metrics.decode_time / 63 for x in res) * 1e3)
            outs[on] = [x.token_ids for x in res]
            bar.update()
        same = sum(a == b for a, b in zip(outs[False], outs[True]))
        print(f"round {rnd}: bf16 greedy tokens equal with cascade on/off in {same}/32")
    ratios = [a / b for a, b in zip(rows[False], rows[True])]
    return [
        {
            "case": "engine, 32 requests sharing 1K, 64 tokens each",
            "plain": statistics.median(rows[False]),
            "cascade": statistics.median(rows[True]),
            "unit": "s",
            "speedup": statistics.median(ratios),
        },
        {
            "case": "engine, decode ms per token (median request)",
            "plain": statistics.median(tpot[False]),
            "cascade": statistics.median(tpot[True]),
            "unit": "ms",
            "speedup": statistics.median(a / b for a, b in zip(tpot[False], tpot[True])),
        },
    ]


def main() -> None:
    args = parser(__doc__).parse_args()
    if not cpu.load():
        raise SystemExit("bench.cascade needs the C++ CPU kernels (make setup builds them)")
    torch.manual_seed(0)
    rounds = 3 if args.quick else 7
    shapes = [(32, 1024, 48), (32, 4096, 48), (8, 1024, 48)]
    rows = []
    with tqdm(total=len(shapes) + 2 * (1 if args.quick else 3), desc="cascade") as bar:
        for s in shapes:
            rows.append(kernel_case(*s, rounds))
            bar.update()
        rows += engine_case(1 if args.quick else 3, bar)
    print_table(rows)
    goals = [goal("engine shared-prefix time, off / on", rows[-2]["speedup"], ">=", 1.0, "x")]

    def plot(ax: Any) -> None:
        ax.barh([r["case"] for r in rows], [r["speedup"] for r in rows])
        ax.axvline(1.0, color="k", linestyle="--")
        ax.set_xlabel("speedup of cascade over the plain decode (median of round ratios)")

    write_results("cascade", {"rounds": rounds, "shapes": shapes}, rows, goals, plot)


if __name__ == "__main__":
    main()
