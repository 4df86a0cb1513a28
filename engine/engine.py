"""Engine: the step API. add_request, then step() while has_unfinished(): each step schedules,
runs the model, samples and advances the requests. LLM (offline batches) and the HTTP server
are built on it; nothing outside the engine reaches into its scheduler or runner."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import fields, replace
from difflib import get_close_matches
from pathlib import Path
from typing import Any

import torch

from tierkv.engine.blend import BlendParams
from tierkv.engine.blend_gate import BlendGate
from tierkv.engine.blend_step import BlendState
from tierkv.engine.block_manager import BlockManager
from tierkv.engine.block_prefetch import BlockPrefetch
from tierkv.engine.config import EngineConfig, ModelConfig
from tierkv.engine.encoding import preamble
from tierkv.engine.intake import Prompt, new_seq, prompt_tokens
from tierkv.engine.kv_connector import KVConnector
from tierkv.engine.loader import load_model
from tierkv.engine.model_runner import ModelRunner
from tierkv.engine.models import resolve
from tierkv.engine.noop_connector import NoOpConnector
from tierkv.engine.outputs import EngineStats, Request, RequestOutput
from tierkv.engine.pacer import measure
from tierkv.engine.sampler import sample_step
from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.scheduler import Scheduler
from tierkv.engine.sequence import Sequence
from tierkv.engine.workflow import StepPrefetch
from tierkv.storage_backends.hints import KVHint

__all__ = ["Engine", "LogitsHook", "NoFit", "Prompt"]


# Called with each step's logits [sampling sequences, vocab] before sampling; observes only.
LogitsHook = Callable[[torch.Tensor], None]


def with_knobs(config: EngineConfig, knobs: dict[str, Any]) -> EngineConfig:
    """A copy of config with knobs (EngineConfig field names) set over it, checked as
    EngineConfig checks itself; an unknown name raises TypeError, naming it and the nearest."""
    names = [f.name for f in fields(EngineConfig)]
    for k in knobs:
        if k not in names:
            near = get_close_matches(k, names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(
                f"unknown engine knob {k!r}{hint}: the knobs are EngineConfig's fields, "
                "kv_connector and device"
            )
    return replace(config, **knobs)


class NoFit(RuntimeError):
    """Nothing could be scheduled: request_id, the head of the queue, needs more KV blocks than
    the cache holds."""

    def __init__(self, request_id: str | None) -> None:
        super().__init__(
            "nothing fits: a single sequence needs more KV blocks than the cache holds"
        )
        self.request_id = request_id


class Engine:
    def __init__(
        self,
        model: str | Path | dict[str, Any] | ModelConfig,
        config: EngineConfig | None = None,
        *,
        kv_connector: KVConnector | None = None,
        device: str = "cpu",
        **knobs: Any,
    ) -> None:
        """model: a checkpoint directory, a named model (engine/models.py), or a config of
        random weights. knobs: fields of EngineConfig (engine/config.py), set over config (or
        over the defaults); an unknown name raises TypeError, a bad value ValueError."""
        self.config = c = with_knobs(EngineConfig() if config is None else config, knobs)
        net, self.model_config, self.dtype, self.tokenizer = load_model(model, c.dtype, c.seed)
        # the tokens a reusable part without a declared prefix is encoded after; () standalone
        self.segment_preamble = preamble(self.tokenizer) if c.blend_encoding == "preamble" else ()
        self.blend_gate = BlendGate.open(
            c.blend_calibration, resolve(model) if isinstance(model, str) else model
        )
        self.device = torch.device(device)
        self.connector = kv_connector or NoOpConnector()
        self.runner = ModelRunner(
            net.to(self.device),
            self.model_config,
            c,
            self.dtype,
            self.connector,
            self.device,
        )
        self.blocks = BlockManager(
            self.runner.num_blocks, c.block_size, c.enable_prefix_caching, c.eviction
        )
        self.steps = StepPrefetch()  # workflow steps: the next step's agents' prompts
        self.max_model_len = c.max_model_len or self.model_config.max_position_embeddings
        self.scheduler = Scheduler(
            c,
            self.blocks,
            self.connector,
            self.model_config.eos_token_id,
            self.max_model_len,
            self.model_config.num_hidden_layers,
        )
        # the next step's agents' prompts, from the connector's local tier into free blocks (a
        # connector that knows its local tier: get_num_prefetched_tokens)
        local = type(self.connector).get_num_prefetched_tokens
        bp = c.block_prefetch if local is not KVConnector.get_num_prefetched_tokens else 0
        self.block_prefetch = BlockPrefetch(self.scheduler, bp)
        self.requests: dict[str, Request] = {}  # unfinished, by request id
        self.logits_hooks: list[LogitsHook] = []
        self.stats = EngineStats()
        self._rng = torch.Generator().manual_seed(c.seed)
        self._next_id = 0  # of the next sequence

    @property
    def num_running(self) -> int:
        """Sequences running (decoding or in prefill)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued, new or preempted."""
        return len(self.scheduler.waiting)

    @property
    def supports_segments(self) -> bool:
        """Whether prompts in parts reuse their segments' KV (the connector stores segments);
        without it they run as plain prompts."""
        return self.connector.supports_segments

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text prompt given but the model has no tokenizer; pass token ids")
        return self.tokenizer.encode(text)

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams,
        kv_hint: KVHint | None = None,
    ) -> Request:
        """Queue prompt for params.n samples; request_id None takes a number unique for the
        engine's life. A bad prompt raises ValueError and changes nothing. The Request returned
        is updated by every step. kv_hint (advice): the workflow step it runs for; it orders the
        prefix cache's eviction ("hinted") and prefetches the next step's agents' prompts."""
        rid = str(self._next_id) if request_id is None else request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is in use")
        tokens, spans, prefix_len = prompt_tokens(prompt, self.encode, self.model_config.vocab_size)
        req = Request(rid, list(tokens), params)
        seq = self._new_seq(req, 0)
        seq.kv_hint = kv_hint
        if spans is not None and self.supports_segments:
            blend, seq.metrics.blend_rule = self.blend_choice(params)
            if blend is not None:  # else prefix reuse: the plain prompt of its tokens
                pre = () if prefix_len else self.segment_preamble
                seq.blend = BlendState(spans, prefix_len, blend, preamble=pre)
        self.scheduler.add(seq)
        self.requests[rid] = req
        seq.metrics.arrival_time = time.perf_counter()
        if kv_hint is not None:  # a workflow step starts (engine/workflow.py)
            c = self.config
            sent = self.steps.start(
                kv_hint, tokens, params.cache_salt, self.blocks, self.connector, c.workflow_prefetch
            )
            for ids, hint, salt in sent:
                self.block_prefetch.want(ids, salt, hint)
        return req

    def step(self) -> list[Request]:
        """One engine step. Returns the requests that sampled or finished in it; a finished
        request leaves the engine. Raises NoFit when the head of the queue can never fit."""
        if not self.has_unfinished():
            return []
        start = time.perf_counter()
        self.block_prefetch.issue()  # loads in this step's forward, with the step's own
        out = self.scheduler.schedule()
        if not out.seqs and not out.layered:
            self.block_prefetch.cancel()
            head = self.scheduler.waiting[0] if self.scheduler.waiting else None
            raise NoFit(head.group if head is not None else None)
        logits = self.runner.run(out)
        for hook in self.logits_hooks:
            hook(logits)
        samplers = [s for s, smp in zip(out.seqs, out.samples()) if smp]
        seqs, children, tokens, logprobs = sample_step(logits, samplers, self._fork)
        saved, _loaded = self.connector.get_finished()
        failed = self.connector.get_block_ids_with_load_errors()
        self.block_prefetch.land(failed)  # before postprocess: its idle check sees every block
        now = time.perf_counter()
        done = self.scheduler.postprocess(out, tokens, failed, children)
        measure(self.scheduler.pacer, out, now - start)  # layered_gap's step times
        for s in seqs:
            if s.num_output_tokens == 1 and not s.metrics.first_token_time:
                s.metrics.first_token_time = now
            if s.seq_id in logprobs and len(s.logprobs) < s.num_output_tokens:
                s.logprobs.append(logprobs[s.seq_id])  # not when a failed load dropped the sample
        for s in done:
            s.metrics.finish_time = now
            s.metrics.connector = self.connector.request_metrics(s.request_id)
        self.scheduler.release_saved(saved)
        self.stats.add(out.num_tokens, *self.scheduler.kv_slots())
        updated = {s.group: self.requests[s.group] for s in seqs}
        for req in updated.values():
            if req.finished:
                del self.requests[req.request_id]
        return list(updated.values())

    def abort(self, request_id: str, sample: int | None = None) -> None:
        """Stop a request: its unfinished samples (or only sample index `sample`) leave the
        queues with their blocks freed and finish_reason "abort". Without `sample`, or once
        every sample has finished, the engine forgets the request."""
        req = self.requests.get(request_id)
        if req is None:
            return
        live = [s for s in req.seqs if not s.is_finished and sample in (None, s.sample_index)]
        self.scheduler.abort(live)
        now = time.perf_counter()
        for s in live:
            s.metrics.finish_time = now
            s.metrics.connector = self.connector.request_metrics(s.request_id)
        if sample is None or req.finished:
            del self.requests[request_id]

    def output(self, req: Request) -> RequestOutput:
        """req's tokens, text and metrics so far."""
        return req.output(self.tokenizer)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def _fork(self, seq: Sequence, index: int) -> Sequence:
        """Sample `index` of seq's request (n > 1), hinted as seq is."""
        child = self._new_seq(self.requests[seq.group], index)
        child.kv_hint = seq.kv_hint
        child.metrics.blend_rule = seq.metrics.blend_rule
        return child

    def _new_seq(self, req: Request, index: int) -> Sequence:
        self._next_id += 1
        return new_seq(req, index, self._next_id - 1, self._rng)

    def blend_choice(self, params: SamplingParams) -> tuple[BlendParams | None, str]:
        """How a prompt in parts with these params runs: its blend parameters, or None for
        prefix reuse (no calibration met its target), and the label its usage shows
        (engine/blend_gate.py)."""
        return self.blend_gate.choose(self.config, params)
