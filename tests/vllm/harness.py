"""vLLM engines as child processes (tests/vllm/engine_proc.py), a tiny random checkpoint, and
the connector's Prometheus counters read from an engine's worker."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.cacheserver.launch import ServerProcess, free_port
from tierkv.storage_backends.segment import KVSegment

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def tiny_llama(path: Path) -> Path:
    """A 2-layer random Llama (fp32 weights, head size 64, 2 KV heads) as an HF checkpoint."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def kv_scaled_llama(path: Path, scales: list[tuple[float, float]]) -> Path:
    """tiny_llama with a static fp8 K and V scale per layer in the checkpoint: compressed-tensors
    with a kv_cache_scheme only (its linear layers stay unquantized), which vLLM loads on the
    CPU, resolving kv_cache_dtype 'auto' to fp8."""
    import torch
    from safetensors.torch import load_file, save_file

    tiny_llama(path)
    f = path / "model.safetensors"
    weights = load_file(str(f))
    for i, (k, v) in enumerate(scales):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(weights, str(f), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {},
        "ignore": ["lm_head"],
        "kv_cache_scheme": {
            "num_bits": 8,
            "type": "float",
            "strategy": "tensor",
            "dynamic": False,
            "symmetric": True,
        },
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def tiny_gemma3(path: Path, window: int = 64) -> Path:
    """A 4-layer random Gemma-3 (fp32 weights, head size 64, 2 KV heads): layers 0-2 attend
    through a sliding window of `window` tokens, layer 3 to everything. Its output embedding is
    its own (not the input's), so greedy tokens depend on the context, not only the last token."""
    import torch
    import transformers

    cfg = transformers.Gemma3TextConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=4096,
        sliding_window=window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(cfg).eval().save_pretrained(path)
    return path


def smollm2_checkpoint(path: Path) -> tuple[Path, Any]:
    """SmolLM2-135M-Instruct (its GGUF pulled once into the model cache, dequantized by
    transformers) saved as an HF safetensors checkpoint with its tokenizer; and the tokenizer."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from tierkv.engine.models import pull

    gguf = pull("smollm2", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    weights = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights are dequantized now
    (path / "config.json").write_text(json.dumps(cfg))
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(path)
    return path, tok


@dataclass
class Engine:
    """One vLLM process with tierkv.vllm (extra: kv_connector_extra_config; None: no
    connector); its worker serves the connector's metrics on metrics_port (TP rank r on
    metrics_port + r)."""

    model: Path
    extra: dict[str, Any] | None
    dtype: str = "float32"
    knobs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # over ENV
    log: Path | None = None
    metrics_port: int = 0
    proc: subprocess.Popen | None = None

    def start(self, timeout: float = 240.0) -> Engine:
        extra = None if self.extra is None else dict(self.extra)
        if extra is not None:
            tp = int(self.knobs.get("tensor_parallel_size", 1))
            self.metrics_port = extra.setdefault("metrics_port", free_port(span=tp))
        self.log = self.log or Path(f"/tmp/tierkv-vllm-{os.getpid()}-{free_port()}.log")
        cmd = [
            sys.executable,
            str(HERE / "engine_proc.py"),
            str(self.model),
            self.dtype,
            json.dumps(extra),
            json.dumps(self.knobs),
        ]
        self._err = open(self.log, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            cwd=ROOT,
            env={**os.environ, **ENV, **self.env},
            start_new_session=True,  # its own group: close() ends vLLM's EngineCore too
        )
        self._read(timeout)
        return self

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            if line.startswith("REPLY "):
                return json.loads(line[6:])
            self._err.write(line)  # vLLM's own output, kept with its log
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"vLLM engine gave no reply; its log:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text().splitlines()[-n:]) if self.log else ""

    def send(self, cmd: dict[str, Any], timeout: float = 240.0) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 8,
        cold: bool = False,
        kv_hints: list[dict[str, Any]] | None = None,
    ):
        cmd = {"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "cold": cold}
        return self.send({**cmd, "kv_hints": kv_hints})["tokens"]

    def reset(self) -> None:
        assert self.send({"op": "reset"})["ok"], "vLLM's prefix cache could not be reset"

    def metrics(self, rank: int = 0) -> dict[str, float]:
        """A worker's tierkv_connector_* counters (Prometheus text format); rank r of a
        tensor-parallel engine serves them on metrics_port + r."""
        url = f"http://127.0.0.1:{self.metrics_port + rank}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("tierkv_connector_"):
                name, value = line.rsplit(" ", 1)
                out[name.removeprefix("tierkv_connector_").removesuffix("_total")] = float(value)
        return out

    def wait_saved(self, chunks: int, since: dict[str, float] | None = None) -> None:
        """Until `chunks` saves (put or found stored) have ended since `since` (puts run in
        the background)."""
        since, deadline = since or {}, time.monotonic() + 60
        while True:
            m = self.metrics()
            done = sum(m.get(k, 0) - since.get(k, 0) for k in ("saved_chunks", "save_skipped"))
            if done >= chunks:
                return
            assert time.monotonic() < deadline, f"saves did not finish: {m}"
            time.sleep(0.1)

    def close(self, timeout: float = 120.0) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                self.send({"op": "quit"}, timeout)
                self.proc.wait(timeout)
        except Exception:
            self.proc.kill()
            self.proc.wait(30)
        finally:
            kill_group(self.proc)  # an EngineCore its driver left behind
            self.proc = None
            self._err.close()


def parts(server: ServerProcess, tokens: list[int], n: int) -> dict[bytes, Path]:
    """The server's files of the parts of the chunk with these tokens, by part key, once all n
    are there (saves land in the background)."""
    deadline = time.monotonic() + 60
    while True:
        found = {}
        for f in (server.cache_dir / "disk" / "default").glob("*.tkv"):
            seg = KVSegment.decode(f.read_bytes(), verify=False)
            if seg.tokens.tolist() == tokens:
                found[seg.key] = f
        if len(found) >= n:
            return found
        assert time.monotonic() < deadline, "the server does not hold every part"
        time.sleep(0.1)


@contextlib.contextmanager
def local_core(name: str) -> Iterator[Any]:
    """A WorkerCore over an 8 MiB cpu tier on a loop thread of its own, closed after use."""
    from tierkv.connector.config import ConnectorConfig
    from tierkv.connector.loop import LoopThread
    from tierkv.connector.worker import WorkerCore

    async def build(cfg: ConnectorConfig) -> Any:
        return cfg.build_store()

    loop = LoopThread(name)
    cfg = ConnectorConfig.of({"cpu_bytes": "8MiB"})
    core = WorkerCore(loop, loop.run(build(cfg)), cfg)
    try:
        yield core
    finally:
        core.close()
        loop.close()


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal every process of proc's session (started with start_new_session=True): vLLM's
    EngineCore outlives a killed API server or driver otherwise."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def end_group(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM proc's session, wait for proc, then SIGKILL whatever of it is left."""
    if proc.poll() is None:
        kill_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.wait(30)
    kill_group(proc)
