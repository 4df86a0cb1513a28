"""SmolLM2-135M-Instruct (the GGUF pulled once into the model cache, saved as an HF safetensors
checkpoint for vLLM) with tierkv.vllm and a real tierkv-server: chat prompts sharing a system
prompt are answered cold and saved, then answered again from the server with the same greedy
tokens. fp32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.harness import Engine, smollm2_checkpoint
from tierkv.cacheserver.launch import ServerProcess

SYSTEM = (
    "You are the help desk of a public library. Answer every question in one short, plain "
    "sentence. If a question is about the library's rules, say that the rules are posted at "
    "the front desk. Never invent facts, and do not use lists or markdown in your answers."
)
QUESTIONS = ["What is the capital of France?", "How many days are in a week?"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """The checkpoint directory and the chat prompts as token ids."""
    path, tok = smollm2_checkpoint(tmp_path_factory.mktemp("smollm2-hf"))
    texts = [
        tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q in QUESTIONS
    ]
    return path, [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess().start()
    yield s
    s.stop(kill=True)


def test_smollm2_answers_from_the_server_equal_cold(smollm2, server: ServerProcess) -> None:
    path, prompts = smollm2
    extra = {"remote": f"grpc://{server.target}", "chunk_size": 32, "cpu_bytes": 0}
    e = Engine(path, extra, knobs={"skip_tokenizer_init": False, "max_model_len": 1024}).start()
    try:
        cold = e.generate(prompts, max_tokens=24, cold=True)
        e.wait_saved(3 * sum(-(-len(p) // 32) for p in prompts))  # 3 KV heads' parts of each chunk
        m = e.metrics()
        e.reset()
        assert e.generate(prompts, max_tokens=24) == cold
        d = e.metrics()
        assert d["loaded_tokens"] - m["loaded_tokens"] == sum(len(p) - 1 for p in prompts)
        assert d["recomputed_tokens"] == 0
    finally:
        e.close()
