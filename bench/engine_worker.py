"""One engine in its own process for bench.engine_vllm: tierkv's (under the repository's venv)
or vLLM's (under .venv-vllm). It reads JSON jobs from stdin, one a line, and answers each
with one JSON line on the stdout it was started with; everything the engines print goes to
stderr. Times are taken here, around the engine call, so the pipe is not in them.

    python -m bench.engine_worker tierkv|vllm CHECKPOINT

Jobs: {"op": "generate", "prompts": [[ids]], "max_tokens": [n]} -> {"seconds", "outputs",
"decode_s"} (decode_s: each request's first to last token, from the engine's own timestamps);
{"op": "mixed", "arrivals": [...], "engine": {knobs}} -> bench.mixed_worker.run_arrivals' times;
{"op": "info"} -> the engine's batch limits.
Every case sends new random token ids, so a prefix cache hits only where a case means it to.
Only the standard library is imported here: the two venvs share nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KV_CACHE_GIB = 4  # both engines' KV budget: the largest case needs under 1 GiB


class TierKV:
    def __init__(self, model: str) -> None:
        from tierkv.engine import SamplingParams

        self.params, self.model = SamplingParams, model
        self._llm: Any = None
        self.rag: dict[str, Any] = {}  # engine knobs (JSON) -> an engine with a connector

    @property
    def llm(self) -> Any:
        """The plain cases' engine, made on first use: a mixed-load run makes only its own
        (KV_CACHE_GIB of KV it would not use, beside four of them and vLLM, overran 24 GiB)."""
        if self._llm is None:
            from tierkv.engine import LLM

            self._llm = LLM(self.model, dtype="bf16", kv_cache_bytes=KV_CACHE_GIB << 30)
        return self._llm

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
        ps = [self.params(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        t0 = time.perf_counter()
        res = self.llm.generate(list[Any](prompts), ps, use_tqdm=False)
        dt = time.perf_counter() - t0
        return {
            "seconds": dt,
            "outputs": [r.token_ids for r in res],
            "decode_s": [r.metrics.decode_time for r in res],
        }

    def mixed(self, job: dict[str, Any]) -> dict[str, Any]:
        """bench.engine_mixed's run, on an engine with a connector (blend arrivals reuse their
        documents) and job["engine"]'s knobs; one such engine per set of knobs."""
        from bench.mixed_worker import tierkv_mixed
        from tierkv.connector import ConnectorConfig, TierKVConnector
        from tierkv.engine import LLM
        from tierkv.storage_backends.build import TiersConfig

        knobs = job.get("engine", {})
        key = json.dumps(knobs, sort_keys=True)
        if key not in self.rag:
            # 1 GiB each: the mixed run holds under 0.5 GiB of KV, and one engine per system
            # (four of tierkv's) beside vLLM must fit the machine's memory
            conn = TierKVConnector(ConnectorConfig(tiers=TiersConfig(cpu_bytes="1GiB")))
            self.rag[key] = LLM(
                self.model,
                dtype="bf16",
                kv_cache_bytes=1 << 30,
                kv_connector=conn,
                **knobs,
            )
        return tierkv_mixed(self.rag[key], job)

    def info(self) -> dict[str, Any]:
        c = self.llm.config
        return {
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "max_num_seqs": c.max_num_seqs,
            "prefix_caching": c.enable_prefix_caching,
            "kv_blocks": self.llm.runner.num_blocks,
        }


class Vllm:
    def __init__(self, model: str) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.params, self.prompt = SamplingParams, TokensPrompt
        self.llm = LLM(
            model=model,
            dtype="bfloat16",
            enable_prefix_caching=True,
            skip_tokenizer_init=True,
            seed=0,
            disable_log_stats=False,  # per-request timestamps (decode time)
        )

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
        ps = [
            self.params(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
            for n in max_tokens
        ]
        tp = [self.prompt(prompt_token_ids=p) for p in prompts]
        t0 = time.perf_counter()
        res = self.llm.generate(tp, ps, use_tqdm=False)
        dt = time.perf_counter() - t0
        decode = []
        for r in res:
            m = r.metrics
            decode.append(m.last_token_ts - m.first_token_ts if m is not None else float("nan"))
        return {
            "seconds": dt,
            "outputs": [list(r.outputs[0].token_ids) for r in res],
            "decode_s": decode,
        }

    def mixed(self, job: dict[str, Any]) -> dict[str, Any]:
        from bench.mixed_worker import vllm_mixed

        return vllm_mixed(self.llm, job)

    def info(self) -> dict[str, Any]:
        cfg = self.llm.llm_engine.vllm_config
        return {
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "prefix_caching": cfg.cache_config.enable_prefix_caching,
            "kv_cache_gib": float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0")),
            "vllm": __import__("vllm").__version__,
        }


class Worker:
    """bench.engine_worker in a child process; call() sends one job and waits for its answer.
    Between calls the worker's whole process group is stopped (SIGSTOP): an idle vLLM keeps
    polling its queues and OpenMP threads spin, which would take the cores from the other system."""

    def __init__(self, system: str, python: str, model: Path, env: dict[str, str], log: Path):
        self.system, self.log = system, log
        cmd = [python, "-m", "bench.engine_worker", system, str(model)]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            text=True,
            start_new_session=True,  # its own process group: vLLM's engine core and worker too
        )
        self.start_s = self._read()["start_s"]
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"{self.system} worker died; its log: {self.log.read_text()[-2000:]}"
            )
        return json.loads(line)

    def call(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            return self._read()
        finally:
            self._signal(signal.SIGSTOP)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
        return self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    system, model = sys.argv[1], sys.argv[2]
    answers = os.fdopen(os.dup(1), "w")  # the pipe to the parent; engine logs go to stderr
    os.dup2(2, 1)
    t0 = time.perf_counter()
    engine = TierKV(model) if system == "tierkv" else Vllm(model)
    answers.write(json.dumps({"start_s": time.perf_counter() - t0}) + "\n")
    answers.flush()
    for line in sys.stdin:
        job = json.loads(line)
        if job["op"] == "generate":
            out: dict[str, Any] = engine.generate(job["prompts"], job["max_tokens"])
        elif job["op"] == "mixed":
            out = engine.mixed(job)
        else:
            out = engine.info()
        answers.write(json.dumps(out) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
