"""RAG documents shared across processes through tierkv-server (`make demo`).

1. starts a tierkv-server with its default tiers (cpu + disk) in a temporary directory;
2. process A (its own interpreter) ingests 6 documents: each one's KV, computed standalone,
   goes to the server under its position-free segment key; it also answers one question
   with the documents in their original order, which stores that prompt's prefix chunks;
3. process B (another interpreter, empty local cache) answers questions over the documents
   in other orders and combinations, three ways: cold prefill, prefix reuse only (hits only
   where the order matches what was stored), and blend (CacheBlend, ratio 0.15);
4. prints TTFT, tokens loaded and recomputed, and the deviation from cold; writes a PNG;
   stops the server.

    python -m examples.rag_demo
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODEL = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=1408,
    vocab_size=32000,
    max_position_embeddings=8192,
)
DOCS, DOC_TOKENS, QUESTION_TOKENS, ANSWER_TOKENS = 6, 512, 32, 16
QUESTIONS = [[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2, 0, 4], [3, 5, 1, 0], [1, 3]]
RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def corpus() -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(2026)
    docs = [
        torch.randint(0, MODEL["vocab_size"], (DOC_TOKENS,), generator=g).tolist()
        for _ in range(DOCS)
    ]
    qs = [
        torch.randint(0, MODEL["vocab_size"], (QUESTION_TOKENS,), generator=g).tolist()
        for _ in QUESTIONS
    ]
    return docs, qs


def engine(target: str | None):
    from tierkv.connector import ConnectorConfig, TierKVConnector
    from tierkv.engine import LLM

    conn = (
        TierKVConnector(ConnectorConfig(cpu_bytes="1GiB", remote=f"grpc://{target}"))
        if target
        else None
    )
    llm = LLM(
        MODEL,
        dtype="bfloat16",
        kv_cache_bytes=512 << 20,
        enable_prefix_caching=False,
        kv_connector=conn,
        max_num_batched_tokens=8192,
    )
    return llm, conn


def run(llm, prompt, ratio: float | None = None):
    """(output, the logits of its first token)."""
    from tierkv.engine import SamplingParams

    seen = []
    inner = llm.runner.run
    llm.runner.run = lambda out: seen.append(inner(out)) or seen[-1]
    try:
        out = llm.generate(
            [prompt],
            SamplingParams(
                max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True, blend_ratio=ratio
            ),
            use_tqdm=False,
        )[0]
    finally:
        llm.runner.run = inner
    return out, seen[-ANSWER_TOKENS][-1].float()


def process_a(target: str) -> None:
    docs, qs = corpus()
    llm, conn = engine(target)
    t0 = time.perf_counter()
    stored = llm.ingest(docs)
    run(llm, sum(docs, []) + qs[0])  # the original order: its prefix chunks are stored too
    conn.close()
    print(json.dumps({"ingested": stored, "seconds": time.perf_counter() - t0}))


def process_b(target: str) -> None:
    from tierkv.engine import PromptPart

    docs, qs = corpus()
    cold, _ = engine(None)
    llm, conn = engine(target)
    rows = []
    for qi, (order, q) in enumerate(zip(QUESTIONS, qs)):
        flat = sum((docs[i] for i in order), []) + q
        ref, ref_logits = run(cold, flat)
        ref_lp = ref_logits.log_softmax(-1)
        for mode in ("cold", "prefix only", "blend 0.15"):
            if mode == "cold":
                out, logits = ref, ref_logits
            elif mode == "prefix only":
                out, logits = run(llm, flat)
            else:
                out, logits = run(
                    llm,
                    [PromptPart(docs[i]) for i in order] + [PromptPart(q, reusable=False)],
                    0.15,
                )
            m = out.metrics
            kl = float(
                torch.nn.functional.kl_div(
                    logits.log_softmax(-1), ref_lp, log_target=True, reduction="sum"
                )
            )
            recomputed = (
                m.blend["recomputed"] + m.blend["computed"]
                if m.blend
                else len(flat) - m.external_tokens
            )
            rows.append(
                {
                    "question": qi,
                    "docs": "".join(map(str, order)),
                    "mode": mode,
                    "tokens": len(flat),
                    "ttft_ms": m.ttft * 1e3,
                    "loaded": m.external_tokens,
                    "recomputed": recomputed,
                    "kl_vs_cold": kl,
                    "greedy_agree": sum(a == b for a, b in zip(out.token_ids, ref.token_ids))
                    / ANSWER_TOKENS,
                    "from": ",".join(
                        f"{k}:{v}" for k, v in m.connector.get("loaded_tokens", {}).items()
                    ),
                }
            )
    conn.close()
    print(json.dumps(rows))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(role: str, target: str) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "examples.rag_demo", role, target],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if p.returncode:
        raise RuntimeError(f"process {role} failed:\n{p.stderr[-3000:]}")
    return p.stdout.strip().splitlines()[-1]


def main() -> None:
    from bench.common import print_table

    tmp = Path(tempfile.mkdtemp(prefix="tierkv-demo-"))
    port = free_port()
    target = f"127.0.0.1:{port}"
    log = open(tmp / "server.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierkv.cacheserver",
            "--port",
            str(port),
            "--cache-dir",
            str(tmp / "cache"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tierkv-server did not start: {(tmp / 'server.log').read_text()}"
                    ) from None
                time.sleep(0.1)
        print(f"tierkv-server on {target} (cache in {tmp / 'cache'})")
        a = json.loads(child("ingest", target))
        print(
            f"process A: {a['ingested']} documents ingested into the server in {a['seconds']:.1f}s"
        )
        rows = json.loads(child("ask", target))
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    print("process B (empty local cache):")
    print_table(rows)
    plot(rows)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ["cold", "prefix only", "blend 0.15"]
    qs = sorted({r["question"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for j, mode in enumerate(modes):
        ax.bar(
            [q + (j - 1) * 0.27 for q in qs],
            [
                next(r["ttft_ms"] for r in rows if r["question"] == q and r["mode"] == mode)
                for q in qs
            ],
            0.27,
            label=mode,
        )
    ax.set_xticks(qs, [f"docs {next(r['docs'] for r in rows if r['question'] == q)}" for q in qs])
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("RAG across processes: process B's TTFT by how its KV was obtained")
    ax.legend()
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / "rag_demo.png", dpi=110)
    (RESULTS / "rag_demo.json").write_text(json.dumps(rows, indent=2))
    print(f"wrote {RESULTS / 'rag_demo.png'}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("ingest", "ask"):
        (process_a if sys.argv[1] == "ingest" else process_b)(sys.argv[2])
    else:
        main()
