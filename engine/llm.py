"""LLM: the offline API over the Engine. generate() and chat() add a batch of requests and
step the engine until they are done; ingest() stores segments' KV ahead of their reuse."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, cast

from tqdm import tqdm

from tierkv.engine.blend import PromptPart, join_parts
from tierkv.engine.blend_step import BlendState
from tierkv.engine.engine import Engine, Prompt
from tierkv.engine.outputs import Request, RequestOutput
from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.tokenizer import Message
from tierkv.storage_backends.hints import KVHint, parse_hint

# One workflow hint for every prompt, or one per prompt (None: unhinted); a hint is a KVHint or
# its JSON form (a dict, checked by parse_hint: HintError names the bad field).
Hints = KVHint | dict[str, Any] | list[KVHint | dict[str, Any] | None] | None


def hints_for(kv_hints: Hints, n: int) -> list[KVHint | None]:
    """kv_hints as one KVHint (or None) per prompt; raises HintError or ValueError, changing
    nothing, when one is malformed or the count is off."""
    if not isinstance(kv_hints, list):
        kv_hints = [kv_hints] * n
    elif len(kv_hints) != n:
        raise ValueError(f"{len(kv_hints)} kv_hints for {n} prompts")
    return [
        h if h is None or isinstance(h, KVHint) else parse_hint(h, f"kv_hints[{i}]")
        for i, h in enumerate(kv_hints)
    ]


def is_parts(prompt: Prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], PromptPart)


def plain_prefill(req: Request) -> None:
    """A prompt in parts none of whose segments is stored: prefilled as a plain prompt (in
    chunks, with other sequences), its KV still never stored under prefix keys."""
    for seq in req.seqs:
        if seq.blend is not None:
            seq.blend.params = None


class LLM(Engine):
    """The offline front end: batches of prompts or conversations, and the segments a prompt
    in parts reuses, stored ahead (ingest)."""

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        kv_hints: Hints = None,
    ) -> list[RequestOutput]:
        """kv_hints: the workflow step of the prompts (docs/workflows.md), advice only: the
        outputs are the same with or without."""
        # One prompt or a list of them, told apart by the first element.
        one = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, PromptPart))
        )
        batch = cast("list[Prompt]", [prompts] if one else prompts)
        hints = hints_for(kv_hints, len(batch))  # checked before anything runs
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"{len(plist)} sampling params for {len(batch)} prompts")
        # the prompts that blend; the others (no calibration) are the plain prompt of their tokens
        at = [
            i
            for i, (p, sp) in enumerate(zip(batch, plist))
            if is_parts(p) and self.supports_segments and self.blend_choice(sp)[0] is not None
        ]
        parts = [cast("list[PromptPart]", batch[i]) for i in at]
        held = dict(zip(at, self.store_parts(parts, [plist[i].cache_salt for i in at])))
        reqs = [self.add_request(None, p, sp, h) for p, sp, h in zip(batch, plist, hints)]
        for i, req in enumerate(reqs):
            if not held.get(i, True):  # none of its segments stored: a plain prefill
                plain_prefill(req)
        bar = tqdm(total=sum(sp.n for sp in plist), desc="generate", disable=not use_tqdm)
        finished = 0
        while self.has_unfinished():
            self.step()
            now_done = sum(s.is_finished for r in reqs for s in r.seqs)
            bar.update(now_done - finished)
            finished = now_done
        bar.close()
        self.drain_saves()
        return [self.output(r) for r in reqs]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        kv_hints: Hints = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation ([{"role", "content"}, ...]) or to a list of them, each
        rendered by the checkpoint's chat template; replies end at the checkpoint's EOS."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer and chat template; this model has none")
        one = bool(messages) and isinstance(messages[0], dict)
        convs = cast("list[list[Message]]", [messages] if one else messages)
        prompts: list[Prompt] = [self.chat_prompt(c) for c in convs]
        return self.generate(prompts, params, use_tqdm, kv_hints)

    def chat_prompt(self, messages: list[Message]) -> list[int]:
        """The token ids of messages rendered by the chat template, ready for the reply."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer and chat template; this model has none")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def segments(self, parts: list[PromptPart]) -> tuple[list[int], list[list[int]]]:
        """A prompt in parts as its declared shared prefix and its reusable segments: what
        ingest must store before the prompt can blend them (a repeated one once)."""
        tokens, spans, n = join_parts(parts, self.encode)
        segs = dict.fromkeys(tuple(tokens[a:b]) for a, b, reusable in spans if reusable)
        return tokens[:n], [list(s) for s in segs]  # each once: one sighting per prompt

    def ingest(
        self,
        segments: list[list[int]],
        prefix: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """Store the KV of each segment the connector lacks, once each, under cache_salt's keys:
        given the shared prefix, computed right after it; without one, after the engine's
        segment preamble (blend_encoding "preamble", its KV not stored) or standalone
        ("standalone", positions from 0). Returns how many were computed. Steps the engine
        until idle: other requests advance meanwhile. Needs a connector with segment support."""
        return self._ingest(segments, prefix, cache_salt, False)[0]

    def store_parts(
        self, prompts: list[list[PromptPart]], cache_salts: list[str | None] | None = None
    ) -> list[bool]:
        """What generate and the server do before adding prompts in parts: each prompt is a
        sighting of its reusable segments, and the ones the connector admits
        (ConnectorConfig.segment_admit_after) and lacks are stored (ingest), under each
        prompt's cache salt. Returns, per prompt, whether any of its segments is stored: one
        without runs as a plain prefill."""
        salts = cache_salts or [None] * len(prompts)
        groups: dict[tuple[tuple[int, ...], str | None], list[list[int]]] = {}
        split = [(*self.segments(p), salt) for p, salt in zip(prompts, salts)]
        for prefix, segs, salt in split:
            groups.setdefault((tuple(prefix), salt), []).extend(segs)
        held = {
            (prefix, salt): self._ingest(segs, list(prefix), salt, True)[1]
            for (prefix, salt), segs in groups.items()
        }
        return [any(tuple(s) in held[tuple(p), salt] for s in segs) for p, segs, salt in split]

    def _ingest(
        self,
        segments: list[list[int]],
        prefix: list[int] | None,
        cache_salt: str | None,
        admission: bool,
    ) -> tuple[int, set[tuple[int, ...]]]:
        """ingest; with admission each occurrence in segments is a sighting and only the
        admitted segments are stored. (segments computed, segments stored or held already)."""
        prefix = list(prefix or [])
        unique = list(dict.fromkeys(tuple(s) for s in segments))
        if any(not s for s in unique):
            raise ValueError("a segment must hold at least one token")
        if not self.supports_segments:
            raise ValueError("the engine's connector does not store segments")
        if not unique:
            return 0, set()
        pre = () if prefix else self.segment_preamble
        lead = prefix or list(pre)  # what each segment's KV is computed after
        present = self.connector.lookup_segments(
            [list(s) for s in unique], lead or None, cache_salt
        )
        admitted = [True] * len(unique)
        if admission:
            seen = Counter(tuple(s) for s in segments)
            admitted = self.connector.sight_segments(
                [list(s) for s in unique], lead or None, cache_salt, [seen[s] for s in unique]
            )
        todo = [list(s) for s, p, a in zip(unique, present, admitted) if a and not p]
        one = SamplingParams(max_tokens=1, ignore_eos=True, cache_salt=cache_salt)
        p = len(lead)
        for toks in todo:
            req = self.add_request(None, lead + toks, one)
            st = BlendState([(p, p + len(toks), True)], len(prefix), ingest=True, preamble=pre)
            req.seqs[0].blend = st
        while self.has_unfinished():
            self.step()
        self.drain_saves()
        self.connector.flush()
        held = {s for s, p in zip(unique, present) if p} | {tuple(t) for t in todo}
        return len(todo), held

    def drain_saves(self, timeout: float = 60.0) -> None:
        """Wait for the connector to finish saves it holds blocks for, then free them."""
        deadline = time.monotonic() + timeout
        while self.scheduler.held:
            self.scheduler.release_saved(self.connector.get_finished()[0])
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"connector still holds {len(self.scheduler.held)} finished requests"
                )
            time.sleep(0.001)
