"""Any-position reuse on a task: does blending still answer right? (`python -m bench.blend --task`)

SmolLM2-135M-Instruct in fp32, through its chat template (system turn, then the documents and
the question in the user turn), answers two question sets:
- pydoc: fact questions over standard-library documentation (engine/blend_tasks.py), the value
  of a module constant or a default argument that exactly one of the 2-8 shuffled documents
  states, the reply's lead given ("MAX_WBITS =") so that its first token is the answer's;
- demo: the RAG demo's questions (examples/rag_docs.py), each over its documents in seeded
  shuffled orders.
Full prefill answers each once; then every rule the engine accepts blends at each ratio (the
documents' KV stored once, after the system turn). Per rule and ratio: accuracy (normalised
whole-word match), accuracy relative to full prefill's, first-token agreement with full prefill,
KL of the first token's distribution against full prefill's, the first greedy token that
differs, tokens recomputed, and TTFT over full prefill's (median of the per-question ratios).
The base rule at ratio 0 (every loaded token kept) always runs too: the KL baseline.

Each question's records go to bench/results/blend_task.jsonl.tmp as it ends; a run cut short
resumes there when started again with the same settings (the file is removed once the JSON is
written). Answers are deterministic, so a resumed run's rows equal an uncut run's but for TTFT.
"""

from __future__ import annotations

import json
import random
import statistics
from typing import Any

from tqdm import tqdm

from bench.common import RESULTS, Checkpoint, goal, print_table, write_results
from bench.record import FirstLogits, first_diff, kl
from examples import rag_docs
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams, blend_tasks
from tierkv.engine.blend_calibrate import RULES, params_of
from tierkv.engine.blend_gate import accepts
from tierkv.engine.models import pull
from tierkv.storage_backends.build import TiersConfig

RATIOS = (0.0, 0.05, 0.15, 0.3, 0.5)
DOCS_PER = (2, 3, 4, 5, 6, 7, 8)
TOKENS = {"pydoc": 12, "demo": 40}  # greedy tokens per answer: a value; a sentence


def demo_tasks(count: Any, orders: int, seed: int = 0) -> list[blend_tasks.Task]:
    """The demo's questions, each over its documents in `orders` seeded shuffled orders."""
    rng, texts = random.Random(seed), rag_docs.documents(count, 260)
    out = []
    for q in (rag_docs.QUESTION_A, *rag_docs.QUESTIONS):
        for _ in range(orders):
            order = rng.sample(q.docs, len(q.docs))
            docs = tuple(texts[i] for i in order)
            about = next(i for i, d in enumerate(docs) if q.expect in d.lower())
            out.append(blend_tasks.Task(q.text, q.expect, docs, about, "demo"))
    return out


def rules() -> list[str]:
    """The candidate rules this engine accepts (the base rule always)."""
    return [r for r in RULES if accepts(r)]


def same(a: str | None, b: str | None) -> bool:
    """Whether two replies give the same answer (blend_tasks.answer: the first line)."""
    return blend_tasks.answer(a or "") == blend_tasks.answer(b or "")


