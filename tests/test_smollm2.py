"""SmolLM2-135M-Instruct, a real trained checkpoint (a Q4_1 GGUF, pulled once into the model
cache): the engine's weights are transformers' own, bit for bit; its greedy replies to chat
prompts equal transformers' up to EOS, alone, batched, from the prefix cache, and loaded
through the connector from the cpu tier, the disk tier, the cache server and Redis; the
same weights saved as safetensors share the GGUF file's cache keys. fp32 throughout, except
the bf16 agreement test."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import transformers

from tierkv.cacheserver.launch import RedisProcess, ServerProcess
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams
from tierkv.engine.models import pull
from tierkv.storage_backends.build import TiersConfig

SYSTEM = (
    "You are the help desk of a public library. Answer every question in one short, plain "
    "sentence. If a question is about the library's rules, say that the rules are posted at "
    "the front desk. Never invent facts, and do not use lists or markdown in your answers."
)
QUESTIONS = [
    "What is the capital of France?",
    "How many days are in a week?",
    "What do bees make?",
    "What is the opposite of hot?",
]
MAX_NEW = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
CHUNK = 32
EOS = 2  # <|im_end|>, the checkpoint's EOS


def messages(q: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


@pytest.fixture(scope="module")
def gguf() -> Path:
    return pull("smollm2", progress=False)


@pytest.fixture(scope="module")
def hf(gguf: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def engine(gguf: Path) -> LLM:
    return LLM(str(gguf), dtype="fp32", kv_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def prompts(engine: LLM) -> list[list[int]]:
    return [engine.chat_prompt(messages(q)) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_replies(hf: transformers.PreTrainedModel, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS
            )[0, len(p) :].tolist()
            out.append(ids)
    return out


@pytest.fixture(scope="module")
def safetensors_dir(hf: transformers.PreTrainedModel, gguf: Path, tmp_path_factory) -> Path:
    """The same weights as a Hugging Face checkpoint directory, tokenizer included."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("smollm2-st")
    weights = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(path / "model.safetensors"))  # tied: lm_head is the embedding
    hf.config.to_json_file(path / "config.json")
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(path)
    return path


def test_weights_equal_transformers_gguf_loader(engine: LLM, hf) -> None:
    ours = dict(engine.runner.model.named_parameters())
    cfg = engine.model_config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    checked = 0
    for name, theirs in hf.state_dict().items():
        name = name.removeprefix("model.")
        if name == "lm_head.weight":
            assert torch.equal(theirs, ours["embed_tokens.weight"])  # tied
            continue
        for src, dst, rows in (
            ("q_proj", "qkv_proj", (0, q)),
            ("k_proj", "qkv_proj", (q, kv)),
            ("v_proj", "qkv_proj", (q + kv, kv)),
            ("gate_proj", "gate_up_proj", (0, inter)),
            ("up_proj", "gate_up_proj", (inter, inter)),
        ):
            if f".{src}." in name:
                mine = ours[name.replace(src, dst)].narrow(0, *rows)
                break
        else:
            mine = ours[name]
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name
        checked += 1
    assert checked == len(ours) + 3 * cfg.num_hidden_layers  # q/k/v and gate/up: one tensor each


