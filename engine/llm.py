"""LLM: the offline API. generate() runs schedule -> forward -> sample -> postprocess steps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from tqdm import tqdm

from tierkv.engine.blend import BlendParams, PromptPart, join_parts
from tierkv.engine.block_manager import BlockManager
from tierkv.engine.config import EngineConfig, ModelConfig
from tierkv.engine.kv_connector import KVConnector, NoOpConnector
from tierkv.engine.loader import load_model
from tierkv.engine.model_runner import ModelRunner
from tierkv.engine.sampler import sample
from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.scheduler import Scheduler
from tierkv.engine.sequence import Sequence
from tierkv.engine.tokenizer import Message

# One prompt: text, token ids, or PromptParts (a CacheBlend prompt in parts).
Prompt = str | list[int] | list[PromptPart]


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    tokens: int = 0  # computed through the model
    kv_slots: int = 0  # allocated KV slots, summed over steps
    kv_slots_empty: int = 0  # of those, slots holding no token

    @property
    def kv_unused_share(self) -> float:
        return self.kv_slots_empty / self.kv_slots if self.kv_slots else 0.0


@dataclass(slots=True)
class RequestMetrics:
    ttft: float  # seconds from arrival to the first token
    decode_time: float  # seconds from the first token to the last
    prompt_tokens: int
    cached_tokens: int  # hit in the local prefix cache
    external_tokens: int  # loaded through the connector
    computed_tokens: int  # run through the model (prefill, decode and any recompute)
    preemptions: int
    connector: dict[str, Any] = field(
        default_factory=dict
    )  # the connector's own report (per tier, ...)
    blend: dict[str, Any] = field(
        default_factory=dict
    )  # a blend prefill's report (loaded, recomputed, ...)


@dataclass(slots=True)
class Completion:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: RequestMetrics


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]  # one per sample (SamplingParams.n)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics


def token_logprobs(row: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's (unscaled) log-probability of token, and its k most likely tokens."""
    lp = row.float().log_softmax(-1)
    top = lp.topk(k) if k else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return float(lp[token]), pairs