def run(
    quick: bool, ratios: tuple[float, ...] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    path = str(pull("smollm2", progress=False))
    common: dict[str, Any] = dict(dtype="fp32", kv_cache_bytes=384 << 20, blend_calibration="off")
    full = LLM(path, enable_prefix_caching=False, **common)
    tiers = TiersConfig(cpu_bytes="2GiB")  # parts stored on first sight: every trial blends
    conn = TierKVConnector(ConnectorConfig(chunk_size=64, tiers=tiers, segment_admit_after=1))
    blend = LLM(path, kv_connector=conn, max_num_batched_tokens=4096, **common)
    assert full.tokenizer is not None
    tok = full.tokenizer
    encode = lambda s: tok.encode(s, add_special_tokens=False)
    count = lambda s: len(encode(s))
    budget = 160 if quick else 250
    tasks = blend_tasks.tasks(count, 3 if quick else 60, DOCS_PER, budget, seed=0)
    tasks += demo_tasks(count, 1 if quick else 2)[: 1 if quick else None]
    ratios = ratios or ((0.15,) if quick else RATIOS)
    pairs = [("cacheblend", 0.0)] + [(r, x) for r in rules() for x in ratios if x > 0]
    full_rec, blend_rec = FirstLogits(full), FirstLogits(blend)
    per: list[dict[str, Any]] = []
    settings = {"quick": quick, "pairs": pairs, "questions": len(tasks)}
    ckpt = Checkpoint(RESULTS / "blend_task.jsonl.tmp", json.loads(json.dumps(settings)))
    bar = tqdm(total=len(tasks) * (1 + len(pairs)), desc="blend task")
    for qi, task in enumerate(tasks):
        if qi in ckpt.done:
            per += ckpt.done[qi]
            bar.update(1 + len(pairs))
            continue
        start = len(per)
        system = blend_tasks.SYSTEM if task.source == "pydoc" else rag_docs.SYSTEM
        flat, parts = blend_tasks.prompt(encode, task, system)
        tokens = TOKENS[task.source]
        greedy = SamplingParams(max_tokens=tokens, temperature=0.0)
        ref, ref_logits = full_rec.run(flat, greedy)
        base = {"q": qi, "set": task.source, "docs": len(task.docs), "tokens": len(flat)}
        right = blend_tasks.correct(ref.text or "", task)
        per.append(base | {"rule": "full prefill", "ratio": 1.0, "right": right, "top1": True})
        per[-1] |= {"kl": 0.0, "first_diff": len(ref.token_ids), "recomputed": len(flat)}
        per[-1] |= {"ttft_ratio": 1.0, "answer": ref.text, "same_answer": True}
        bar.update()
        for rule, ratio in pairs:
            out, logits = blend_rec.run(parts, params_of(rule, ratio, tokens))
            b = out.metrics.blend
            assert b, f"{rule}@{ratio:g} ran unblended"
            per.append(
                base
                | {
                    "rule": rule,
                    "ratio": ratio,
                    "right": blend_tasks.correct(out.text or "", task),
                    "top1": out.token_ids[:1] == ref.token_ids[:1],
                    "kl": kl(ref_logits, logits),
                    "first_diff": first_diff(out.token_ids, ref.token_ids),
                    "recomputed": b.get("recomputed", 0) + b.get("computed", 0),
                    "ttft_ratio": out.metrics.ttft / ref.metrics.ttft,
                    "answer": out.text,
                    "same_answer": same(out.text, ref.text),
                }
            )
            bar.update()
        ckpt.add(per[start:])
    bar.close()
    conn.close()
    ckpt.remove()
    config = {"model": "smollm2 fp32", "questions": len(tasks), "doc_tokens": budget}
    config |= {"greedy_tokens": TOKENS, "rules": rules(), "ratios": list(ratios)}
    config |= {"sets": {s: sum(t.source == s for t in tasks) for s in ("pydoc", "demo")}}
    return summarize(per), per, config


def summarize(per: list[dict[str, Any]]) -> list[dict[str, Any]]:
    full = [p for p in per if p["rule"] == "full prefill"]
    full_acc = statistics.mean(p["right"] for p in full)
    zero = [p["kl"] for p in per if (p["rule"], p["ratio"]) == ("cacheblend", 0.0)]
    kl0 = statistics.mean(zero) if zero else float("nan")
    rows = []
    for rule, ratio in dict.fromkeys((p["rule"], p["ratio"]) for p in per):
        sel = [p for p in per if (p["rule"], p["ratio"]) == (rule, ratio)]
        acc = statistics.mean(p["right"] for p in sel)
        rows.append(
            {
                "rule": rule,
                "ratio": ratio,
                "questions": len(sel),
                "accuracy": acc,
                "acc_vs_full": acc / full_acc if full_acc else float("nan"),
                "pydoc_acc": _mean([p["right"] for p in sel if p["set"] == "pydoc"]),
                "demo_acc": _mean([p["right"] for p in sel if p["set"] == "demo"]),
                "top1_agree": statistics.mean(p["top1"] for p in sel),
                "answer_agree": statistics.mean(p["same_answer"] for p in sel),
                "kl": statistics.mean(p["kl"] for p in sel),
                "kl_vs_ratio0": statistics.mean(p["kl"] for p in sel) / kl0 if kl0 else None,
                "first_diff": statistics.mean(p["first_diff"] for p in sel),
                "recomputed": statistics.mean(p["recomputed"] for p in sel),
                "ttft_vs_full": statistics.median(p["ttft_ratio"] for p in sel),
                "ttft_vs_full_6docs": _median([p["ttft_ratio"] for p in sel if p["docs"] == 6]),
            }
        )
    return rows


def _mean(xs: list[Any]) -> float | None:
    return statistics.mean(xs) if xs else None


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def plot(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Accuracy per rule over the ratio (solid), and the first token's KL (dotted, right axis):
    rules that answer alike still differ in how far they drift."""
    full = next(r for r in rows if r["rule"] == "full prefill")
    ax_kl = ax.twinx()
    for rule in dict.fromkeys(r["rule"] for r in rows if r["rule"] != "full prefill"):
        sel = sorted((r for r in rows if r["rule"] == rule), key=lambda r: r["ratio"])
        (line,) = ax.plot([r["ratio"] for r in sel], [r["accuracy"] for r in sel], marker="o")
        line.set_label(rule)
        ax_kl.plot([r["ratio"] for r in sel], [r["kl"] for r in sel], ":", color=line.get_color())
    ax_kl.set_ylabel("KL(full || blend), first token (dotted)")
    ax.axhline(full["accuracy"], color="k", linestyle="--", label="full prefill")
    ax.set_xlabel("blend ratio")
    ax.set_ylabel("accuracy (answer holds the documented value)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)


def calibrated() -> tuple[str, float] | None:
    """The (rule, ratio) SmolLM2's calibration chose on this machine, if it has one."""
    from tierkv.engine.blend_gate import entry, load, model_digest

    src = pull("smollm2", progress=False)
    path = entry(src, model_digest(src))
    try:
        cal = load(path, None) if path.exists() else None
    except ValueError:
        return None  # an older format: not this engine's calibration
    return (cal.rule, cal.ratio) if cal and cal.rule and cal.ratio is not None else None


def main(quick: bool, ratios: tuple[float, ...] | None = None) -> None:
    rows, per, config = run(quick, ratios)
    print_table(rows)
    at = {(r["rule"], r["ratio"]): r for r in rows}
    full = at[("full prefill", 1.0)]
    goals = [
        goal("full prefill accuracy (questions the model can answer)", full["accuracy"], ">=", 0.3)
    ]
    chosen = calibrated()
    config["calibrated"] = list(chosen) if chosen else None
    pair = chosen if chosen in at else ("cacheblend", 0.15)
    if pair in at:
        r, name = at[pair], f"{pair[0]}@{pair[1]:g}"
        goals += [
            goal(f"{name}: accuracy / full prefill's", r["acc_vs_full"], ">=", 0.98),
            goal(f"{name}: first token equal to full's", r["top1_agree"], ">=", 0.95),
        ]
        if r["kl_vs_ratio0"] is not None:
            goals.append(goal(f"{name}: KL / ratio 0's", r["kl_vs_ratio0"], "<=", 0.25))
        if r["ttft_vs_full_6docs"] is not None:
            goals.append(
                goal(f"{name}: TTFT / full's, 6 docs", r["ttft_vs_full_6docs"], "<=", 0.35)
            )
    write_results(
        "blend_task", config | {"per_question": per}, rows, goals, lambda ax: plot(ax, rows)
    )
