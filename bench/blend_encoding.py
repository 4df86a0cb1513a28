"""CacheBlend's part encodings compared (`python -m bench.blend_encoding`).

SmolLM2-135M-Instruct in fp32; 4 pydoc pages of about 200 tokens (real text that ships with
Python), shuffled per question, with no declared prefix; each page's KV stored standalone
(blend_encoding="standalone": its first token an attention sink) or after the chat preamble
("preamble", the default). KL of the next-token distribution against full prefill of the same
tokens at ratios 0 and 0.15, two prompt shapes: "chat" (the chat template's head, computed,
then the pages and the question) and "bare" (the pages first). Prints a table; writes nothing.
"""

from __future__ import annotations

import random
import statistics

import torch

from examples.rag_docs import cut, module_doc
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, PromptPart, SamplingParams
from tierkv.engine.models import pull
from tierkv.storage_backends.build import TiersConfig

MODULES = ["zlib", "colorsys", "textwrap", "uuid"]
QUESTIONS = [
    "What does zlib.crc32 compute?",
    "Which color systems does colorsys convert between?",
    "What is the default width of textwrap.TextWrapper?",
    "Which RFC do the uuid objects follow?",
]
RATIOS = [0.0, 0.15]


def last_logits(llm: LLM, prompt, ratio: float | None) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    llm.logits_hooks.append(lambda logits: seen.append(logits[-1].clone()))
    p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, blend_ratio=ratio)
    llm.generate([prompt], p, use_tqdm=False)
    llm.logits_hooks.clear()
    return seen[-1]


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(full prefill || blend) of the next-token distribution."""
    return float(
        torch.nn.functional.kl_div(
            q.log_softmax(-1), p.log_softmax(-1), log_target=True, reduction="sum"
        )
    )


def main() -> None:
    path = str(pull("smollm2", progress=False))
    cold = LLM(path, dtype="fp32", kv_cache_bytes=64 << 20, enable_prefix_caching=False)
    tok = cold.tokenizer
    assert tok is not None

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False)

    docs = [enc(cut(module_doc(m), lambda s: len(enc(s)), 200) + "\n\n") for m in MODULES]
    head = list(cold.segment_preamble)
    rng = random.Random(0)
    orders = [rng.sample(range(len(docs)), len(docs)) for _ in QUESTIONS]
    tails = [enc(f"Question: {q}<|im_end|>\n<|im_start|>assistant\n") for q in QUESTIONS]
    print(f"pages: {[len(d) for d in docs]} tokens; preamble {len(head)} tokens")
    rows: dict[tuple[str, str, float], list[float]] = {}
    for encoding in ("standalone", "preamble"):
        conn = TierKVConnector(
            ConnectorConfig(tiers=TiersConfig(cpu_bytes="256MiB"), segment_admit_after=1)
        )
        llm = LLM(
            path,
            dtype="fp32",
            kv_cache_bytes=64 << 20,
            enable_prefix_caching=False,
            kv_connector=conn,
            blend_encoding=encoding,
        )
        for shape in ("chat", "bare"):
            for order, tail in zip(orders, tails):
                lead = head if shape == "chat" else []
                flat = lead + sum((docs[i] for i in order), []) + tail
                ref = last_logits(cold, flat, None)
                parts = [PromptPart(lead, reusable=False)] if lead else []
                parts += [PromptPart(docs[i]) for i in order] + [PromptPart(tail, reusable=False)]
                for r in RATIOS:
                    got = last_logits(llm, parts, r)
                    rows.setdefault((shape, encoding, r), []).append(kl(ref, got))
        conn.close()
    print("| prompt | encoding | " + " | ".join(f"KL at {r}" for r in RATIOS) + " |")
    print("|---|---|" + "---|" * len(RATIOS))
    for shape in ("chat", "bare"):
        for encoding in ("standalone", "preamble"):
            cells = [f"{statistics.mean(rows[shape, encoding, r]):.4f}" for r in RATIOS]
            print(f"| {shape} | {encoding} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
