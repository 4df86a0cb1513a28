"""A private asyncio loop on a daemon thread: the async tiers run there, the engine stays sync."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any

import torch


class LoopThread:
    """Owns one event loop. Coroutines submitted here never run on the caller's thread."""

    def __init__(self, name: str = "tierkv-connector") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # The copies this thread makes (scatters, staging) are small and memory-bound: one
        # thread, so they never start an OpenMP team of their own beside the engine's.
        torch.set_num_threads(1)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run coro on the loop and wait; TimeoutError (the coroutine cancelled) after timeout."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"connector operation took longer than {timeout}s") from None

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()
