"""The blend quality gate: which rule a prompt in parts blends with, by the model's calibration.

`tierkv-engine calibrate-blend --model M` measures blend rules on M itself and writes the
cheapest (rule, ratio) that met its target into M's cache entry: `blend-<sha256>.json` beside
the model file (for a checkpoint directory, inside it), where sha256 is the model file's
(a directory's: of its config.json and weight files' digests). JSON, never pickle.

`EngineConfig.blend_calibration` ("auto", "off" or a calibration file's path) decides:
- a request that sets blend_ratio (or blend_rule) blends as asked, whatever the calibration;
- "off": every other prompt in parts blends with the engine's own blend_* knobs;
- "auto" / a path: with a calibration whose target was met, the calibrated rule and ratio;
  without one (no file, a model with no cache entry such as random weights, no candidate met
  the target, or, for "auto", a cache entry of an older format version) the prompt falls back
  to prefix reuse: it runs as the plain prompt of its tokens (prefix-cached and stored as any
  other), and the log says so once.
Each such response's usage names the choice: "cacheblend@0.15", or "uncalibrated".
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tierkv.engine.blend import BlendParams
from tierkv.engine.config import EngineConfig
from tierkv.engine.intake import blend_params
from tierkv.engine.models import sha256
from tierkv.engine.sampling_params import SamplingParams

log = logging.getLogger("tierkv.engine")

FORMAT, VERSION = "tierkv-blend-calibration", 2
BASE_RULE = "cacheblend"  # the rule blend_ratio alone selects: K deviation at the check layer
UNCALIBRATED = "uncalibrated"


class StaleCalibration(ValueError):
    """A calibration file of another format version: measured by other rules, so not used."""


@dataclass(slots=True)
class Trial:
    """One candidate's measurement on the calibration sample."""

    rule: str
    ratio: float
    questions: int  # answered before it met or missed the target for sure
    first_token_agreement: float  # share whose first token equals full prefill's
    accuracy: float  # share answered right
    met: bool
    answer_agreement: float = 0.0  # share whose answer (the reply's first line) equals full's


@dataclass(slots=True)
class Calibration:
    model_sha256: str  # of the model file the trials ran on
    dtype: str  # the dtype they ran in
    min_agreement: float  # target: first-token agreement with full prefill
    min_relative_accuracy: float  # target: accuracy / full prefill's accuracy
    full_accuracy: float  # full prefill's accuracy on the sample
    questions: int  # in the sample
    trials: list[Trial] = field(default_factory=list)  # cheapest first
    rule: str | None = None  # the cheapest trial that met the target; None: none did
    ratio: float | None = None
    min_answer_agreement: float = 0.0  # target: the answer equal to full prefill's

    @property
    def label(self) -> str:
        return UNCALIBRATED if self.rule is None else label(self.rule, self.ratio or 0.0)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "calibration") -> Calibration:
        """Parse and check; ValueError naming the bad field."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{where}: not a {FORMAT} file (field 'format')")
        if d.get("version") != VERSION:
            raise StaleCalibration(f"{where}: version {d.get('version')!r}, expected {VERSION}")
        sha = _get(d, "model_sha256", str, where)
        if not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise ValueError(f"{where}: 'model_sha256' must be 64 hex digits")
        trials = []
        for i, t in enumerate(_get(d, "trials", list, where)):
            w = f"{where}: trials[{i}]"
            if not isinstance(t, dict):
                raise ValueError(f"{w} must be an object")
            trials.append(
                Trial(
                    _rule(_get(t, "rule", str, w), w),
                    _share(t, "ratio", w),
                    _count(t, "questions", w),
                    _share(t, "first_token_agreement", w),
                    _share(t, "accuracy", w),
                    _get(t, "met", bool, w),
                    _share(t, "answer_agreement", w),
                )
            )
        rule, ratio = d.get("rule"), d.get("ratio")
        if (rule is None) != (ratio is None):
            raise ValueError(f"{where}: 'rule' and 'ratio' are both set or both null")
        if rule is not None:
            _rule(_get(d, "rule", str, where), where)
            ratio = _share(d, "ratio", where)
            if not any(t.met and (t.rule, t.ratio) == (rule, ratio) for t in trials):
                raise ValueError(f"{where}: 'rule' {rule}@{ratio:g} is no trial that met")
        return cls(
            sha,
            _get(d, "dtype", str, where),
            _share(d, "min_agreement", where),
            _share(d, "min_relative_accuracy", where),
            _share(d, "full_accuracy", where),
            _count(d, "questions", where),
            trials,
            rule,
            ratio,
            _share(d, "min_answer_agreement", where),
        )


def _get(d: dict[str, Any], name: str, kind: type, where: str) -> Any:
    v = d.get(name)
    if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        raise ValueError(f"{where}: field {name!r} must be a {kind.__name__}, got {v!r}")
    return v


def _share(d: dict[str, Any], name: str, where: str) -> float:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
        raise ValueError(f"{where}: field {name!r} must be a number in [0, 1], got {v!r}")
    return float(v)


def _count(d: dict[str, Any], name: str, where: str) -> int:
    v = _get(d, name, int, where)
    if v < 1:
        raise ValueError(f"{where}: field {name!r} must be >= 1, got {v}")
    return v


def _rule(v: str, where: str) -> str:
    if not re.fullmatch(r"[a-z_]+(\+[a-z_]+)*", v):
        raise ValueError(f"{where}: field 'rule' {v!r} is not a rule name")
    return v


def label(rule: str, ratio: float) -> str:
    return f"{rule}@{ratio:g}" if math.isfinite(ratio) else rule


def model_digest(model: Path) -> str:
    """sha256 of a model file; of a checkpoint directory, of its config.json and weight files'
    names and digests."""
    if model.is_file():
        return sha256(model)
    h = hashlib.sha256()
    for f in sorted(model.iterdir()):
        if f.name == "config.json" or f.suffix in (".safetensors", ".gguf", ".bin"):
            h.update(f"{f.name}:{sha256(f)}\n".encode())
    return h.hexdigest()


def entry(model: Path, digest: str) -> Path:
    """Where the model's calibration lives in its cache entry."""
    return (model if model.is_dir() else model.parent) / f"blend-{digest}.json"


