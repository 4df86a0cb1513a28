"""Engine updates -> OpenAI response bodies: incremental detokenization with stop strings,
logprobs in the completions and chat shapes, and usage with cached tokens by source."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tierkv.engine.serve.engine_loop import Update
from tierkv.engine.tokenizer import Tokenizer


@dataclass(slots=True)
class Choice:
    """One choice's output so far. Text is decoded from all its tokens each time (exact at
    multi-byte and merge boundaries) and released only when no stop string could still begin
    in it."""

    index: int
    tokenizer: Tokenizer | None
    stop: list[str]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    text: str = ""  # final text, up to a stop string
    sent: int = 0  # characters of text already sent
    finish_reason: str | None = None

    def feed(self, up: Update) -> tuple[str, int]:
        """Add an update; returns (new text to send, how many of its tokens were consumed).
        finish_reason is set when the engine finished the sample or a stop string matched."""
        if self.finish_reason is not None:  # a stop string ended it: what follows is dropped
            return "", 0
        start = len(self.token_ids)
        self.token_ids += up.token_ids
        self.logprobs += up.logprobs
        full = self._decode(self.token_ids)
        final = up.finish_reason is not None
        for s in self.stop:
            at = full.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                full, final, self.finish_reason = full[:at], True, "stop"
        if final and self.finish_reason is None:
            self.finish_reason = up.finish_reason
        hold = 0 if final else max([len(s) - 1 for s in self.stop] + [0])
        if not final and full.endswith("\ufffd"):  # an incomplete UTF-8 character
            hold = max(hold, 1)
        self.text = full
        end = max(self.sent, len(full) - hold)
        delta, self.sent = full[self.sent : end], end
        return delta, len(self.token_ids) - start

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def token_text(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False) if self.tokenizer else ""

    def completion_logprobs(self, start: int, end: int, offset: int) -> dict[str, Any]:
        """The completions API's shape for tokens [start, end)."""
        toks = [self.token_text(t) for t in self.token_ids[start:end]]
        offsets, at = [], offset
        for t in toks:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": toks,
            "token_logprobs": [lp for lp, _ in self.logprobs[start:end]],
            "top_logprobs": [
                {self.token_text(t): v for t, v in top} for _, top in self.logprobs[start:end]
            ],
            "text_offset": offsets,
        }

    def chat_logprobs(self, start: int, end: int) -> dict[str, Any]:
        """The chat API's shape for tokens [start, end)."""
        return {
            "content": [
                {**self._entry(t, lp), "top_logprobs": [self._entry(a, b) for a, b in top]}
                for t, (lp, top) in zip(self.token_ids[start:end], self.logprobs[start:end])
            ],
            "refusal": None,
        }

    def _entry(self, t: int, lp: float) -> dict[str, Any]:
        s = self.token_text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}


def usage(finals: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The OpenAI usage block over a request's samples (prompts counted once each), with
    tierkv's split of the cached prompt tokens by source."""
    prompt = sum(u["prompt_tokens"] for u in finals[::n])
    completion = sum(u["completion_tokens"] for u in finals)
    by_source: dict[str, int] = {"prefix_cache": 0}
    for u in finals[::n]:
        by_source["prefix_cache"] += u["prefix_cache_tokens"]
        loaded = dict(u["loaded_tokens"])
        rest = u["connector_tokens"] - sum(loaded.values())  # a blend's segments, recomputed
        if rest > 0:
            loaded["connector"] = loaded.get("connector", 0) + rest
        for k, v in loaded.items():
            by_source[k] = by_source.get(k, 0) + v
    cached = sum(u["prefix_cache_tokens"] + u["connector_tokens"] for u in finals[::n])
    blend = {u["blend"] for u in finals if u.get("blend")}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": None,
        # tierkv's extension: where the cached tokens came from (prefix_cache = this replica's
        # blocks; cpu/disk/gpu = its connector's local tiers; remote/redis = the shared store)
        "cached_tokens_by_source": by_source,
        # a prompt in parts (documents): the blend rule it ran with ("cacheblend@0.15"), or
        # "uncalibrated" (no calibration met its target: prefix reuse, no blend)
        **({"blend": ",".join(sorted(blend))} if blend else {}),
    }


@dataclass(slots=True)
class Shaper:
    """The envelope of every body of one response."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def body(self, choices: list[dict[str, Any]], stream: bool, use: Any = None) -> dict[str, Any]:
        obj = (
            ("chat.completion.chunk" if stream else "chat.completion")
            if self.chat
            else ("text_completion")
        )
        out = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if use is not None or not stream:
            out["usage"] = use
        return out

    def choice(
        self,
        c: Choice,
        text: str,
        start: int,
        end: int,
        offset: int,
        logprobs: bool,
        final: bool,
        stream: bool,
    ) -> dict[str, Any]:
        lp: Any = None
        if logprobs:
            lp = (
                c.chat_logprobs(start, end)
                if self.chat
                else c.completion_logprobs(start, end, offset)
            )
        reason = c.finish_reason if final else None
        if not self.chat:
            return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": reason}
        if stream:
            delta = {"content": text} if text else {}
            return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        msg = {"role": "assistant", "content": text, "refusal": None}
        return {"index": c.index, "message": msg, "logprobs": lp, "finish_reason": reason}
