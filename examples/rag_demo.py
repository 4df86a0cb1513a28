"""RAG over Python's own documentation on SmolLM2-135M-Instruct, shared across processes through
tierkv-server (`make demo`).

1. starts a tierkv-server in a temporary directory;
2. process A (its own interpreter) ingests 6 documents (pydoc pages of standard-library modules,
   examples/rag_docs.py): each one's KV, computed right after the system prompt, goes to the
   server under its position-free segment key; A also answers one question over all six in
   their original order, as plain token ids, which stores that prompt's prefix chunks;
3. process B (another interpreter, empty local cache) answers questions over 2-4 documents in
   other orders and combinations, five ways: full prefill (an engine without a connector),
   prefix reuse only (the prompt as plain token ids: only exact prefixes hit), blend (CacheBlend
   at ratio 0.15: each document's KV loaded wherever it sits, 15% of it recomputed), the
   calibrated rule (the prompt in parts with no ratio given: the rule `tierkv-engine
   calibrate-blend --model smollm2` stored for the model, else prefix reuse, "uncalibrated")
   and blend at ratio 1.0 (everything recomputed: its answer must equal full prefill's);
4. prints each question's answers, TTFT and tokens loaded and recomputed; writes
   bench/results/rag_demo.json and .png; stops the server.

fp32 (bf16 got simple questions wrong in some setups), greedy decoding up to EOS.

    python -m examples.rag_demo
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from examples.rag_docs import MODULES, QUESTION_A, QUESTIONS, Corpus, Question

if TYPE_CHECKING:
    from tierkv.connector import TierKVConnector
    from tierkv.engine import LLM, PromptPart, RequestOutput

DTYPE, MAX_TOKENS, CHUNK, BLEND = "fp32", 48, 64, 0.15
WAYS = ("full prefill", "prefix only", f"blend {BLEND}", "calibrated", "blend 1.0")


def say(msg: str) -> None:
    """A stage line (stderr: the parent passes these through as they come)."""
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def engine(target: str | None) -> tuple[LLM, TierKVConnector | None]:
    """SmolLM2 in fp32, warmed up; with target, a connector to the server there."""
    from tierkv.connector import ConnectorConfig, TierKVConnector, TiersConfig
    from tierkv.engine import LLM, SamplingParams
    from tierkv.engine.models import pull

    conn = None
    if target:
        conn = TierKVConnector(
            ConnectorConfig(
                chunk_size=CHUNK, tiers=TiersConfig(cpu_bytes="256MiB"), remote=f"grpc://{target}"
            )
        )
    llm = LLM(
        str(pull("smollm2", progress=False)),
        dtype=DTYPE,
        kv_cache_bytes=160 << 20,  # fp32 KV is 45 KiB a token: room for 3600 tokens
        enable_prefix_caching=False,  # reuse only through the connector
        kv_connector=conn,
        max_num_batched_tokens=2048,
    )
    # First-call costs out of the TTFTs; under one chunk, so the connector stores nothing.
    warm = list(range(100, 100 + CHUNK - 1))
    llm.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    return llm, conn


def ask(
    llm: LLM, prompt: list[int] | list[PromptPart], ratio: float | None = None
) -> RequestOutput:
    from tierkv.engine import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, blend_ratio=ratio)
    return llm.generate(prompt, params, use_tqdm=False)[0]


def process_a(target: str) -> None:
    say("process A: loading SmolLM2-135M-Instruct (fp32)")
    llm, conn = engine(target)
    assert conn is not None and llm.tokenizer is not None
    corpus = Corpus(llm.tokenizer)
    say(f"process A: ingesting {len(corpus.docs)} documents, each after the system prompt")
    t0 = time.perf_counter()
    stored = llm.ingest(corpus.docs, prefix=corpus.system)
    ingest_s = time.perf_counter() - t0
    say("process A: one question over all of them, in their original order")
    out = ask(llm, corpus.flat(QUESTION_A))
    conn.close()
    answer, doc_tokens = " ".join((out.text or "").split()), [len(d) for d in corpus.docs]
    m = {"ingested": stored, "doc_tokens": doc_tokens, "ingest_s": ingest_s, "answer": answer}
    print(json.dumps(m | {"tokens": len(out.prompt_token_ids), "ttft_s": out.metrics.ttft}))


def row(
    q: int, question: Question, way: str, out: RequestOutput, ref: RequestOutput
) -> dict[str, Any]:
    m, n, text = out.metrics, len(out.prompt_token_ids), out.text or ""
    # Run through the model for the prompt: a blend's recomputed documents and its question.
    recomputed = m.blend["recomputed"] + m.blend["computed"] if m.blend else n - m.external_tokens
    return {
        "q": q,
        "question": question.text,
        "docs": ",".join(MODULES[i] for i in question.docs),
        "way": way,
        "tokens": n,
        "ttft_s": m.ttft,
        "loaded": m.external_tokens,
        "recomputed": recomputed,
        "cached": m.cached_tokens,
        "from": ",".join(f"{k}:{v}" for k, v in m.connector.get("loaded_tokens", {}).items()),
        "blend": m.blend,
        "rule": m.blend_rule,  # a prompt in parts: the rule it blended with, or "uncalibrated"
        "answer": " ".join(text.split()),
        "right": question.expect in text.lower(),
        "same_as_full": out.token_ids == ref.token_ids,
    }


def process_b(target: str) -> None:
    say("process B: loading SmolLM2 twice (an engine without a connector and one with)")
    cold, _ = engine(None)
    llm, conn = engine(target)
    assert conn is not None and llm.tokenizer is not None
    corpus = Corpus(llm.tokenizer)
    found = conn.lookup_segments(corpus.docs, corpus.system)
    say(f"process B: {sum(found)}/{len(corpus.docs)} documents' KV found on the server")
    rows = []
    for q, question in enumerate(QUESTIONS, 1):
        say(f"process B: question {q}/{len(QUESTIONS)}, {len(corpus.flat(question))} tokens")
        ref = ask(cold, corpus.flat(question))
        outs = [ref, ask(llm, corpus.flat(question))]
        outs += [ask(llm, corpus.parts(question), ratio) for ratio in (BLEND, None, 1.0)]
        rows += [row(q, question, way, out, ref) for way, out in zip(WAYS, outs)]
    conn.close()
    print(json.dumps(rows))


def child(role: str, target: str, tmp: Path) -> Any:
    """Run role in its own interpreter: its stage lines pass through, its JSON comes back."""
    out, rest = tmp / f"{role}.json", []
    with open(out, "w") as stdout:
        cmd = [sys.executable, "-m", "examples.rag_demo", role, target]
        p = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)
        for line in p.stderr or []:
            if line.startswith("  ["):
                print(line, end="", flush=True)
            else:
                rest.append(line)
        if p.wait():
            raise RuntimeError(f"process {role} failed:\n{''.join(rest)[-3000:]}")
    return json.loads(out.read_text().strip().splitlines()[-1])


def serve(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A tierkv-server on a free port, its cache and log in tmp."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--port", str(port), "--cache-dir", str(tmp / "cache"), "--cpu-bytes", "512MiB"]
    with open(tmp / "server.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "tierkv.cacheserver", *args], stdout=log, stderr=log
        )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, f"127.0.0.1:{port}"
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                log_text = (tmp / "server.log").read_text()
                raise RuntimeError(f"tierkv-server did not start:\n{log_text}") from None
            time.sleep(0.1)


def show(rows: list[dict[str, Any]]) -> None:
    print("\nprocess B (empty local cache). loaded: prompt tokens whose KV came through the")
    print("connector; recomp: prompt tokens run through the model (a blend's recomputed")
    print("document tokens and its question); right: the answer holds the documented fact.")
    for q in sorted({r["q"] for r in rows}):
        rs = [r for r in rows if r["q"] == q]
        print(f"\nQ{q}. {rs[0]['question']}  [{rs[0]['docs']}: {rs[0]['tokens']} tokens]")
        print(f"    {'way':<12} {'TTFT':>6} {'loaded':>6} {'recomp':>6} right =full  from")
        for r in rs:
            same = "-" if r["way"] == WAYS[0] else "yes" if r["same_as_full"] else "NO"
            print(
                f"    {r['way']:<12} {r['ttft_s']:>5.2f}s {r['loaded']:>6} {r['recomputed']:>6}"
                f" {'yes' if r['right'] else 'no':<5} {same:<5} {r['from'] or '-'}"
            )
        rule = next(r["rule"] for r in rs if r["way"] == "calibrated")
        # uncalibrated: the plain prompt, whose prefix chunks "prefix only" just stored
        plain = " (prefix reuse of the tokens 'prefix only' just stored, no blend)"
        print(f"    calibrated: {rule}" + (plain if "@" not in rule else ""))
        for r in rs:
            print(
                textwrap.fill(f"    {r['way']:<12} {r['answer']}", 100, subsequent_indent=" " * 17)
            )


def summary(rows: list[dict[str, Any]]) -> float:
    """Prints each way's mean TTFT and answers; returns the share of blend 1.0 answers that
    equal full prefill's."""
    print()
    for way in WAYS:
        rs = [r for r in rows if r["way"] == way]
        same = f", {sum(r['same_as_full'] for r in rs)}/{len(rs)} equal full prefill's"
        print(
            f"{way:<12} mean TTFT {sum(r['ttft_s'] for r in rs) / len(rs):.2f}s, "
            f"{sum(r['right'] for r in rs)}/{len(rs)} answers right"
            + ("" if way == WAYS[0] else same)
        )
    blend1 = [r["same_as_full"] for r in rows if r["way"] == "blend 1.0"]
    return sum(blend1) / len(blend1)