class LLM:
    def __init__(
        self,
        model: str | Path | dict[str, Any] | ModelConfig,
        dtype: str = "auto",
        kv_cache_bytes: int = 1 << 30,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        kv_connector: KVConnector | None = None,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 256,
        max_model_len: int = 0,
        seed: int = 0,
        device: str = "cpu",
        blend_ratio: float = 0.15,
        blend_check_layer: int = 1,
        blend_metric: str = "k",
        blend_gradual: int = 0,
        matmul_dtype: str = "auto",
    ) -> None:
        self.config = EngineConfig(
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_bytes=kv_cache_bytes,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len,
            seed=seed,
            blend_ratio=blend_ratio,
            blend_check_layer=blend_check_layer,
            blend_metric=blend_metric,
            blend_gradual=blend_gradual,
            matmul_dtype=matmul_dtype,
        )
        # checks the global knobs now
        BlendParams(blend_ratio, blend_check_layer, blend_metric, blend_gradual)
        net, self.model_config, self.dtype, self.tokenizer = load_model(
            model, self.config.dtype, seed
        )
        self.device = torch.device(device)
        self.connector = kv_connector or NoOpConnector()
        self.runner = ModelRunner(
            net.to(self.device),
            self.model_config,
            self.config,
            self.dtype,
            self.connector,
            self.device,
        )
        self.blocks = BlockManager(self.runner.num_blocks, block_size, enable_prefix_caching)
        max_len = max_model_len or self.model_config.max_position_embeddings
        self.scheduler = Scheduler(
            self.config, self.blocks, self.connector, self.model_config.eos_token_id, max_len
        )
        self._rng = torch.Generator().manual_seed(seed)
        self._next_id = 0
        self._groups: dict[int, list[Sequence]] = {}
        self.stats = EngineStats()

    def _new_seq(
        self,
        group: int,
        rid: str,
        tokens: list[int],
        prompt_len: int,
        params: SamplingParams,
        index: int,
    ) -> Sequence:
        seed = (
            params.seed + index
            if params.seed is not None
            else int(torch.randint(1 << 62, (1,), generator=self._rng))
        )
        seq = Sequence(
            self._next_id,
            rid if index == 0 else f"{rid}/{index}",
            group,
            list(tokens),
            prompt_len,
            params,
            torch.Generator().manual_seed(seed),
            sample_index=index,
        )
        self._next_id += 1
        self._groups.setdefault(group, []).append(seq)
        return seq

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text prompt given but the model has no tokenizer; pass token ids")
        return self.tokenizer.encode(text)

    def _blend_params(self, params: SamplingParams) -> BlendParams:
        c = self.config
        ratio = c.blend_ratio if params.blend_ratio is None else params.blend_ratio
        layer = (
            c.blend_check_layer if params.blend_check_layer is None else params.blend_check_layer
        )
        return BlendParams(ratio, layer, c.blend_metric, c.blend_gradual)

    def ingest(
        self,
        segments: list[list[int]],
        prefix: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """Store the KV of each segment the connector lacks, once each, computed standalone
        (positions from 0) or, given the shared prefix, right after it, under cache_salt's keys;
        returns how many were computed. Needs a connector with segment support."""
        prefix = list(prefix or [])
        unique = list(dict.fromkeys(tuple(s) for s in segments))
        if any(not s for s in unique):
            raise ValueError("a segment must hold at least one token")
        present = self.connector.lookup_segments(
            [list(s) for s in unique], prefix or None, cache_salt
        )
        if present is None:
            raise ValueError("the engine's connector does not store segments")
        todo = [list(s) for s, p in zip(unique, present) if not p]
        one = SamplingParams(max_tokens=1, ignore_eos=True, cache_salt=cache_salt)
        base = self._next_id
        groups = [base + i for i in range(len(todo))]
        for g, toks in zip(groups, todo):
            seq = self.add_request(g, prefix + toks, one)
            seq.ingest, seq.prefix_len = True, len(prefix)
        while self.scheduler.has_work():
            self.step()
        self._drain_saves()
        for g in groups:
            self._groups.pop(g, None)
        self.connector.flush()
        return len(todo)

    def add_request(self, group: int, prompt: Prompt, params: SamplingParams) -> Sequence:
        spans, prefix_len = None, 0
        if isinstance(prompt, str):
            prompt = self._encode(prompt)
        elif prompt and all(isinstance(s, PromptPart) for s in prompt):
            prompt, spans, prefix_len = join_parts(cast("list[PromptPart]", prompt), self._encode)
        vocab = self.model_config.vocab_size
        if not prompt or any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt must be a non-empty list of token ids in [0, {vocab})")
        tokens = cast("list[int]", prompt)  # every element checked just above
        seq = self._new_seq(group, str(group), tokens, len(tokens), params, 0)
        if spans is not None and self.connector.lookup_segments([]) is not None:
            seq.segments, seq.blend, seq.prefix_len = spans, self._blend_params(params), prefix_len
        try:
            self.scheduler.add(seq)
        except ValueError:
            del self._groups[group]
            raise
        seq.metrics.arrival_time = time.perf_counter()
        return seq

    def step(self) -> int:
        """One engine step; returns the number of tokens it computed."""
        out = self.scheduler.schedule()
        if not out.seqs:
            raise RuntimeError(
                "nothing fits: a single sequence needs more KV blocks than the cache holds"
            )
        logits = self.runner.run(out)
        samplers = [s for s, smp in zip(out.seqs, out.samples()) if smp]
        rows, seqs, children = [], [], []
        for i, seq in enumerate(samplers):
            rows.append(i)
            seqs.append(seq)
            if seq.params.n > 1 and seq.sample_index == 0 and seq.num_output_tokens == 0:
                for k in range(1, seq.params.n):  # the other samples share this prompt's KV
                    child = self._new_seq(
                        seq.group_id,
                        seq.request_id,
                        seq.token_ids,
                        seq.num_prompt_tokens,
                        seq.params,
                        k,
                    )
                    children.append((seq, child))
                    rows.append(i)
                    seqs.append(child)
        tokens = dict(zip((s.seq_id for s in seqs), sample(logits[rows], seqs))) if seqs else {}
        logprobs = {
            s.seq_id: token_logprobs(logits[r], tokens[s.seq_id], s.params.logprobs)
            for r, s in zip(rows, seqs)
            if s.params.logprobs is not None
        }
        saved, _loaded = self.connector.get_finished()
        failed = self.connector.get_block_ids_with_load_errors()
        now = time.perf_counter()
        done = self.scheduler.postprocess(out, tokens, failed, children)
        for s in seqs:
            if s.num_output_tokens == 1 and not s.metrics.first_token_time:
                s.metrics.first_token_time = now
            if s.seq_id in logprobs and len(s.logprobs) < s.num_output_tokens:
                s.logprobs.append(logprobs[s.seq_id])  # not when a failed load dropped the sample
        for s in done:
            s.metrics.finish_time = now
            s.metrics.connector = self.connector.request_metrics(s.request_id)
        self.scheduler.release_saved(saved)
        used, empty = self.scheduler.kv_slots()
        st = self.stats
        st.steps, st.tokens, st.kv_slots, st.kv_slots_empty = (
            st.steps + 1,
            st.tokens + out.num_tokens,
            st.kv_slots + used,
            st.kv_slots_empty + empty,
        )
        return out.num_tokens

    def abort(self, group: int, sample: int | None = None) -> None:
        """Stop a request added by add_request: its unfinished samples (or only sample index
        `sample`, which then stays for _output) leave the queues with their blocks freed and
        finish_reason "abort". Without `sample` the request is also forgotten."""
        seqs = self._groups.get(group, [])
        if sample is None:
            self._groups.pop(group, None)
        live = [s for s in seqs if not s.is_finished and sample in (None, s.sample_index)]
        self.scheduler.abort(live)
        now = time.perf_counter()
        for s in live:
            s.metrics.finish_time = now
            s.metrics.connector = self.connector.request_metrics(s.request_id)

    def _drain_saves(self, timeout: float = 60.0) -> None:
        """Wait for the connector to finish saves it holds blocks for, then free them."""
        deadline = time.monotonic() + timeout
        while self.scheduler.held:
            self.scheduler.release_saved(self.connector.get_finished()[0])
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"connector still holds {len(self.scheduler.held)} finished requests"
                )
            time.sleep(0.001)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        # One prompt or a list of them, told apart by the first element.
        one = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, PromptPart))
        )
        batch = cast("list[Prompt]", [prompts] if one else prompts)
        segmented = [p for p in batch if isinstance(p, list) and p and isinstance(p[0], PromptPart)]
        if segmented and self.connector.lookup_segments([]) is not None:
            # Each reusable segment's KV must be stored before a blend can load it: standalone,
            # or after the prompt's shared prefix.
            docs: dict[tuple[int, ...], list[list[int]]] = {}
            for parts in segmented:
                toks, spans, n = join_parts(parts, self._encode)
                docs.setdefault(tuple(toks[:n]), []).extend(
                    toks[a:b] for a, b, reusable in spans if reusable
                )
            for prefix, segs in docs.items():
                self.ingest(segs, list(prefix))
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"{len(plist)} sampling params for {len(batch)} prompts")
        base = self._next_id
        groups = []
        for i, (p, sp) in enumerate(zip(batch, plist)):
            groups.append(base + i)
            self.add_request(base + i, p, sp)
        total = sum(sp.n for sp in plist)
        bar = tqdm(total=total, desc="generate", disable=not use_tqdm)
        finished = 0
        while self.scheduler.has_work():
            self.step()
            now_done = sum(s.is_finished for g in groups for s in self._groups[g])
            bar.update(now_done - finished)
            finished = now_done
        bar.close()
        self._drain_saves()
        return [self._output(g) for g in groups]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Reply to one conversation ([{"role", "content"}, ...]) or to a list of them, each
        rendered by the checkpoint's chat template; replies end at the checkpoint's EOS."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer and chat template; this model has none")
        one = bool(messages) and isinstance(messages[0], dict)
        convs = cast("list[list[Message]]", [messages] if one else messages)
        prompts: list[Prompt] = [self.chat_prompt(c) for c in convs]
        return self.generate(prompts, params, use_tqdm)

    def chat_prompt(self, messages: list[Message]) -> list[int]:
        """The token ids of messages rendered by the chat template, ready for the reply."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer and chat template; this model has none")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _output(self, group: int) -> RequestOutput:
        seqs = sorted(self._groups.pop(group), key=lambda s: s.sample_index)
        outs = []
        for s in seqs:
            m = s.metrics
            text = self.tokenizer.decode(s.output_ids) if self.tokenizer is not None else None
            outs.append(
                Completion(
                    s.output_ids,
                    text,
                    s.finish_reason or "length",
                    RequestMetrics(
                        m.first_token_time - m.arrival_time,
                        m.finish_time - m.first_token_time,
                        s.num_prompt_tokens,
                        m.num_cached_tokens,
                        m.num_external_tokens,
                        m.num_computed_tokens,
                        m.num_preemptions,
                        m.connector,
                        m.blend,
                    ),
                )
            )
        return RequestOutput(
            seqs[0].request_id, seqs[0].token_ids[: seqs[0].num_prompt_tokens], outs
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
