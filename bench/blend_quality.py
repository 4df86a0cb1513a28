"""CacheBlend's quality on a trained model (`python -m bench.blend --model smollm2`).

SmolLM2-135M-Instruct answers questions about Python standard-library modules from their
pydoc pages (real text that ships with Python), 2, 4, 6 or 8 pages per question, shuffled,
after a shared system prompt (declared the prefix: the pages' KV is computed after it).
For each blend ratio, and for other selection rules at 0.15, against full prefill:
the KL of the next-token distribution, top-1 agreement of the first token, exact agreement
of the first 32 greedy tokens, the mean position of the first differing token, and TTFT.
"""

from __future__ import annotations

import pydoc
import random
import re
import statistics
from typing import Any

from tqdm import tqdm

from bench.models import bench_model
from bench.record import FirstLogits, first_diff, kl
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, PromptPart, SamplingParams, gguf_loader
from tierkv.engine.models import pull
from tierkv.storage_backends.build import TiersConfig

MODULES = ["json", "shutil", "heapq", "bisect", "textwrap", "fractions", "statistics", "secrets"]
MODULES += ["base64", "fnmatch", "glob", "difflib", "zlib", "calendar", "colorsys", "uuid"]
SYSTEM = (
    "<|im_start|>system\nYou answer questions about Python's standard library, using only the "
    "documentation given by the user.<|im_end|>\n<|im_start|>user\n"
)
RATIOS = [0.0, 0.05, 0.15, 0.3, 0.5, 1.0]
# (metric, check layer, gradual layers) at 0.15; gradual: CacheBlend's gradual filtering, 2x the
# ratio picked at the check layer, narrowed by K deviation over the next layers
# (engine/blend_forward.py)
RULES = [("k", 1, 0), ("random", 1, 0), ("v", 1, 0), ("k", 2, 0), ("k", 3, 0)]
RULES += [("k", 1, 2), ("k", 1, 4), ("v", 1, 4)]


def pages(tokenizer: Any, tokens: int) -> dict[str, list[int]]:
    """Each module's pydoc page, as plain text, cut at a line end near `tokens` tokens."""
    out = {}
    for name in MODULES:
        text = re.sub(".\b", "", pydoc.render_doc(name, renderer=pydoc.plaintext))
        ids: list[int] = []
        for line in text.splitlines(keepends=True):
            more = tokenizer.encode(line, add_special_tokens=False)
            if len(ids) + len(more) > tokens:
                break
            ids += more
        out[name] = ids + tokenizer.encode("\n\n", add_special_tokens=False)
    return out


def functions(module: str) -> list[str]:
    mod = __import__(module)
    return [n for n in dir(mod) if not n.startswith("_") and callable(getattr(mod, n))][:12]


def questions(count: int, ndocs: list[int], seed: int = 7) -> list[tuple[list[str], str]]:
    """(modules in prompt order, question) with the asked-about module among them."""
    rng, out = random.Random(seed), []
    for i in range(count):
        mods = rng.sample(MODULES, ndocs[i % len(ndocs)])
        about = rng.choice(mods)
        fn = rng.choice(functions(about))
        out.append((mods, f"What does {about}.{fn} do? Answer in one sentence."))
    return out


