"""A fleet on one host: tierkv-server (one per node; Redis or a Redis Cluster behind them when
asked), engine replicas (`tierkv-engine serve` or vLLM with tierkv.vllm), and vllm-router in
front, each on 127.0.0.1 with a port of its own, health-checked, logging into one folder, and
stopped together. `tierkv-fleet` (fleet_cli.py) is its command line; benchmarks and tests use
`Fleet` directly.

Safety contract: every process binds 127.0.0.1; `start` returns only when every process
answers (a replica's and the router's /health), and on any failure stops what it started;
`stop` ends every process it started, the router first.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.cacheserver.fleet_proc import Proc, healthy
from tierkv.cacheserver.launch import RedisProcess, free_port, wait_port
from tierkv.cacheserver.launch_cluster import RedisCluster

ENGINE_BLOCK = 16  # tokens per KV block of tierkv's engine (EngineConfig.block_size)
VLLM_BLOCK = 128  # tokens per KV block of vLLM replicas (vLLM's CPU default, set explicitly)


@dataclass(slots=True)
class FleetConfig:
    """The layout of a fleet; every process on 127.0.0.1."""

    model: str  # every replica's checkpoint directory or .gguf ("random:tiny": random weights)
    replicas: int = 2  # engine processes behind the router
    engine: str = "tierkv"  # tierkv (tierkv-engine serve) | vllm (vLLM with tierkv.vllm)
    policy: str = "cache_aware"  # vllm-router's --policy (kv_aware subscribes to KV events)
    pd: bool = False  # replica 0 prefills, the others decode (router --vllm-pd-disaggregation)
    nodes: int = 1  # tierkv-servers; >1: a Redis Cluster (3 masters, 1 replica each) behind
    redis: bool = False  # one Redis behind the server (nodes == 1)
    server_cpu: str = "1GiB"  # each tierkv-server's cpu tier
    replica_cpu: str = "256MiB"  # each tierkv replica's own cpu tier (its connector)
    replica_kv: str = "256MiB"  # each tierkv replica's KV blocks (its prefix cache)
    shared: bool = True  # the replicas share KV through tierkv-server (off: no server at all)
    chunk_size: int = 256  # tokens per stored chunk, every replica alike
    dtype: str = "bf16"  # the replicas' weights and KV
    served_name: str = "tiny"  # the model name requests carry
    pin: bool = True  # each replica on one core of this process's affinity, round robin
    vllm_python: str = ""  # the python of vLLM's venv (engine == vllm)
    log_dir: Path = field(default_factory=lambda: Path("fleet-logs"))  # every process's log


@dataclass(slots=True)
class Fleet:
    """The processes of one FleetConfig: `start()`, then send requests to `url`."""

    cfg: FleetConfig
    servers: list[Proc] = field(default_factory=list)
    replicas: list[Proc] = field(default_factory=list)
    router: Proc | None = None
    redis: RedisProcess | RedisCluster | None = None
    events: dict[str, str] = field(default_factory=dict)  # replica url -> its ZMQ endpoint

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def start(self, timeout: float = 300.0) -> Fleet:
        cfg = self.cfg
        if cfg.pd and cfg.replicas < 2:
            raise ValueError("a prefill/decode fleet needs 2 replicas or more")
        if cfg.engine not in ("tierkv", "vllm"):
            raise ValueError(f"engine must be tierkv or vllm, got {cfg.engine!r}")
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_redis()
            for n in range(cfg.nodes if cfg.shared else 0):
                self.servers.append(self._server(n).start(cfg.log_dir))
            for s in self.servers:
                wait_port(s.port, 60)
            cores = sorted(os.sched_getaffinity(0))
            for i in range(cfg.replicas):
                core = cores[i % len(cores)] if cfg.pin else None
                self.replicas.append(self._replica(i, core).start(cfg.log_dir))
            self._wait(self.replicas, timeout)
            self.router = self._router().start(cfg.log_dir)
            self._wait([self.router], 60)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, procs: list[Proc], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in procs:
            while not healthy(p.url):
                if not p.alive() or time.monotonic() > deadline:
                    log = (self.cfg.log_dir / f"{p.name}.log").read_text()[-2000:]
                    raise RuntimeError(f"{p.name} did not become healthy:\n{log}")
                time.sleep(0.2)

    def _start_redis(self) -> None:
        if self.cfg.nodes > 1:
            self.redis = RedisCluster(masters=3, replicas=1).start()
        elif self.cfg.redis:
            self.redis = RedisProcess().start()

    def _server(self, n: int) -> Proc:
        port = free_port()
        cmd = [sys.executable, "-P", "-m", "tierkv.cacheserver", "--port", str(port)]
        cmd += ["--cache-dir", str(self.cfg.log_dir / f"server{n}"), "--cpu-bytes"]
        cmd += [self.cfg.server_cpu]
        if isinstance(self.redis, RedisCluster):
            cmd += ["--redis-url", self.redis.cluster_url]
        elif self.redis is not None:
            cmd += ["--redis-url", self.redis.url]
        return Proc(f"server{n}", cmd, port)

    def role(self, i: int) -> str:
        """kv_producer (the prefill replica), kv_consumer (decode) or kv_both."""
        if not self.cfg.pd:
            return "kv_both"
        return "kv_producer" if i == 0 else "kv_consumer"

    def _replica(self, i: int, core: int | None) -> Proc:
        cfg, port = self.cfg, free_port()
        remote = None
        if self.servers:
            remote = f"grpc://127.0.0.1:{self.servers[i % len(self.servers)].port}"
        # The replica binds its events' socket and the router connects (vllm-router takes only
        # tcp://HOST:PORT). serve binds a loopback endpoint; vLLM binds only a wildcard one,
        # tcp://*, on every interface, and connects to any other.
        host = "127.0.0.1" if cfg.engine == "tierkv" else "*"
        events = f"tcp://{host}:{free_port()}" if cfg.policy == "kv_aware" else None
        if cfg.engine == "tierkv":
            model = (
                ["--random-config", cfg.model[7:]]
                if cfg.model.startswith("random:")
                else [
                    "--model",
                    cfg.model,
                ]
            )
            cmd = [sys.executable, "-P", "-m", "tierkv.engine.cli", "serve", *model]
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.dtype]
            cmd += ["--served-model-name", cfg.served_name, "--kv-cache-bytes", cfg.replica_kv]
            if remote:
                cmd += ["--remote", remote, "--cpu-cache", cfg.replica_cpu]
                cmd += ["--chunk-size", str(cfg.chunk_size)]
            if events:
                cmd += ["--kv-events-endpoint", events]
            env = {"OMP_NUM_THREADS": "1"} if core is not None else {}
        else:
            if remote is None:
                raise ValueError("vLLM replicas share KV through tierkv-server: shared must be on")
            ktc = {
                "kv_connector": "TierKVConnector",
                "kv_connector_module_path": "tierkv.vllm",
                "kv_role": self.role(i),
                "kv_connector_extra_config": {
                    "remote": remote,
                    "cpu_bytes": cfg.replica_cpu,
                    "chunk_size": cfg.chunk_size,
                },
            }
            py = cfg.vllm_python or shutil.which("python") or sys.executable
            cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model]
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]
            cmd += ["--served-model-name", cfg.served_name, "--enforce-eager"]
            cmd += ["--block-size", str(VLLM_BLOCK)]
            cmd += ["--kv-transfer-config", json.dumps(ktc)]
            if events:
                kec = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events}
                cmd += ["--kv-events-config", json.dumps(kec)]
            env = {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
            }
            if core is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        p = Proc(f"replica{i}", cmd, port, env, core)
        if events:
            self.events[p.url] = events
        return p

    def _router(self) -> Proc:
        cfg, port = self.cfg, free_port()
        exe = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        cmd = [exe, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--log-dir", str(cfg.log_dir / "router")]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        urls = [r.url for r in self.replicas]
        if cfg.pd:
            cmd += ["--vllm-pd-disaggregation", "--prefill", urls[0]]
            for u in urls[1:]:
                cmd += ["--decode", u]
            cmd += ["--prefill-policy", cfg.policy, "--decode-policy", cfg.policy]
        else:
            cmd += ["--worker-urls", *urls, "--policy", cfg.policy]
        for url, endpoint in self.events.items():
            cmd += ["--kv-event-source", f"{url}={endpoint.replace('*', '127.0.0.1')}"]
        if self.events:
            # both engines tell their tiers' chunks as their own KV blocks
            size = ENGINE_BLOCK if cfg.engine == "tierkv" else VLLM_BLOCK
            cmd += ["--kv-event-block-size", str(size)]
            cmd += ["--kv-event-model", cfg.served_name]
        return Proc("router", cmd, port)

    def stop(self) -> None:
        """The router, the replicas, the servers, Redis: every process started."""
        for p in [self.router, *self.replicas, *self.servers]:
            if p is not None:
                p.stop()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
