"""LLM: the offline API over the Engine. generate() and chat() add a batch of requests and
step the engine until they are done; ingest() stores segments' KV ahead of their reuse."""

from __future__ import annotations

import time
from typing import Any, cast

from tqdm import tqdm

from tierkv.engine.blend import PromptPart, join_parts
from tierkv.engine.blend_step import BlendState
from tierkv.engine.engine import Engine, Prompt
from tierkv.engine.outputs import RequestOutput
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
        segmented = [
            cast("list[PromptPart]", p)
            for p, sp in zip(batch, plist)
            if is_parts(p) and self.supports_segments and self.blend_choice(sp)[0] is not None
        ]
        if segmented:
            # Each reusable segment's KV must be stored before a blend can load it: standalone,
            # or after the prompt's shared prefix.
            docs: dict[tuple[int, ...], list[list[int]]] = {}
            for parts in segmented:
                prefix, segs = self.segments(parts)
                docs.setdefault(tuple(prefix), []).extend(segs)
            for prefix_ids, segs in docs.items():
                self.ingest(segs, list(prefix_ids))
        reqs = [self.add_request(None, p, sp, h) for p, sp, h in zip(batch, plist, hints)]
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
        ingest must store before the prompt can blend them."""
        tokens, spans, n = join_parts(parts, self.encode)
        return tokens[:n], [tokens[a:b] for a, b, reusable in spans if reusable]

    def ingest(
        self,
        segments: list[list[int]],
        prefix: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """Store the KV of each segment the connector lacks, once each, computed standalone
        (positions from 0) or, given the shared prefix, right after it, under cache_salt's keys;
        returns how many were computed. Steps the engine until idle: other requests advance
        meanwhile. Needs a connector with segment support."""
        prefix = list(prefix or [])
        unique = list(dict.fromkeys(tuple(s) for s in segments))
        if any(not s for s in unique):
            raise ValueError("a segment must hold at least one token")
        if not self.supports_segments:
            raise ValueError("the engine's connector does not store segments")
        present = self.connector.lookup_segments(
            [list(s) for s in unique], prefix or None, cache_salt
        )
        todo = [list(s) for s, p in zip(unique, present) if not p]
        one = SamplingParams(max_tokens=1, ignore_eos=True, cache_salt=cache_salt)
        p = len(prefix)
        for toks in todo:
            req = self.add_request(None, prefix + toks, one)
            req.seqs[0].blend = BlendState([(p, p + len(toks), True)], p, ingest=True)
        while self.has_unfinished():
            self.step()
        self.drain_saves()
        self.connector.flush()
        return len(todo)

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
