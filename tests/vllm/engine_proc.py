"""One vLLM engine with tierkv.vllm attached, driven by JSON lines on stdin (a test's process
A or B). Each command is answered by one stdout line starting with REPLY.

  {"op": "generate", "prompts": [[ids...]], "max_tokens": N, "cold": false}
      -> {"tokens": [[ids...]]}  (greedy; cold: vLLM reads no cached KV, local or tierkv)
      with "kv_hints": [{action fields}...]: each request carries vLLM's KvHintsEnvelope of
      those actions (LLMEngine.add_request; LLM.generate takes none)
  {"op": "reset"}  -> vLLM's prefix cache emptied
  {"op": "counters"} -> vLLM's own counters ({"vllm:num_preemptions": ...})
  {"op": "quit"}   -> the engine shuts down (its saves drained), then the process exits

argv: model dir, dtype, kv_connector_extra_config as JSON, then optional engine knobs as JSON.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

REPLY = "REPLY "
SEQ = itertools.count()


def hinted(llm, prompts: list[list[int]], params, actions: list[dict]) -> list[list[int]]:
    """Greedy tokens of prompts added one by one, each with a kv_hints envelope of actions."""
    from vllm.inputs import TokensPrompt
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    env = KvHintsEnvelope("1", "tests", [KvHintAction(**a) for a in actions])
    engine, ids = llm.llm_engine, [f"hinted-{os.getpid()}-{next(SEQ)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), params, kv_hints=env)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[rid] for rid in ids]


def main() -> None:
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model, dtype, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    knobs = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    ktc = None
    if extra is not None:
        ktc = KVTransferConfig(
            kv_connector="TierKVConnector",
            kv_connector_module_path="tierkv.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    llm = LLM(
        model=model,
        dtype=dtype,
        skip_tokenizer_init=knobs.pop("skip_tokenizer_init", True),
        kv_transfer_config=ktc,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        **knobs,
    )
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "counters":
            got = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
            print(REPLY + json.dumps(got), flush=True)
            continue
        if cmd["op"] == "reset":
            # Blocks held for saves go back in the step after their request ended; offline and
            # in-process, vLLM takes that step with the next request only: take it here.
            ok, steps = llm.reset_prefix_cache(), 0
            while not ok and steps < 50:
                llm.llm_engine.step()
                ok, steps = llm.reset_prefix_cache(), steps + 1
            print(REPLY + json.dumps({"ok": ok, "steps": steps}), flush=True)
            continue
        params = SamplingParams(
            temperature=0.0,
            max_tokens=cmd.get("max_tokens", 8),
            ignore_eos=True,
            skip_reading_prefix_cache=bool(cmd.get("cold")),
            detokenize=False,
        )
        if cmd.get("kv_hints") is not None:
            tokens = hinted(llm, cmd["prompts"], params, cmd["kv_hints"])
        else:
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], params, use_tqdm=False
            )
            tokens = [list(o.outputs[0].token_ids) for o in outs]
        print(REPLY + json.dumps({"tokens": tokens}), flush=True)
    del llm
    print(REPLY + json.dumps({"closed": True}), flush=True)


if __name__ == "__main__":
    main()
