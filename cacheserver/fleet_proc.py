"""One process of a fleet: started with its log, optionally pinned to one core, checked by its
/health, stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Proc:
    """One process of the fleet and its log."""

    name: str
    cmd: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    core: int | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self, log_dir: Path) -> Proc:
        log = open(log_dir / f"{self.name}.log", "ab")
        core = self.core

        def pin() -> None:
            if core is not None:
                os.sched_setaffinity(0, {core})

        self.proc = subprocess.Popen(
            self.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            preexec_fn=pin,
            start_new_session=True,  # its own group: stop() ends vLLM's EngineCore children too
        )
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, kill: bool = False) -> None:
        """End the process and every process it started (its session's group)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        _signal_group(self.proc.pid, signal.SIGKILL)  # children left behind by a clean exit


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return bool(r.status == 200)
    except OSError:
        return False