def draw(rows: list[dict[str, Any]]) -> Any:
    def plot(ax: Any) -> None:
        qs = sorted({r["q"] for r in rows})
        for j, way in enumerate(WAYS[:4]):
            ttft = [next(r["ttft_s"] for r in rows if (r["q"], r["way"]) == (q, way)) for q in qs]
            ax.bar([q + (j - 1.5) * 0.2 for q in qs], ttft, 0.2, label=way)
        tokens = {r["q"]: r["tokens"] for r in rows}
        ax.set_xticks(qs, [f"Q{q}\n{tokens[q]} tokens" for q in qs])
        ax.set_ylabel("TTFT (s)")
        ax.legend(title="process B, SmolLM2-135M fp32")

    return plot


def main() -> None:
    from bench.common import goal, write_results

    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="tierkv-demo-"))
    server, target = serve(tmp)
    try:
        print(f"tierkv-server on {target} (cache in {tmp}, removed at the end)", flush=True)
        a = child("ingest", target, tmp)
        docs = "+".join(map(str, a["doc_tokens"]))
        print(
            f"process A: {a['ingested']} documents ({docs} tokens) ingested in {a['ingest_s']:.1f}s"
        )
        print(f"process A: {QUESTION_A.text} (all of them, {a['tokens']} tokens, TTFT ", end="")
        print(f"{a['ttft_s']:.2f}s)\n    -> {a['answer']}")
        rows = child("ask", target, tmp)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    show(rows)
    same = summary(rows)
    wall = time.perf_counter() - t0
    config = {"model": "smollm2", "dtype": DTYPE, "max_tokens": MAX_TOKENS, "chunk_size": CHUNK}
    goals = [
        goal("blend 1.0 answers equal full prefill", same, ">=", 1.0),
        goal("demo wall time", wall, "<=", 300, "s"),
    ]
    out = write_results("rag_demo", config | {"process_a": a}, rows, goals, draw(rows))
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("ingest", "ask"):
        (process_a if sys.argv[1] == "ingest" else process_b)(sys.argv[2])
    else:
        main()
