"""Undeclared parts: documents blended with no declared prefix (`python -m bench.blend_encoding`).

SmolLM2-135M-Instruct in fp32; 4 pydoc pages of about 200 tokens (real text that ships with
Python), in 8 seeded shuffled orders over 4 questions, given as parts with no declared prefix,
as a new user would. Each page's KV is stored standalone (blend_encoding="standalone", the
default: its first token an attention sink) or after the chat preamble ("preamble"). Two prompt
shapes: "chat" (the chat template's head, computed every time, then the pages and the question)
and "bare" (the pages first). Per encoding, shape and rule (ratio 0, CacheBlend at 0.15, and
the model's calibrated rule when calibrate-blend has run, the goals' rule; else CacheBlend at
0.15 is): the KL of the first token's
distribution against full prefill of the same tokens, its ratio to ratio 0's, and the first
greedy token (of 64) that differs from full prefill's. Baseline: full prefill, same run.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from tqdm import tqdm

from bench.blend_task import calibrated
from bench.common import goal, parser, print_table, write_results
from bench.record import FirstLogits, first_diff, kl
from examples.rag_docs import cut, module_doc
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, PromptPart, SamplingParams
from tierkv.engine.encoding import preamble
from tierkv.engine.models import pull
from tierkv.storage_backends.build import TiersConfig

MODULES = ["zlib", "colorsys", "textwrap", "uuid"]
QUESTIONS = [
    "What does zlib.crc32 compute?",
    "Which color systems does colorsys convert between?",
    "What is the default width of textwrap.TextWrapper?",
    "Which RFC do the uuid objects follow?",
]
TOKENS = 64  # greedy tokens compared: room for a divergence 3x later than ratio 0's


def run(orders: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    path = str(pull("smollm2", progress=False))
    cold = LLM(path, dtype="fp32", kv_cache_bytes=64 << 20, enable_prefix_caching=False)
    tok = cold.tokenizer
    full = FirstLogits(cold)
    assert tok is not None
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    docs = [enc(cut(module_doc(m), lambda s: len(enc(s)), 200) + "\n\n") for m in MODULES]
    head = list(preamble(tok))  # the chat template's head (the "preamble" encoding's too)
    rng = random.Random(0)
    cases = [(q, rng.sample(range(len(docs)), len(docs))) for q in QUESTIONS for _ in range(orders)]
    tails = {q: enc(f"Question: {q}<|im_end|>\n<|im_start|>assistant\n") for q in QUESTIONS}
    chosen = calibrated()
    rules: list[tuple[str, float]] = [("cacheblend", 0.0), ("cacheblend", 0.15)]
    rules += [chosen] if chosen and chosen not in rules else []
    greedy: dict[str, Any] = dict(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    per: dict[tuple[str, str, str, float], list[tuple[float, int]]] = {}
    bar = tqdm(total=2 * 2 * len(cases) * (1 + len(rules)), desc="undeclared parts")
    for encoding in ("standalone", "preamble"):
        tiers = TiersConfig(cpu_bytes="256MiB")
        conn = TierKVConnector(ConnectorConfig(tiers=tiers, segment_admit_after=1))
        llm = LLM(
            path,
            dtype="fp32",
            kv_cache_bytes=64 << 20,
            enable_prefix_caching=False,
            kv_connector=conn,
            blend_encoding=encoding,
            blend_calibration="off",
        )
        blend = FirstLogits(llm)
        for shape in ("chat", "bare"):
            for q, order in cases:
                lead = head if shape == "chat" else []
                flat = lead + sum((docs[i] for i in order), []) + tails[q]
                ref, ref_logits = full.run(flat, SamplingParams(**greedy))
                bar.update()
                parts = [PromptPart(lead, reusable=False)] if lead else []
                parts += [PromptPart(docs[i]) for i in order]
                parts += [PromptPart(tails[q], reusable=False)]
                for rule, ratio in rules:
                    sp = SamplingParams(**greedy, blend_ratio=ratio, blend_rule=rule)
                    got, logits = blend.run(parts, sp)
                    key = (shape, encoding, rule, ratio)
                    div = first_diff(got.token_ids, ref.token_ids)
                    per.setdefault(key, []).append((kl(ref_logits, logits), div))
                    bar.update()
        conn.close()
    bar.close()
    rows = []
    for (shape, encoding, rule, ratio), vals in per.items():
        zero = statistics.mean(k for k, _ in per[shape, encoding, "cacheblend", 0.0])
        zero_div = statistics.mean(d for _, d in per[shape, encoding, "cacheblend", 0.0])
        mean_kl = statistics.mean(k for k, _ in vals)
        div = statistics.mean(d for _, d in vals)
        rows.append(
            {
                "prompt": shape,
                "encoding": encoding,
                "rule": f"{rule}@{ratio:g}",
                "kl": mean_kl,
                "kl_vs_ratio0": mean_kl / zero if zero else None,
                "first_diff": div,
                "first_diff_vs_ratio0": div / zero_div if zero_div else None,
                "goal": (rule, ratio) == (chosen or ("cacheblend", 0.15)),
            }
        )
    config = {"model": "smollm2 fp32", "pages": MODULES, "page_tokens": [len(d) for d in docs]}
    config |= {"preamble_tokens": len(head), "questions": len(cases), "greedy_tokens": TOKENS}
    config |= {"calibrated": list(chosen) if chosen else None}
    return rows, config


def plot(ax: Any, rows: list[dict[str, Any]]) -> None:
    """KL over ratio 0's per rule, one bar group per prompt shape and encoding."""
    groups = list(dict.fromkeys((r["prompt"], r["encoding"]) for r in rows))
    names = list(dict.fromkeys(r["rule"] for r in rows))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ys = [
            next(
                (r["kl"] for r in rows if (r["prompt"], r["encoding"], r["rule"]) == (*g, name)), 0
            )
            for g in groups
        ]
        ax.bar([i + j * width for i in range(len(groups))], ys, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{s}\n{e}" for s, e in groups])
    ax.set_ylabel("KL(full || blend), first token")
    ax.legend(fontsize=8)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--orders", type=int, default=2, help="shuffled orders per question")
    args = p.parse_args()
    rows, config = run(1 if args.quick else args.orders)
    print_table(rows)
    goals = []
    for r in rows:
        if r["goal"] and r["encoding"] == "standalone" and r["prompt"] == "chat":
            goals.append(goal(f"{r['rule']}: KL / ratio 0's", r["kl_vs_ratio0"], "<=", 0.3))
            div = r["first_diff_vs_ratio0"]
            goals.append(goal(f"{r['rule']}: first divergence / ratio 0's", div, ">=", 3.0))
    write_results("blend_encoding", config, rows, goals, lambda ax: plot(ax, rows))


if __name__ == "__main__":
    main()
