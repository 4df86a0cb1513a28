"""Batcher: concurrent requests of one client coalesced into batches (one message, one reply).

A request's chunk loads are issued at once (`asyncio.gather`); each becomes one entry of the
next batch instead of a round trip of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

W = TypeVar("W")  # what one caller asks for
R = TypeVar("R")  # what it gets back


@dataclass(slots=True, eq=False)
class Batcher(Generic[W, R]):
    """run(items) answers each item, in order, with a result or an exception for that item
    alone; an exception raised by run fails every waiting caller. At most `limit` items a
    batch; one batch in flight at a time. A caller that gave up (cancelled, timed out) is
    skipped when its answer comes."""

    run: Callable[[list[W]], Awaitable[list[R | Exception]]]
    limit: int
    queue: list[tuple[W, asyncio.Future]] = field(default_factory=list)
    sender: asyncio.Task | None = None

    async def submit(self, item: W) -> R:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self.queue.append((item, done))
        if self.sender is None or self.sender.done():
            # Runs once the callers issued together have all queued their items.
            self.sender = loop.create_task(self._send())
        return await done

    async def _send(self) -> None:
        while self.queue:
            batch, self.queue = self.queue[: self.limit], self.queue[self.limit :]
            try:
                got = await self.run([item for item, _ in batch])
            except Exception as e:  # the exchange failed as a whole: so does every waiter
                for _, done in batch + self.queue:
                    if not done.done():
                        done.set_exception(e)
                self.queue.clear()
                return
            for (_, done), r in zip(batch, got, strict=True):
                if done.done():
                    continue
                if isinstance(r, Exception):
                    done.set_exception(r)
                else:
                    done.set_result(r)
