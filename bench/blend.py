"""Any-position reuse (CacheBlend) on the bench model: TTFT of full prefill, of prefix caching
(hits only when the document order repeats) and of blend at 0.15, on 6 documents of 512 tokens
and a 32-token question, documents shuffled per query; on the 8-layer bench model and on a
32-layer variant of it. Then the deviation from full prefill (KL of the next-token
distribution, agreement of 32 greedy tokens) for blend ratios 0..1 on 2-8 documents, also with
the first document declared the shared prefix (the others computed after it).

    python -m bench.blend [--quick] [--model bench|smollm2] [--task]

With --model smollm2, CacheBlend's quality on a trained model instead (bench/blend_quality.py);
with --task, the blend rules' task accuracy on SmolLM2 (bench/blend_task.py).
"""

from __future__ import annotations

import random
import statistics

import torch
from tqdm import tqdm

from bench.common import add_model_arg, goal, parser, print_table, write_results
from bench.record import FirstLogits, kl
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, PromptPart, SamplingParams
from tierkv.engine.config import RANDOM_CONFIGS
from tierkv.storage_backends.build import TiersConfig

RATIOS = [0.0, 0.05, 0.15, 0.3, 0.5, 1.0]


CHECK_LAYER = 1  # the engine's default blend_check_layer


def qkv_share(model: dict) -> float:
    """The q/k/v projection's share of a layer's linear-layer FLOPs: the part of the check layer
    that runs on every row."""
    h, d = model["hidden_size"], model["hidden_size"] // model["num_attention_heads"]
    qkv = h * (model["num_attention_heads"] + 2 * model["num_key_value_heads"]) * d
    return qkv / (qkv + model["num_attention_heads"] * d * h + 3 * h * model["intermediate_size"])


def cfg(layers: int) -> dict:
    return dict(RANDOM_CONFIGS["bench"], num_hidden_layers=layers, max_position_embeddings=8192)


def make(model: dict, conn=None, prefix: bool = False) -> LLM:
    return LLM(
        model,
        dtype="bfloat16",
        kv_cache_bytes=512 << 20,
        enable_prefix_caching=prefix,
        kv_connector=conn,
        max_num_batched_tokens=8192,
    )


def ttft_rows(
    layers: int, queries: int, docs: list[list[int]], question: list[int], bar
) -> list[dict]:
    model = cfg(layers)
    conn = TierKVConnector(
        ConnectorConfig(tiers=TiersConfig(cpu_bytes="2GiB"), segment_admit_after=1)
    )
    full, prefix, blend = make(model), make(model, prefix=True), make(model, conn)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    blend.ingest(docs)
    rng = random.Random(layers)
    times: dict[str, list[float]] = {"full prefill": [], "prefix caching": [], "blend 0.15": []}
    recomputed = []
    for _ in range(queries):
        order = rng.sample(range(len(docs)), len(docs))
        flat = sum((docs[i] for i in order), []) + question
        times["full prefill"].append(full.generate([flat], first, use_tqdm=False)[0].metrics.ttft)
        times["prefix caching"].append(
            prefix.generate([flat], first, use_tqdm=False)[0].metrics.ttft
        )
        out = blend.generate(
            [[PromptPart(docs[i]) for i in order] + [PromptPart(question, reusable=False)]],
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, blend_ratio=0.15),
            use_tqdm=False,
        )[0]
        times["blend 0.15"].append(out.metrics.ttft)
        recomputed.append(
            (out.metrics.blend["recomputed"] + out.metrics.blend["computed"]) / len(flat)
        )
        bar.update()
    conn.close()
    f = (
        CHECK_LAYER + qkv_share(model)
    ) / layers  # layer 0 in full, then the check layer's K/V for every row
    limit = 1 / (f + (1 - f) * 0.15)
    base = statistics.median(times["full prefill"])
    rows = []
    for src, ts in times.items():
        t = statistics.median(ts)
        rows.append(
            {
                "layers": layers,
                "source": src,
                "ttft_ms": t * 1e3,
                "speedup_vs_full": base / t,
                "limit": limit if src.startswith("blend") else "",
                "share_of_limit": base / t / limit if src.startswith("blend") else "",
                "rows_recomputed": statistics.median(recomputed) if src.startswith("blend") else "",
            }
        )
    return rows


