"""Real dependencies for tests: redis-server processes on free ports.

Tests start what they need and stop it; nothing here is mocked.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("redis-server not found: run `make test`, which installs one")
    return path


@dataclass
class RedisProcess:
    """One redis-server on 127.0.0.1, persistence off; restartable on the same port."""

    port: int = field(default_factory=free_port)
    extra: list[str] = field(default_factory=list)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="tierkv-redis-")))
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        args = [
            redis_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is valid and free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


@dataclass
class RedisCluster:
    """A Redis Cluster of `masters` redis-server processes (each with `replicas` replicas).

    Nodes are RedisProcess objects in cluster mode, so a test can kill or restart one
    (failover tests kill a master and wait for its replica to take over).
    """

    masters: int = 3
    replicas: int = 0
    nodes: list[RedisProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, timeout: float = 20.0) -> RedisCluster:
        for _ in range(self.masters * (1 + self.replicas)):
            node = RedisProcess(
                port=_cluster_port(),
                extra=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-config-file",
                    "nodes.conf",
                ],
            )
            self.nodes.append(node.start())
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *addrs,
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while not all(self._ok(n) for n in self.nodes):
            if time.monotonic() > deadline:
                raise TimeoutError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    @staticmethod
    def _ok(node: RedisProcess) -> bool:
        out = subprocess.run(
            ["redis-cli", "-p", str(node.port), "cluster", "info"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
        return "cluster_state:ok" in out

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(kill=True)
        self.nodes.clear()


@dataclass
class ServerProcess:
    """A `python -m cacheserver` subprocess on a free port; restartable with the same cache dir.

    Small tiers (cpu 64 MiB, disk 256 MiB under cache_dir) unless `args` says otherwise;
    its output goes to cache_dir/server.log."""

    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    cache_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="tierkv-server-")))
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        import os
        import sys

        cmd = [
            sys.executable,
            "-m",
            "tierkv.cacheserver",
            "--port",
            str(self.port),
            "--cache-dir",
            str(self.cache_dir),
            "--cpu-bytes",
            "64MiB",
            "--disk-bytes",
            "256MiB",
            *self.args,
        ]
        env = {**os.environ, **self.env}
        # Output goes to a file: a pipe nobody reads would block the server once full.
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=Path(__file__).resolve().parent.parent,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while "listening" not in self.log.read_text().split("tierkv-server stopped")[-1]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc = None
                raise RuntimeError(f"tierkv-server did not start:\n{self.log.read_text()}")
            time.sleep(0.05)
        wait_port(self.port, timeout)
        return self

    @property
    def log(self) -> Path:
        return self.cache_dir / "server.log"

    def stop(self, kill: bool = False, timeout: float = 30.0) -> int:
        """SIGTERM (graceful) or SIGKILL; returns the exit code."""
        if self.proc is None:
            return 0
        self.proc.kill() if kill else self.proc.terminate()
        rc = self.proc.wait(timeout)
        self.proc = None
        return rc

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class TlsRedisProcess(RedisProcess):
    """A redis-server that speaks TLS only (its plaintext port is off), with the given PEM
    certificate and key (tests make a self-signed pair); `url` is rediss:// with the CA."""

    cert: Path | None = None
    key: Path | None = None

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"

    def start(self) -> TlsRedisProcess:
        self.extra = [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.cert),
            "--tls-key-file",
            str(self.key),
            "--tls-ca-cert-file",
            str(self.cert),
            "--tls-auth-clients",
            "no",
        ]
        RedisProcess.start(self)
        return self
