"""EngineLoop: one engine thread steps the Engine for every HTTP request at once (continuous
batching); the asyncio side submits jobs and reads each one's tokens from its own queue.

Only the engine thread touches the Engine: submit, stop and abort go through an inbox, and each
step's new tokens go back to the event loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from tierkv.engine.engine import NoFit, Prompt
from tierkv.engine.llm import LLM, is_parts, plain_prefill
from tierkv.engine.outputs import Request
from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.sequence import Sequence
from tierkv.engine.serve.metrics import ServeMetrics
from tierkv.storage_backends.hints import KVHint

log = logging.getLogger("tierkv.engine.serve")


class Overloaded(Exception):
    """The engine holds max_pending requests already (answered with 429)."""


@dataclass(slots=True)
class Update:
    """New output of one sample: its tokens (and logprobs) since the last update; finish_reason
    and usage once it ends."""

    index: int
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]]
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None


@dataclass(slots=True, eq=False)
class Job:
    prompt: Prompt
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[list[Update]]  # shared by the jobs of one HTTP request
    base: int = 0  # the choice index of this job's first sample (prompt index * n)
    request: Request | None = None  # set when the engine thread adds it
    sent: list[int] = field(default_factory=list)  # output tokens already sent, per sample
    done: list[bool] = field(default_factory=list)  # samples finished or stopped
    prompt_tokens: int = 0
    kv_hint: KVHint | None = None  # the request's workflow hint (advice)


class EngineLoop:
    def __init__(self, llm: LLM, max_pending: int, metrics: ServeMetrics, idle_wait_s: float):
        self.llm = llm
        self.max_pending = max_pending
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.inbox: queue.SimpleQueue[tuple[str, Job, int]] = queue.SimpleQueue()
        self.jobs: dict[str, Job] = {}  # by request id
        self.inflight = 0  # submitted and not yet finished or aborted (guarded by lock)
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="tierkv-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)

    # -- the asyncio side ----------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self.lock:
            if self.inflight >= self.max_pending:
                raise Overloaded(f"the server holds {self.inflight} requests; retry later")
            self.inflight += 1
        job.sent, job.done = [0] * job.params.n, [False] * job.params.n
        self._send("add", job)

    def finish_sample(self, job: Job, index: int) -> None:
        """The client side ended sample index (a stop string matched): stop computing it."""
        self._send("stop", job, index)

    def abort(self, job: Job) -> None:
        """The client went away: drop the job and free its blocks."""
        self._send("abort", job)

    def _send(self, what: str, job: Job, index: int = 0) -> None:
        self.inbox.put((what, job, index))
        self.wake.set()

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping:
            if self._drain_inbox():
                self._publish()  # a stopped sample finished without a step
            if not self.llm.has_unfinished():
                self._snapshot()
                self.wake.wait(self.idle_wait_s)
                self.wake.clear()
                continue
            try:
                self.llm.step()
            except NoFit as e:  # the head request cannot fit the KV cache at all
                self._fail_head(e)
            except Exception:
                log.exception("engine step failed")
                self._fail_all("internal engine error")
            self._publish()
            self._snapshot()

    def _drain_inbox(self) -> bool:
        """Run the queued commands; True if there were any."""
        got = False
        while True:
            try:
                what, job, index = self.inbox.get_nowait()
            except queue.Empty:
                return got
            got = True
            if what == "add":
                self._add(job)
            elif what == "abort" and self._added(job):
                self._abort(job)
                self._forget(job)
                self.metrics.aborted.inc()
            elif what == "stop" and self._added(job):
                # the next _publish reports it finished, with its usage
                self._abort(job, index)

    def _add(self, job: Job) -> None:
        llm = self.llm
        try:
            prompt = job.prompt
            held = True
            if (
                is_parts(prompt)
                and llm.supports_segments
                and llm.blend_choice(job.params)[0] is not None
            ):
                # The documents' KV must be stored before the blend can load it. ingest steps
                # the engine until idle: other requests advance meanwhile, streamed after.
                held = llm.store_parts([prompt], [job.params.cache_salt])[0]  # type: ignore[list-item]
                self._publish()
            req = llm.add_request(None, prompt, job.params, job.kv_hint)
            if not held:
                plain_prefill(req)
        except (ValueError, RuntimeError) as e:  # a bad prompt, or documents that cannot fit
            self._reply(job, [Update(job.base, [], [], "error", error=str(e))])
            self._release()
            return
        job.request, job.prompt_tokens = req, len(req.prompt_token_ids)
        self.jobs[req.request_id] = job
        self.metrics.requests.inc()

    def _publish(self) -> None:
        """Send each job the tokens its samples produced since the last call."""
        for job in list(self.jobs.values()):
            assert job.request is not None  # jobs holds added jobs only
            seqs, updates = job.request.seqs, []
            for s in seqs:
                i = s.sample_index
                new = s.output_ids[job.sent[i] :]
                fin = s.is_finished and not job.done[i]
                if job.done[i] or not (new or fin):
                    continue
                lps = s.logprobs[job.sent[i] : job.sent[i] + len(new)]
                job.sent[i] += len(new)
                up = Update(job.base + i, new, lps)
                if fin:
                    job.done[i] = True
                    up.finish_reason = s.finish_reason or "length"
                    up.usage = self._usage(s)
                updates.append(up)
            if updates:
                self._reply(job, updates)
            if job.request.finished:
                for s in seqs:
                    self.metrics.observe_finished(s)
                self._forget(job)

    def _usage(self, s: Sequence) -> dict[str, Any]:
        m = s.metrics
        loaded = {k: int(v) for k, v in (m.connector.get("loaded_tokens") or {}).items()}
        return {
            "blend": m.blend_rule,  # a prompt in parts: its rule, or "uncalibrated"
            "prompt_tokens": s.num_prompt_tokens,
            "completion_tokens": s.num_output_tokens,
            "prefix_cache_tokens": m.num_cached_tokens,
            "connector_tokens": m.num_external_tokens,
            "loaded_tokens": loaded,
        }

    def _added(self, job: Job) -> bool:
        return job.request is not None and job.request.request_id in self.jobs

    def _abort(self, job: Job, sample: int | None = None) -> None:
        if job.request is not None:
            self.llm.abort(job.request.request_id, sample)

    def _forget(self, job: Job) -> None:
        if job.request is not None and self.jobs.pop(job.request.request_id, None) is not None:
            self._release()

    def _release(self) -> None:
        with self.lock:
            self.inflight -= 1

    def _reply(self, job: Job, updates: list[Update]) -> None:
        job.loop.call_soon_threadsafe(job.queue.put_nowait, updates)

    def _fail_head(self, e: NoFit) -> None:
        job = self.jobs.get(e.request_id) if e.request_id is not None else None
        if job is None:
            self._fail_all(str(e))
            return
        self._fail(job, str(e))

    def _fail_all(self, message: str) -> None:
        for job in list(self.jobs.values()):
            self._fail(job, message)

    def _fail(self, job: Job, message: str) -> None:
        self._abort(job)
        self._forget(job)
        self._reply(job, [Update(job.base, [], [], "error", error=message)])

    def _snapshot(self) -> None:
        """Queue and cache gauges, read here on the engine thread (the scheduler's structures
        are not safe to walk from the scrape's thread) and swapped in whole."""
        llm, blocks = self.llm, self.llm.blocks
        self.metrics.state = {
            "waiting": float(llm.num_waiting),
            "running": float(llm.num_running),
            "kv_usage": 1.0 - blocks.num_available() / blocks.num_blocks,
        }