def deviation_rows(ndocs_list: list[int], tokens: int, bar) -> list[dict]:
    model = cfg(8)
    g = torch.Generator().manual_seed(11)
    conn = TierKVConnector(
        ConnectorConfig(tiers=TiersConfig(cpu_bytes="2GiB"), segment_admit_after=1)
    )
    full, blend = make(model), make(model, conn)
    full_rec, blend_rec = FirstLogits(full), FirstLogits(blend)
    rows = []
    for nd in ndocs_list:
        docs = [
            torch.randint(0, model["vocab_size"], (256,), generator=g).tolist() for _ in range(nd)
        ]
        question = torch.randint(0, model["vocab_size"], (32,), generator=g).tolist()
        greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        ref, ref_logits = full_rec.run(sum(docs, []) + question, greedy)
        # "doc 0": the same prompt with its first document declared the shared prefix (a system
        # prompt): reused exactly, the other documents' KV computed after it instead of standalone.
        for metric, prefix in (("k", False), ("k", True), ("v", False)):
            blend.config.blend_metric = metric
            for r in RATIOS if metric == "k" else [0.15]:
                p = SamplingParams(
                    max_tokens=tokens, temperature=0.0, ignore_eos=True, blend_ratio=r
                )
                prompt = (
                    [PromptPart(docs[0], prefix=prefix)]
                    + [PromptPart(d) for d in docs[1:]]
                    + [PromptPart(question, reusable=False)]
                )
                out, logits = blend_rec.run(prompt, p)
                agree = sum(a == b for a, b in zip(out.token_ids, ref.token_ids)) / tokens
                rows.append(
                    {
                        "docs": nd,
                        "metric": metric,
                        "prefix": "doc 0" if prefix else "none",
                        "ratio": r,
                        "kl": kl(ref_logits, logits),
                        "greedy_agreement": agree,
                    }
                )
                bar.update()
    blend.config.blend_metric = "k"
    conn.close()
    return rows


def main() -> None:
    p = add_model_arg(parser(__doc__))
    p.add_argument("--task", action="store_true", help="task accuracy of the blend rules")
    p.add_argument("--ratios", default="", help="--task: blend ratios, comma-separated (all)")
    args = p.parse_args()
    if args.task or args.model == "smollm2":
        from bench import blend_quality, blend_task

        if args.task:
            ratios = tuple(float(x) for x in args.ratios.split(",") if x)
            return blend_task.main(args.quick, ratios or None)
        return blend_quality.main(args.quick)
    queries = 2 if args.quick else 5
    g = torch.Generator().manual_seed(5)
    vocab = RANDOM_CONFIGS["bench"]["vocab_size"]
    docs = [torch.randint(0, vocab, (512,), generator=g).tolist() for _ in range(6)]
    question = torch.randint(0, vocab, (32,), generator=g).tolist()
    ndocs = [2, 4] if args.quick else [2, 4, 8]
    tokens = 8 if args.quick else 32
    layer_counts = [8] if args.quick else [8, 32]
    bar = tqdm(total=queries * len(layer_counts) + len(ndocs) * (2 * len(RATIOS) + 1), desc="blend")
    rows = []
    for layers in layer_counts:
        rows += ttft_rows(layers, queries, docs, question, bar)
    dev = deviation_rows(ndocs, tokens, bar)
    bar.close()
    print_table(rows)
    print_table(dev)
    by = {(r["layers"], r["source"]): r for r in rows}
    goals = [
        goal(
            "blend TTFT speedup vs full, 8 layers",
            by[(8, "blend 0.15")]["speedup_vs_full"],
            ">=",
            2.5,
            "x",
        ),
        goal(
            "blend share of compute-bound limit, 8 layers",
            by[(8, "blend 0.15")]["share_of_limit"],
            ">=",
            0.7,
        ),
        goal(
            "blend TTFT speedup vs prefix caching (shuffled), 8 layers",
            by[(8, "prefix caching")]["ttft_ms"] / by[(8, "blend 0.15")]["ttft_ms"],
            ">=",
            2.0,
            "x",
        ),
    ]
    if 32 in layer_counts:
        goals += [
            goal(
                "blend TTFT speedup vs full, 32 layers",
                by[(32, "blend 0.15")]["speedup_vs_full"],
                ">=",
                4.0,
                "x",
            ),
            goal(
                "blend share of compute-bound limit, 32 layers",
                by[(32, "blend 0.15")]["share_of_limit"],
                ">=",
                0.7,
            ),
        ]
    kl_none = {
        (d["docs"], d["ratio"]): d["kl"]
        for d in dev
        if d["metric"] == "k" and d["prefix"] == "none"
    }
    kl_prefix = {(d["docs"], d["ratio"]): d["kl"] for d in dev if d["prefix"] == "doc 0"}
    at = statistics.mean(kl_none[(n, 0.15)] for n in ndocs) / max(
        1e-12, statistics.mean(kl_none[(n, 0.0)] for n in ndocs)
    )
    goals.append(goal("KL at 0.15 / KL at 0.0 (mean over doc counts)", at, "<=", 0.5))

    def plot(ax) -> None:
        for n in ndocs:
            (line,) = ax.plot(
                RATIOS, [kl_none[(n, r)] for r in RATIOS], marker="o", label=f"{n} docs"
            )
            ax.plot(
                RATIOS,
                [kl_prefix[(n, r)] for r in RATIOS],
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"{n} docs, doc 0 declared prefix",
            )
        ax.set_xlabel("blend ratio")
        ax.set_ylabel("KL(blend || full prefill), next token")
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.legend()

    write_results(
        "blend",
        {
            "docs": 6,
            "doc_tokens": 512,
            "question_tokens": 32,
            "queries": queries,
            "check_layer": CHECK_LAYER,
            "model": "bench bf16",
            "limit_full_share": f"(check_layer + {qkv_share(cfg(8)):.4f}) / layers",
        },
        rows + dev,
        goals,
        plot,
    )


if __name__ == "__main__":
    main()
