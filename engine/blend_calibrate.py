"""`tierkv-engine calibrate-blend --model M`: pick the blend rule M serves prompts in parts with.

On a sample of the pydoc task set (engine/blend_tasks.py; its own seed, not the benchmark's),
full prefill answers every question once; then each candidate (rule, ratio), cheapest first
(lowest ratio first, rules in RULES order within a ratio), answers them by blending. The first
candidate that meets all three targets is chosen: its first token equals full prefill's on at
least min_agreement of the questions, its answer (the reply's first line, normalised) equals
full prefill's on at least min_answer_agreement, and its accuracy is at least
min_relative_accuracy of full prefill's. The answer check is the strong one: the prompt gives
the reply's lead, so the first token (the answer's first digit or letter) agrees for nearly
every rule, while the rest of the value may not. A candidate stops as soon as it can no longer
meet the target. The result goes to M's cache entry
(engine/blend_gate.py), which `serve` and `LLM` read at start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tierkv.engine import blend_tasks
from tierkv.engine.blend_gate import Calibration, Trial, accepts, entry, model_digest
from tierkv.engine.kv_connector import KVConnector
from tierkv.engine.llm import LLM
from tierkv.engine.models import resolve
from tierkv.engine.sampling_params import SamplingParams

# Candidate rules, in the order tried within one ratio; those this engine does not accept
# (SamplingParams(blend_rule=...) refuses them) are skipped.
RULES = ("cacheblend", "legolink", "query_early", "query_late", "ape", "legolink+cacheblend")


@dataclass(slots=True)
class CalibrateConfig:
    questions: int = 40  # in the sample
    min_agreement: float = 0.95  # target: first token equal to full prefill's, share of questions
    min_answer_agreement: float = 0.9  # target: answer equal to full prefill's, share of questions
    min_relative_accuracy: float = 0.98  # target: accuracy / full prefill's accuracy
    ratios: tuple[float, ...] = (0.05, 0.15, 0.3, 0.5)  # candidate blend ratios
    rules: tuple[str, ...] = ()  # candidate rules; () = every one in RULES the engine accepts
    dtype: str = "fp32"  # the model's dtype while measuring
    doc_tokens: int = 250  # each document cut to this many tokens
    docs_per: tuple[int, ...] = (2, 3, 4, 5, 6)  # documents per question, in turn
    max_tokens: int = 12  # greedy tokens per answer
    seed: int = 1  # the sample (the benchmark uses seed 0)

    def __post_init__(self) -> None:
        if self.questions < 1 or self.max_tokens < 1 or self.doc_tokens < 16:
            raise ValueError("questions and max_tokens must be >= 1, doc_tokens >= 16")
        for name in ("min_agreement", "min_answer_agreement", "min_relative_accuracy"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.ratios or any(not 0.0 < r <= 1.0 for r in self.ratios):
            raise ValueError(f"ratios must be in (0, 1], got {self.ratios}")
        if not self.docs_per or any(k < 2 for k in self.docs_per):
            raise ValueError(f"docs_per must hold counts >= 2, got {self.docs_per}")
        bad = [r for r in self.rules if not accepts(r)]
        if bad:
            raise ValueError(f"rules {bad} are not ones this engine knows")


def candidates(cfg: CalibrateConfig) -> list[tuple[str, float]]:
    """(rule, ratio) pairs, cheapest first."""
    rules = [r for r in (cfg.rules or RULES) if accepts(r)]
    return [(rule, ratio) for ratio in sorted(set(cfg.ratios)) for rule in rules]


def params_of(rule: str, ratio: float, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, blend_ratio=ratio, blend_rule=rule
    )


def calibrate(
    model: str,
    cfg: CalibrateConfig,
    connector: KVConnector,
    out: Path | None = None,
    progress: bool = True,
) -> tuple[Calibration, Path]:
    """Measure, choose, write (to out, else the model's cache entry); returns what was written
    and where. connector: the one the blends store and load their segments through (the entry
    point wires it in and closes it: the engine does not import the connector)."""
    src = Path(resolve(model))
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such model file or checkpoint directory")
    digest = model_digest(src)
    common: dict[str, Any] = dict(
        dtype=cfg.dtype, kv_cache_bytes=384 << 20, blend_calibration="off"
    )
    full = LLM(str(src), enable_prefix_caching=False, **common)
    if full.tokenizer is None:
        raise ValueError(f"{src}: calibration needs the model's tokenizer")
    tok = full.tokenizer
    encode = lambda s: tok.encode(s, add_special_tokens=False)
    count = lambda s: len(encode(s))
    sample = blend_tasks.tasks(count, cfg.questions, cfg.docs_per, cfg.doc_tokens, cfg.seed)
    prompts = [blend_tasks.prompt(encode, t) for t in sample]
    blend = LLM(str(src), kv_connector=connector, max_num_batched_tokens=4096, **common)
    greedy = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0)
    ref = [full.generate(flat, greedy, use_tqdm=False)[0] for flat, _ in prompts]
    full_right = sum(blend_tasks.correct(r.text or "", t) for r, t in zip(ref, sample))
    n = len(sample)
    allowed_misses = n - math.ceil(cfg.min_agreement * n - 1e-9)
    allowed_other = n - math.ceil(cfg.min_answer_agreement * n - 1e-9)
    need_right = math.ceil(cfg.min_relative_accuracy * full_right - 1e-9)
    cal = Calibration(
        digest,
        cfg.dtype,
        cfg.min_agreement,
        cfg.min_relative_accuracy,
        full_right / n,
        n,
        min_answer_agreement=cfg.min_answer_agreement,
    )
    bar = tqdm(candidates(cfg), desc="calibrate-blend", disable=not progress)
    for rule, ratio in bar:
        sp = params_of(rule, ratio, cfg.max_tokens)
        agree = same = right = done = 0
        for (_, parts), task, r in zip(prompts, sample, ref):
            o = blend.generate(parts, sp, use_tqdm=False)[0]
            if not o.metrics.blend:
                raise RuntimeError(
                    "calibrate-blend: a trial ran as a plain prompt, not blended; its connector "
                    "must store parts on first sight (ConnectorConfig.segment_admit_after=1)"
                )
            done += 1
            agree += o.token_ids[:1] == r.token_ids[:1]
            same += blend_tasks.answer(o.text or "") == blend_tasks.answer(r.text or "")
            right += blend_tasks.correct(o.text or "", task)
            if (
                done - agree > allowed_misses
                or done - same > allowed_other
                or right + n - done < need_right
            ):
                break  # can no longer meet the target
        met = done == n and done - agree <= allowed_misses and done - same <= allowed_other
        met = met and right >= need_right
        trial = Trial(rule, ratio, done, agree / done, right / done, met, same / done)
        cal.trials.append(trial)
        bar.set_postfix_str(f"{rule}@{ratio:g}: agree {agree}/{done}, same {same}, right {right}")
        if met:
            cal.rule, cal.ratio = rule, ratio
            break
    bar.close()
    path = out or entry(src, digest)
    path.write_text(cal.to_json())
    return cal, path
