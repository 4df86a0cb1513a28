"""Processes a script starts beside its engine: a Redis (a Redis Cluster: launch_cluster), a
cache server, an engine's OpenAI server (`tierkv-engine serve`). Benchmarks and tests start
what they need on free ports of 127.0.0.1 and stop it. A server's or an engine's output goes
to a log file: a pipe nobody reads would block it once full. Plain dataclasses, not slotted: a
test may keep what it made for a process (its certificate, its Redis) on the process object.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port(span: int = 1) -> int:
    """A port of 127.0.0.1 free now, with the `span - 1` after it (a TP engine serves rank r's
    metrics on port + r). Drawn below the kernel's ephemeral range: a port from bind(0) comes
    from the range every outgoing connection takes its source port from, so between this call
    and the server's bind a connection could take it (seen with vLLM, which opens many)."""
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(200):
        port = random.randrange(10000, max(low, 10001 + span) - span)
        if all(_bindable(port + i) for i in range(span)):
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


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
        raise RuntimeError("redis-server not found: run `make setup`, which installs one")
    return path


def _temp_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


@dataclass
class RedisProcess:
    """One redis-server on 127.0.0.1, persistence off; restartable on the same port."""

    port: int = field(default_factory=free_port)
    extra: list[str] = field(default_factory=list)  # more redis-server flags
    dir: Path = field(default_factory=lambda: _temp_dir("tierkv-redis-"))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.dir), *self.extra]
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


@dataclass
class ServerProcess:
    """`tierkv-server` (`python -m tierkv.cacheserver`) on a free port; restartable with the
    same cache dir. Small tiers (cpu 64 MiB, disk 256 MiB under cache_dir) unless `args` says
    otherwise; its output goes to cache_dir/server.log."""

    args: list[str] = field(default_factory=list)  # more tierkv-server flags
    port: int = field(default_factory=free_port)
    cache_dir: Path = field(default_factory=lambda: _temp_dir("tierkv-server-"))
    env: dict[str, str] = field(default_factory=dict)  # over this process's environment
    proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.cache_dir / "server.log"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        cmd = [sys.executable, "-m", "tierkv.cacheserver", "--port", str(self.port)]
        cmd += ["--cache-dir", str(self.cache_dir), "--cpu-bytes", "64MiB"]
        cmd += ["--disk-bytes", "256MiB", *self.args]
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                cmd, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT
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


class ServeProcess:
    """`tierkv-engine serve` on a free port, serving the model as "tiny"; its output in a log
    file. Call `wait` before the first request."""

    def __init__(self, *args: str) -> None:
        """args: the serve flags, the model's included (--model PATH or --random-config)."""
        self.port = free_port()
        self.log = _temp_dir("tierkv-serve-") / "serve.log"
        cmd = [
            sys.executable,
            "-P",  # not the working directory's folders (kernels/ would shadow HF's `kernels`)
            "-m",
            "tierkv.engine.cli",
            "serve",
            "--port",
            str(self.port),
            "--served-model-name",
            "tiny",
            *args,
        ]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 60.0) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while "tierkv serve:" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"serve did not start:\n{self.log.read_text()}")
            time.sleep(0.1)
        wait_port(self.port, timeout)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