def test_chat_template_and_eos_from_the_checkpoint(engine: LLM, gguf: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    conv = messages(QUESTIONS[0])
    want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert engine.tokenizer is not None
    assert engine.tokenizer.apply_chat_template(conv) == want
    assert engine.chat_prompt(conv) == tok(want, add_special_tokens=False)["input_ids"]
    assert engine.model_config.eos_token_id == [EOS] == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_greedy_alone_and_batched_equal_transformers(engine, prompts, hf_replies) -> None:
    for p, want in zip(prompts, hf_replies, strict=True):
        out = engine.generate([p], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == want
        assert out.outputs[0].finish_reason == "stop" and want[-1] == EOS  # ended at EOS
    assert "Paris" in engine.chat(messages(QUESTIONS[0]), GREEDY, use_tqdm=False)[0].text
    batched = engine.generate(prompts, GREEDY, use_tqdm=False)  # the prefix cache is warm too
    assert [o.token_ids for o in batched] == hf_replies
    assert all(o.metrics.cached_tokens >= 64 for o in batched)  # the shared system prompt


def load_all(conn: TierKVConnector, model: Path, prompts, hf_replies, tier: str) -> None:
    """A fresh engine (empty prefix cache) on conn loads every prompt's stored chunks from
    tier and replies as transformers does."""
    reader = LLM(str(model), dtype="fp32", kv_cache_bytes=64 << 20, kv_connector=conn)
    outs = reader.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_replies, tier
    # All but the last token: the full chunks and the prompt's partial tail.
    assert outs[0].metrics.connector["loaded_tokens"] == {tier: len(prompts[0]) - 1}
    for o, p in zip(outs, prompts, strict=True):  # later ones may find the system prompt cached
        assert set(o.metrics.connector["loaded_tokens"]) <= {tier}
        assert o.metrics.external_tokens + o.metrics.cached_tokens == len(p) - 1
    assert conn.stats.load_rejected == conn.stats.load_errors == conn.stats.recomputed_tokens == 0


def test_connector_hits_from_every_tier(safetensors_dir, gguf, prompts, hf_replies, tmp_path):
    """The GGUF-loaded engine saves to its cpu tier, a disk tier and a cache server that
    writes through to Redis; engines loaded from the safetensors copy then find the KV in
    each: the keys depend on the weights, not on the file format."""
    redis = RedisProcess().start()
    server = ServerProcess(args=["--disk-bytes", "0", "--redis-url", redis.url]).start()
    remote, disk = f"grpc://{server.target}", tmp_path / "kv"
    conns = []

    def connector(**over: object) -> TierKVConnector:
        conns.append(TierKVConnector(ConnectorConfig(chunk_size=CHUNK, **over)))  # type: ignore[arg-type]
        return conns[-1]

    try:
        writer = connector(tiers=TiersConfig(cpu_bytes="64MiB", disk_dir=disk), remote=remote)
        LLM(str(gguf), dtype="fp32", kv_cache_bytes=64 << 20, kv_connector=writer).generate(
            prompts, GREEDY, use_tqdm=False
        )
        writer.flush()
        load_all(writer, safetensors_dir, prompts, hf_replies, "cpu")
        load_all(
            connector(tiers=TiersConfig(cpu_bytes=0, disk_dir=disk)),
            safetensors_dir,
            prompts,
            hf_replies,
            "disk",
        )
        load_all(
            connector(tiers=TiersConfig(cpu_bytes=0), remote=remote),
            safetensors_dir,
            prompts,
            hf_replies,
            "remote",
        )
        wait_for_redis(redis, writer.stats.saved_chunks)  # the server's write-through
        via_redis = connector(tiers=TiersConfig(cpu_bytes=0), remote=redis.url)
        load_all(via_redis, safetensors_dir, prompts, hf_replies, "redis")
    finally:
        for c in conns:
            c.close()
        server.stop(kill=True)
        redis.stop(kill=True)


def wait_for_redis(redis: RedisProcess, keys: int, timeout: float = 20.0) -> None:
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url)
    deadline = time.monotonic() + timeout
    while client.dbsize() < keys:
        assert time.monotonic() < deadline, f"{client.dbsize()} of {keys} segments in Redis"
        time.sleep(0.1)
    client.close()


def test_bf16_agreement_with_fp32(gguf: Path, prompts, hf_replies) -> None:
    """bf16 rounds the dequantized weights once more; report how often its greedy replies
    agree with fp32's (the engine's fp32 replies equal transformers', tested above)."""
    llm = LLM(str(gguf), dtype="bf16", kv_cache_bytes=64 << 20)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    first = sum(o.token_ids[0] == w[0] for o, w in zip(outs, hf_replies, strict=True))
    same = sum(o.token_ids == w for o, w in zip(outs, hf_replies, strict=True))
    prefix = [
        next((i for i, (a, b) in enumerate(zip(o.token_ids, w)) if a != b), len(w))
        for o, w in zip(outs, hf_replies, strict=True)
    ]
    print(f"bf16 vs fp32: first token {first}/{len(prompts)}, whole reply {same}/{len(prompts)}")
    print(f"bf16 vs fp32: tokens agreeing before the first difference {prefix}")
    assert all(o.outputs[0].text for o in outs)  # bf16 still answers in text
    assert first >= len(prompts) // 2  # the first token rarely flips; a broken bf16 path fails