def run(quick: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    model = bench_model("smollm2")
    tok = gguf_loader.load_tokenizer(pull("smollm2"))
    docs = pages(tok, 120 if quick else 250)
    qs = questions(8 if quick else 32, [2, 4, 6, 8])
    tokens = 8 if quick else 32
    ratios = [0.0, 0.15, 1.0] if quick else RATIOS
    rules = RULES[:2] if quick else RULES
    system = tok.encode(SYSTEM, add_special_tokens=False)
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    full = LLM(model.source, dtype="bf16", kv_cache_bytes=256 << 20, enable_prefix_caching=False)
    conn = TierKVConnector(
        ConnectorConfig(chunk_size=64, tiers=TiersConfig(cpu_bytes="2GiB"), segment_admit_after=1)
    )
    blend = LLM(model.source, dtype="bf16", kv_cache_bytes=256 << 20, kv_connector=conn)
    full_rec, blend_rec = FirstLogits(full), FirstLogits(blend)
    variants = [("k", 1, 0, r) for r in ratios] + [
        (m, c, g, 0.15) for m, c, g in rules if (m, c, g) != ("k", 1, 0)
    ]
    per: list[dict[str, Any]] = []
    bar = tqdm(total=len(qs) * (1 + len(variants)), desc="blend quality")
    for mods, q in qs:
        tail = tok.encode(f"Question: {q}<|im_end|>\n<|im_start|>assistant\n", False)
        flat = system + sum((docs[m] for m in mods), []) + tail
        ref, ref_logits = full_rec.run(flat, greedy)
        bar.update()
        parts = [PromptPart(system, prefix=True)] + [PromptPart(docs[m]) for m in mods]
        parts.append(PromptPart(tail, reusable=False))
        blend.generate([parts], SamplingParams(max_tokens=1, blend_ratio=0.0), use_tqdm=False)
        for metric, check, gradual, ratio in variants:
            blend.config.blend_metric, blend.config.blend_gradual = metric, gradual
            sp = SamplingParams(
                max_tokens=tokens,
                temperature=0.0,
                ignore_eos=True,
                blend_ratio=ratio,
                blend_check_layer=check,
            )
            out, logits = blend_rec.run(parts, sp)
            per.append(
                {
                    "docs": len(mods),
                    "rule": f"{metric}@{check}" + (f"/g{gradual}" if gradual else ""),
                    "ratio": ratio,
                    "kl": kl(ref_logits, logits),
                    "top1": out.token_ids[0] == ref.token_ids[0],
                    "exact": out.token_ids == ref.token_ids,
                    "first_diff": first_diff(out.token_ids, ref.token_ids),
                    "ttft_ms": out.metrics.ttft * 1e3,
                    "full_ttft_ms": ref.metrics.ttft * 1e3,
                }
            )
            bar.update()
    bar.close()
    conn.close()
    rows = summarize(per)
    config = {"model": "smollm2 bf16", "questions": len(qs), "doc_tokens": 120 if quick else 250}
    config |= {"greedy_tokens": tokens, "chunk_size": 64, "modules": MODULES}
    return rows, per, config


def summarize(per: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(p["rule"], p["ratio"]) for p in per}, key=lambda k: (k[0] != "k@1", k))
    for rule, ratio in keys:
        for docs in sorted({p["docs"] for p in per}) + [0]:
            sel = [p for p in per if (p["rule"], p["ratio"]) == (rule, ratio)]
            sel = [p for p in sel if docs in (0, p["docs"])]
            rows.append(
                {
                    "rule": rule,
                    "ratio": ratio,
                    "docs": docs or "all",
                    "questions": len(sel),
                    "kl": statistics.mean(p["kl"] for p in sel),
                    "top1_agree": statistics.mean(p["top1"] for p in sel),
                    "exact_32": statistics.mean(p["exact"] for p in sel),
                    "first_diff": statistics.mean(p["first_diff"] for p in sel),
                    "ttft_ms": statistics.median(p["ttft_ms"] for p in sel),
                    "full_ttft_ms": statistics.median(p["full_ttft_ms"] for p in sel),
                }
            )
    return rows


def goals_of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from bench.common import goal

    at = {(r["rule"], r["ratio"], r["docs"]): r for r in rows}
    b, zero = at[("k@1", 0.15, "all")], at[("k@1", 0.0, "all")]
    six = at.get(("k@1", 0.15, 6), b)
    return [
        goal(
            "blend 0.15 TTFT speedup vs full, 6 docs",
            six["full_ttft_ms"] / six["ttft_ms"],
            ">=",
            3.0,
            "x",
        ),
        goal("KL at 0.15 / KL at 0", b["kl"] / max(zero["kl"], 1e-12), "<=", 0.4),
        goal("first token equal to full prefill at 0.15", b["top1_agree"], ">=", 0.95),
        goal(
            "first divergence at 0.15 / at 0",
            b["first_diff"] / max(zero["first_diff"], 1e-9),
            ">=",
            2.0,
            "x",
        ),
    ]


def plot(ax: Any, rows: list[dict[str, Any]]) -> None:
    for docs in sorted({r["docs"] for r in rows if r["docs"] != "all"}):
        pts = [(r["ratio"], r["kl"]) for r in rows if r["rule"] == "k@1" and r["docs"] == docs]
        ax.plot(*zip(*sorted(pts)), marker="o", label=f"{docs} docs, K at layer 1")
    for r in rows:
        if r["rule"] != "k@1" and r["docs"] == "all":
            ax.scatter([r["ratio"]], [r["kl"]], marker="x", label=f"{r['rule']} (all docs)")
    ax.set_xlabel("blend ratio")
    ax.set_ylabel("KL(full prefill || blend), next token")
    ax.legend(fontsize=7)


def main(quick: bool) -> None:
    from bench.common import print_table, write_results

    rows, _, config = run(quick)
    print_table(rows)
    write_results("blend_smollm2", config, rows, goals_of(rows), lambda ax: plot(ax, rows))
