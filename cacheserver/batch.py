"""Batcher: concurrent requests of one client coalesced into batches (one message, one reply).

A request's chunk loads are issued at once (`asyncio.gather`); each becomes one entry of the
next batch instead of a round trip of its own. Over a pipelined connection several batches may
be in flight (`depth`).
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
    alone; an exception raised by run fails every waiting caller (cancelling run fails them
    with ConnectionError). At most `limit` items a batch, at most `depth` batches in flight:
    callers issued together share a batch; one arriving while fewer than `depth` are in
    flight starts the next at once, else it joins the batch sent when one lands. A caller
    that gave up (cancelled, timed out) is skipped when its answer comes."""

    run: Callable[[list[W]], Awaitable[list[R | Exception]]]
    limit: int
    depth: int = 1
    queue: list[tuple[W, asyncio.Future]] = field(default_factory=list)
    senders: list[asyncio.Task] = field(default_factory=list)
    starting: bool = False  # a sender was made and has not taken its batch yet

    async def submit(self, item: W) -> R:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self.queue.append((item, done))
        self.senders = [t for t in self.senders if not t.done()]
        if not self.starting and len(self.senders) < self.depth:
            # Runs once the callers issued together have all queued their items.
            self.starting = True
            self.senders.append(loop.create_task(self._send()))
        return await done

    async def _send(self) -> None:
        self.starting = False  # callers from here on start (or wait for) another batch
        while self.queue:
            batch, self.queue = self.queue[: self.limit], self.queue[self.limit :]
            try:
                got = await self.run([item for item, _ in batch])
            except Exception as e:  # the exchange failed as a whole: so does every waiter
                self._fail(batch, e)
                return
            except BaseException:
                self._fail(batch, ConnectionError("batch cancelled"))
                raise
            for (_, done), r in zip(batch, got, strict=True):
                if done.done():
                    continue
                if isinstance(r, Exception):
                    done.set_exception(r)
                else:
                    done.set_result(r)

    def _fail(self, batch: list[tuple[W, asyncio.Future]], e: Exception) -> None:
        for _, done in batch + self.queue:
            if not done.done():
                done.set_exception(e)
        self.queue.clear()