def load(path: Path, digest: str | None) -> Calibration:
    """A calibration file, refused (ValueError) when malformed or for another model."""
    cal = Calibration.from_json(path.read_text(), str(path))
    if digest is not None and cal.model_sha256 != digest:
        raise ValueError(
            f"{path}: a calibration of model sha256 {cal.model_sha256[:16]}..., not of this "
            f"model ({digest[:16]}...)"
        )
    return cal


def accepts(rule: str) -> bool:
    """Whether this engine's SamplingParams take the rule (the base rule always)."""
    if rule == BASE_RULE:
        return True
    try:
        SamplingParams(blend_rule=rule)
    except ValueError:
        return False
    return True


def known(cal: Calibration, where: str) -> Calibration:
    if cal.rule is not None and not accepts(cal.rule):
        raise ValueError(f"{where}: rule {cal.rule!r} is not one this engine knows")
    return cal


@dataclass(slots=True)
class BlendGate:
    """The engine's blend_calibration resolved once, at start."""

    mode: str  # "auto", "off" or the path of a calibration file
    calibration: Calibration | None = None  # the one that applies; None: none
    where: str = ""  # the file, or why there is none (for the log line)
    warned: bool = False

    @classmethod
    def open(cls, mode: str, model: Any) -> BlendGate:
        """mode for model (a path, or a random-weight config: no cache entry)."""
        if mode == "off":
            return cls(mode)
        src = Path(model) if isinstance(model, (str, Path)) else None
        digest = model_digest(src) if src is not None and src.exists() else None
        if mode != "auto":
            return cls(mode, known(load(Path(mode), digest), mode), mode)
        if digest is None or src is None:
            return cls(mode, None, "the model has no cache entry (random weights)")
        path = entry(src, digest)
        if not path.exists():
            return cls(mode, None, f"no {path.name} beside the model")
        try:
            return cls(mode, known(load(path, digest), str(path)), str(path))
        except StaleCalibration as e:
            return cls(mode, None, f"{e}; calibrate again")

    def choose(
        self, config: EngineConfig, params: SamplingParams
    ) -> tuple[BlendParams | None, str]:
        """A prompt in parts' blend parameters (None: prefix reuse) and its usage label."""
        if params.blend_ratio is None and params.blend_rule is None and self.mode != "off":
            cal = self.calibration
            if cal is None or cal.rule is None or cal.ratio is None:
                self.fallback()
                return None, UNCALIBRATED
            params = replace(params, blend_ratio=cal.ratio, blend_rule=cal.rule)
        bp = blend_params(config, params)
        return bp, label(params.blend_rule or config.blend_rule, bp.ratio)

    def fallback(self) -> None:
        """Log, once, that prompts in parts run as plain prompts (prefix reuse)."""
        if self.warned:
            return
        self.warned = True
        why = self.where if self.calibration is None else f"no rule met its target ({self.where})"
        log.warning(
            "blend: uncalibrated, %s; prompts in parts fall back to prefix reuse "
            "(run `tierkv-engine calibrate-blend --model M`, or blend_calibration='off')",
            why,
        )
